"""What a client or a dropped adapter folder may not do, on the real server: rewrite the base
every adapter shares (PiSSA, OLoRA, layer replication), load from outside the adapter roots
or tell what lies there, use the adapter routes without ADMIN_API_KEY, or make an all-cache-
hit request attach an evicted adapter. The default adapter's logits are compared to the bit
before and after, and to plain transformers + peft."""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from tests.support.runtime_adapter_client import (
    ADMIN,
    TEXTS,
    TOLERANCE,
    Weights,
    answer_of,
    eventually,
    load,
    metric,
    predict,
    put,
    reference,
    runtime_adapters,
    served,
)
from tests.support.tiny_models import LABELS, TinyModel, build_adapter

PROBES = TEXTS[:8]
# (adapter, the LoraConfig fields a trainer saved it with, the field the refusal names)
BASE_REWRITING = {
    "pissa": ({"init_lora_weights": "pissa"}, "init_lora_weights"),
    "olora": ({"init_lora_weights": "olora"}, "init_lora_weights"),
    "replicated": (
        # LoRA on the two layers the base has, so every tensor fits it: only the config
        # tells that peft would grow the base to three layers first.
        {"layer_replication": [[0, 2], [1, 2]], "layers_to_transform": [0, 1]},
        "layer_replication",
    ),
}


@pytest.fixture(scope="module")
def base_rewriting(
    tiny_bert: TinyModel, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """Adapters saved by peft as their trainers left them (PiSSA and OLoRA not converted to
    plain LoRA), real weights that fit the tiny BERT."""
    root = tmp_path_factory.mktemp("base-rewriting")
    return {
        name: build_adapter(tiny_bert.base, root / name, ["query", "value"], seed=31, **fields)
        for name, (fields, _) in BASE_REWRITING.items()
    }


def reference_logits(base: Path, adapter: Path, texts: list[str]) -> list[tuple[float, ...]]:
    """Logits from transformers and peft alone, each text on its own."""
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForSequenceClassification.from_pretrained(base, num_labels=len(LABELS))
    model = PeftModel.from_pretrained(model, adapter).eval()
    with torch.inference_mode():
        return [
            tuple(model(**tokenizer(text, return_tensors="pt")).logits[0].tolist())
            for text in texts
        ]


def default_logits(client: httpx.Client) -> list[tuple[float, ...]]:
    """The model's own adapter's logits for the probes, computed now (no cache), as JSON
    carries them: Python floats, which print every bit."""
    return [answer_of(predict(client, text, None, raw_scores=True, cache=False)) for text in PROBES]


@pytest.mark.parametrize("name", sorted(BASE_REWRITING))
def test_a_base_rewriting_adapter_is_refused_by_the_api_and_the_folder_and_changes_nothing(
    name: str, tiny_bert: TinyModel, base_rewriting: dict[str, Path], tmp_path: Path
) -> None:
    folder, field = base_rewriting[name], BASE_REWRITING[name][1]
    expected = reference_logits(tiny_bert.base, tiny_bert.adapters["spam"], PROBES)
    watched = tmp_path / "adapters"
    (watched / "tiny").mkdir(parents=True)
    env = {"ADAPTERS_DIR": str(watched), "ADAPTERS_POLL_SECONDS": "0.2"}
    with served(tiny_bert, tmp_path, **env) as server, httpx.Client(base_url=server.url) as client:
        before = default_logits(client)
        for got, want in zip(before, expected, strict=True):
            assert max(abs(a - b) for a, b in zip(got, want, strict=True)) <= TOLERANCE

        refused = load(client, name, folder)
        assert default_logits(client) == before  # to the bit
        assert refused.status_code == 422, refused.text
        message = refused.json()["error"]["message"]
        assert field in message and "adapter_config.json" in message, message
        assert predict(client, PROBES[0], name).status_code == 404

        put(watched / "tiny" / name, folder)
        marks = (f"ADAPTERS_DIR/tiny/{name}:", field)
        eventually(
            lambda: any(all(m in line for m in marks) for line in server.log().splitlines()),
            f"the folder's {name} refused naming {field}",
        )
        assert metric(client, "loraserve_adapter_loads_total", result="refused") == 2
        assert runtime_adapters(client) == {}
        assert default_logits(client) == before


def test_the_adapter_routes_are_closed_without_admin_api_key_and_the_folder_still_loads(
    tiny_bert: TinyModel, tmp_path: Path
) -> None:
    adapter = build_adapter(tiny_bert.base, tmp_path / "v1", ["query", "value"], seed=41)
    watched = tmp_path / "adapters"
    put(watched / "tiny" / "alpha", adapter)
    api_key = "api-key-for-tests"
    user = {"Authorization": f"Bearer {api_key}"}
    routes = {
        "/v1/load_lora_adapter": {"lora_name": "beta", "lora_path": str(adapter)},
        "/v1/unload_lora_adapter": {"lora_name": "alpha"},
    }
    for keys in ({}, {"API_KEY": api_key}):
        env = {"ADMIN_API_KEY": "", **keys, "ADAPTERS_DIR": str(watched)}  # "": unset
        folder = tmp_path / f"run-{len(keys)}"
        folder.mkdir()
        with (
            served(tiny_bert, folder, **env) as server,
            httpx.Client(base_url=server.url, headers=user) as client,
        ):
            for path, body in routes.items():
                for headers in ({}, user, ADMIN):
                    closed = httpx.post(f"{server.url}{path}", json=body, headers=headers)
                    assert closed.status_code == 403, (keys, path, headers, closed.text)
                    error = closed.json()["error"]
                    assert error["code"] == "forbidden" and "ADMIN_API_KEY" in error["message"]
            # The watched folder needs no key: alpha came from it, and stays.
            assert runtime_adapters(client)["alpha"]["source"] == "folder"
            assert predict(client, PROBES[0], "alpha").status_code == 200
            assert "beta" not in runtime_adapters(client)
            if keys:
                assert httpx.get(f"{server.url}/v1/adapters").status_code == 401


def test_a_lora_path_outside_the_roots_is_refused_alike_whether_it_exists_or_not(
    tiny_bert: TinyModel, tmp_path: Path
) -> None:
    outside = tmp_path / "outside"
    real = build_adapter(tiny_bert.base, outside / "v1", ["query", "value"], seed=42)
    first, second = tmp_path / "roots" / "first", tmp_path / "roots" / "second"
    first.mkdir(parents=True)
    inside = shutil.copytree(real, second / "v1")
    (first / "link-out").symlink_to(real, target_is_directory=True)
    (first / "link-in").symlink_to(inside, target_is_directory=True)
    half = first / "half-linked"  # its own config, the weights a link to a file outside
    half.mkdir()
    shutil.copy(real / "adapter_config.json", half / "adapter_config.json")
    (half / "adapter_model.safetensors").symlink_to(real / "adapter_model.safetensors")
    env = {"ADAPTER_ROOTS": f"{first}, {second}"}
    with served(tiny_bert, tmp_path, **env) as server, httpx.Client(base_url=server.url) as client:
        refusals = [
            load(client, "a", real),  # an adapter that exists, outside
            load(client, "a", outside / "nothing-here"),  # nothing there
            load(client, "a", Path("/etc")),  # a folder of the system
            load(client, "a", first / ".." / ".." / "outside" / "v1"),  # up and out
            load(client, "a", first / "link-out"),  # a link in a root, pointing out
            load(client, "a", half),
        ]
        for refused in refusals:
            assert refused.status_code == 403, refused.text
            assert refused.content == refusals[0].content  # the same bytes, whatever is there
        assert "ADAPTER_ROOTS" in refusals[0].json()["error"]["message"]
        assert runtime_adapters(client) == {}

        assert load(client, "a", inside).status_code == 200
        linked = load(client, "b", first / "link-in")  # a link from one root into another
        assert linked.status_code == 200, linked.text


def test_an_all_cache_hit_request_does_not_attach_an_evicted_adapter(
    tiny_bert: TinyModel, tmp_path: Path
) -> None:
    v1, v2 = (
        build_adapter(tiny_bert.base, tmp_path / name, ["query", "value"], seed=seed)
        for name, seed in (("v1", 51), ("v2", 52))
    )
    texts = TEXTS[:6]
    answers = Weights(v1, reference(tiny_bert.base, v1, texts))
    env = {"MAX_ADAPTERS_PER_MODEL": "1"}
    with served(tiny_bert, tmp_path, **env) as server, httpx.Client(base_url=server.url) as client:
        assert load(client, "a", v1).status_code == 200
        for text in texts[:5]:  # answered by the model, and cached under a's identity
            assert answers.gave(text, answer_of(predict(client, text, "a")))
        assert load(client, "b", v2).status_code == 200  # one resident at most: a evicted
        assert not runtime_adapters(client)["a"]["resident"]

        for text in texts[:5]:
            response = predict(client, text, "a")
            assert answers.gave(text, answer_of(response))
            assert response.headers["X-Cache"].endswith("model=0"), response.headers
        assert metric(client, "loraserve_adapter_loads_total", result="reloaded") == 0
        assert not runtime_adapters(client)["a"]["resident"]

        # A text no tier holds needs the weights: a is attached again for it.
        assert answers.gave(texts[5], answer_of(predict(client, texts[5], "a")))
        assert metric(client, "loraserve_adapter_loads_total", result="reloaded") == 1
        assert runtime_adapters(client)["a"]["resident"]
        assert runtime_adapters(client)["a"]["requests"] == 11  # cache hits count too
