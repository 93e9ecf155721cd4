"""GGUF bases: a tiny Llama written as a real GGUF file, converted once, and served.

The GGUF is written with the `gguf` package's own writer, the way llama.cpp's converter
writes a Llama (q/k rows permuted, byte-level BPE vocabulary and merges as metadata), so the
conversion runs through exactly the code path a downloaded file takes.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import gguf
import httpx
import numpy as np
import pytest
import torch
from peft import PeftModel
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
)

from api.models.checkpoint import sha256_of
from api.models.convert import staging as staging_module
from api.models.convert.gguf import GgufError, convert_gguf
from api.models.loader import LoadError, load_model
from api.models.predictor import Predictor
from api.models.spec import ModelSpec
from tests.support.in_process import make_settings
from tests.support.server_process import ServerProcess, run_server
from tests.support.tiny_models import LABELS, build_adapter, write_models_file

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BOS, EOS = 1, 2
CORPUS = [
    "WINNER!! claim your free prize now, txt WIN to 80086",
    "are we still meeting for lunch tomorrow? ok see you later",
    "URGENT: call now to claim £1000 cash",
    "sorry i'll call you later, love you",
]
TEXT = "Free prize! Call now, see you at lunch?"
HEADS, KV_HEADS, LAYERS = 4, 2, 2
GGUF_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
# Written as llama.cpp's Q8_0 blocks in the quantized file: the dequantization path.
QUANTIZED = ("ffn_gate", "ffn_up", "ffn_down")


@dataclass(frozen=True)
class TinyGguf:
    """A GGUF file, its sha256, and what it was made from."""

    path: Path
    sha256: str
    reference: LlamaForCausalLM
    tokenizer: Tokenizer


def byte_level_bpe() -> Tokenizer:
    """A small GPT-2-style byte-level BPE, the kind SmolLM2 and Llama 3 ship."""
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(CORPUS * 5, trainer)
    return core


def llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp stores q/k rows interleaved per rotary pair; transformers undoes it on load."""
    rows, *rest = weight.shape
    pairs = weight.reshape(heads, 2, rows // heads // 2, *rest)
    return pairs.swapaxes(1, 2).reshape(weight.shape)


def write_tiny_gguf(path: Path, quantized: bool, seed: int = 0) -> TinyGguf:
    """A 2-layer Llama and its tokenizer as one GGUF file (F32, or F32 with Q8_0 MLPs), its
    weights drawn with `seed`."""
    tokenizer = byte_level_bpe()
    vocab = tokenizer.get_vocab()
    tokens = sorted(vocab, key=vocab.__getitem__)
    merges = [" ".join(pair) for pair in json.loads(tokenizer.to_str())["model"]["merges"]]
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokens),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=64,
        bos_token_id=BOS,
        eos_token_id=EOS,
        tie_word_embeddings=False,
        rms_norm_eps=1e-5,
    )
    reference = LlamaForCausalLM(config).eval()

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(64)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(128)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(64 // HEADS)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in SPECIALS else 1 for t in tokens])  # 3 is CONTROL
    writer.add_token_merges(merges)
    writer.add_bos_token_id(BOS)
    writer.add_eos_token_id(EOS)
    writer.add_pad_token_id(EOS)  # as SmolLM2's file does
    writer.add_add_bos_token(False)

    weights = {k: v.detach().numpy() for k, v in reference.state_dict().items()}
    writer.add_tensor("token_embd.weight", weights["model.embed_tokens.weight"])
    for layer in range(LAYERS):
        for hf_name, gguf_name in GGUF_NAMES.items():
            weight = weights[f"model.layers.{layer}.{hf_name}.weight"]
            if gguf_name in ("attn_q", "attn_k"):
                weight = llama_cpp_permute(weight, HEADS if gguf_name == "attn_q" else KV_HEADS)
            name = f"blk.{layer}.{gguf_name}.weight"
            if quantized and gguf_name in QUANTIZED:
                q8 = gguf.GGMLQuantizationType.Q8_0
                blocks = gguf.quants.quantize(np.ascontiguousarray(weight), q8)
                writer.add_tensor(name, blocks, raw_shape=blocks.shape, raw_dtype=q8)
            else:
                writer.add_tensor(name, np.ascontiguousarray(weight))
    writer.add_tensor("output_norm.weight", weights["model.norm.weight"])
    writer.add_tensor("output.weight", weights["lm_head.weight"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return TinyGguf(path, sha256_of(path), reference, tokenizer)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> TinyGguf:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-f32.gguf", quantized=False)


@pytest.fixture(scope="module")
def tiny_q8_gguf(tmp_path_factory: pytest.TempPathFactory) -> TinyGguf:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-q8_0.gguf", quantized=True)


def logits_of(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits  # type: ignore[no-any-return]


def test_f32_gguf_converts_to_the_same_model_and_tokenizer(
    tiny_gguf: TinyGguf, tmp_path: Path
) -> None:
    out = convert_gguf(tiny_gguf.path, tiny_gguf.sha256, tmp_path / "tiny", dtype=torch.float32)

    assert out == tmp_path / "tiny"
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    assert all(p.stat().st_mode & 0o044 == 0o044 for p in [out, *out.iterdir()])  # others read
    config = json.loads((out / "config.json").read_text(encoding="utf-8"))
    assert "quantization_config" not in config  # a plain checkpoint, not a GGUF-quantized one
    assert config["architectures"] == ["LlamaForCausalLM"]
    tokenizer = AutoTokenizer.from_pretrained(out)
    ids = tiny_gguf.tokenizer.encode(TEXT).ids
    assert tokenizer(TEXT)["input_ids"] == ids
    assert tokenizer.eos_token_id == EOS
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, use_safetensors=True)
    # F32 tensors are copied, q/k un-permuted: the converted model is the original, exactly.
    assert torch.equal(logits_of(model.eval(), ids), logits_of(tiny_gguf.reference, ids))


def test_quantized_blocks_are_dequantized_into_bfloat16_by_default(
    tiny_q8_gguf: TinyGguf, tmp_path: Path
) -> None:
    out = convert_gguf(tiny_q8_gguf.path, tiny_q8_gguf.sha256, tmp_path / "tiny-q8")

    model = AutoModelForCausalLM.from_pretrained(out, use_safetensors=True)
    assert model.dtype == torch.bfloat16
    reader = gguf.GGUFReader(str(tiny_q8_gguf.path))
    tensor = next(t for t in reader.tensors if t.name == "blk.0.ffn_up.weight")
    assert tensor.tensor_type == gguf.GGMLQuantizationType.Q8_0
    expected = torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type).copy())
    stored = model.model.layers[0].mlp.up_proj.weight
    assert torch.equal(stored, expected.to(torch.bfloat16))
    # 8-bit blocks and bf16 storage cost little: the model still answers like the original.
    ids = tiny_q8_gguf.tokenizer.encode(TEXT).ids
    converted = logits_of(model.float().eval(), ids)
    assert torch.allclose(converted, logits_of(tiny_q8_gguf.reference, ids), atol=0.05)


def test_converted_folder_loads_as_a_sequence_classifier_from_safetensors(
    tiny_gguf: TinyGguf, tmp_path: Path
) -> None:
    out = convert_gguf(tiny_gguf.path, tiny_gguf.sha256, tmp_path / "tiny")

    model, info = AutoModelForSequenceClassification.from_pretrained(
        out, num_labels=2, use_safetensors=True, output_loading_info=True
    )
    assert type(model).__name__ == "LlamaForSequenceClassification"
    assert info["missing_keys"] == {"score.weight"}  # only the new head, which adapters carry
    assert model.config.pad_token_id == EOS  # batches pad with EOS, as the file says


def test_sha256_mismatch_is_refused_naming_the_file(tiny_gguf: TinyGguf, tmp_path: Path) -> None:
    with pytest.raises(GgufError, match="does not match pinned") as caught:
        convert_gguf(tiny_gguf.path, "0" * 64, tmp_path / "tiny")

    assert str(tiny_gguf.path) in str(caught.value)
    assert list(tmp_path.iterdir()) == []  # nothing written, not even a temporary folder


def test_missing_file_is_refused_naming_it(tmp_path: Path) -> None:
    missing = tmp_path / "absent.gguf"
    with pytest.raises(GgufError, match=f"{missing}: no such GGUF file"):
        convert_gguf(missing, "0" * 64, tmp_path / "out")


def test_unreadable_gguf_is_refused_and_leaves_no_folder(tmp_path: Path) -> None:
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"GGUF but not really")
    with pytest.raises(GgufError, match="cannot convert") as caught:
        convert_gguf(bogus, sha256_of(bogus), tmp_path / "models" / "bogus")

    assert str(bogus) in str(caught.value)
    assert list((tmp_path / "models").iterdir()) == []


def test_failure_after_writing_leaves_neither_final_nor_temporary_folder(
    tiny_gguf: TinyGguf, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def disk_full(folder: Path) -> None:
        assert (folder / "model.safetensors").is_file()  # everything was written, not yet moved
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(staging_module, "_sync_tree", disk_full)
    with pytest.raises(GgufError, match="No space left on device"):
        convert_gguf(tiny_gguf.path, tiny_gguf.sha256, tmp_path / "models" / "tiny")

    assert list((tmp_path / "models").iterdir()) == []


def test_a_complete_folder_written_meanwhile_is_kept(tiny_gguf: TinyGguf, tmp_path: Path) -> None:
    out = convert_gguf(tiny_gguf.path, tiny_gguf.sha256, tmp_path / "tiny")
    before = (out / "model.safetensors").stat().st_mtime_ns

    # A second converter (another worker starting at the same time) finishes second.
    assert convert_gguf(tiny_gguf.path, tiny_gguf.sha256, out) == out
    assert (out / "model.safetensors").stat().st_mtime_ns == before
    assert [p.name for p in tmp_path.iterdir()] == ["tiny"]


def test_an_incomplete_folder_in_the_way_is_refused(tiny_gguf: TinyGguf, tmp_path: Path) -> None:
    out = tmp_path / "tiny"
    out.mkdir()
    (out / "notes.txt").write_text("half a copy", encoding="utf-8")

    with pytest.raises(GgufError, match="not a complete conversion"):
        convert_gguf(tiny_gguf.path, tiny_gguf.sha256, out)


def gguf_adapter(tiny_gguf: TinyGguf, tmp_path: Path) -> Path:
    """A LoRA adapter with a classification head, trained (randomly) against the converted
    weights, as scripts/train_llm_adapter does."""
    scratch = convert_gguf(tiny_gguf.path, tiny_gguf.sha256, tmp_path / "scratch")
    return build_adapter(scratch, tmp_path / "adapter", ["q_proj", "v_proj"], seed=1)


# peft notes that the adapter was built on another folder holding the same weights.
@pytest.mark.filterwarnings("ignore:The PEFT config's `base_model_name_or_path` was renamed")
def test_loader_converts_a_declared_gguf_once_and_serves_it_with_an_adapter(
    tiny_gguf: TinyGguf, tmp_path: Path
) -> None:
    adapter = gguf_adapter(tiny_gguf, tmp_path)
    spec = ModelSpec.model_validate(
        {
            "name": "tiny-gguf",
            "base": "tiny-llama",
            "gguf": {"file": str(tiny_gguf.path), "sha256": tiny_gguf.sha256},
            "labels": LABELS,
            "max_length": 32,
            "adapters": [{"name": "spam", "path": adapter}],
        }
    )
    settings = make_settings(model_cache_dir=tmp_path / "cache")

    loaded = load_model(spec, settings)
    assert loaded.folder == tmp_path / "cache" / "gguf" / tiny_gguf.sha256
    assert (loaded.folder / "model.safetensors").is_file()
    scores = Predictor(loaded).predict(["free prize now", "see you at lunch tomorrow ok"])
    assert all(abs(sum(s.probabilities) - 1.0) < 1e-5 for s in scores)

    mtime = (loaded.folder / "model.safetensors").stat().st_mtime_ns
    load_model(spec, settings)  # the second load reads the folder; it does not convert again
    assert (loaded.folder / "model.safetensors").stat().st_mtime_ns == mtime


def test_loader_refuses_a_gguf_whose_sha256_is_not_the_pinned_one(
    tiny_gguf: TinyGguf, tmp_path: Path
) -> None:
    spec = ModelSpec.model_validate(
        {
            "name": "tiny-gguf",
            "base": "tiny-llama",
            "gguf": {"file": str(tiny_gguf.path), "sha256": "f" * 64},
            "labels": LABELS,
        }
    )
    with pytest.raises(LoadError, match="does not match pinned") as caught:
        load_model(spec, make_settings(model_cache_dir=tmp_path / "cache"))
    assert str(tiny_gguf.path) in str(caught.value)


SERVED_TEXTS = ["free prize now", "see you at lunch tomorrow ok", TEXT]


def reference_logits(gguf_path: Path, adapter: Path, texts: list[str]) -> list[float]:
    """The texts' logits, one after the other, from the GGUF as plain transformers reads it
    (dequantized into the bfloat16 a conversion stores, computed in float32), with the adapter
    on top: nothing of the service's conversion, cache or loader."""
    source, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=name)
    base = AutoModelForSequenceClassification.from_pretrained(
        source, gguf_file=name, dtype=torch.bfloat16, num_labels=len(LABELS)
    )
    # transformers refuses `.float()` on a model read from a GGUF: cast tensor by tensor.
    for tensor in (*base.parameters(), *base.buffers()):
        tensor.data = tensor.data.float()
    model = PeftModel.from_pretrained(base, str(adapter)).eval()
    with torch.no_grad():
        rows = [model(**tokenizer(text, return_tensors="pt")).logits[0] for text in texts]
    return torch.cat(rows).tolist()


def served_logits(server: ServerProcess, model: str) -> list[float]:
    """The server's logits for SERVED_TEXTS, one text after the other, in LABELS' order.

    Each text is asked alone: this nf4 Llama is not batch-invariant (its logits move in the
    last bits with the padding batch-mates bring), and a server groups a request's texts of
    different lengths by the cost model it measures at warm-up, which two servers under load
    measured differently: their logits for one request of all three texts once differed by two
    float32 ulps."""
    logits: list[float] = []
    for text in SERVED_TEXTS:
        answer = httpx.post(
            f"{server.url}/predict",
            json={"inputs": [text], "model": model, "raw_scores": True, "cache": False},
        )
        assert answer.status_code == 200, answer.text
        row = answer.json()[0]
        logits += [next(i["score"] for i in row if i["label"] == k) for k in LABELS]
    return logits


# peft notes that the adapter was built on another folder holding the same weights.
@pytest.mark.filterwarnings("ignore:The PEFT config's `base_model_name_or_path` was renamed")
def test_a_new_gguf_under_an_old_name_is_converted_again_and_served(
    tiny_gguf: TinyGguf, tmp_path: Path
) -> None:
    adapter = gguf_adapter(tiny_gguf, tmp_path)
    gguf_file = tmp_path / "models" / "tiny-llama.gguf"  # the one path the models file names
    gguf_file.parent.mkdir()
    shutil.copyfile(tiny_gguf.path, gguf_file)
    entry = {
        "name": "tiny-gguf",
        "base": "tiny-llama",
        "gguf": {"file": str(gguf_file), "sha256": tiny_gguf.sha256},
        "labels": LABELS,
        "max_length": 32,
        "adapters": [{"name": "spam", "path": str(adapter)}],
    }
    models = write_models_file(tmp_path / "models.yaml", [entry])
    env = {"MODELS_FILE": str(models), "MODEL_CACHE_DIR": str(tmp_path / "model-cache")}
    with run_server(env, tmp_path) as server:
        server.wait_ready()
        old = served_logits(server, "tiny-gguf")
    assert old == pytest.approx(reference_logits(gguf_file, adapter, SERVED_TEXTS), abs=1e-4)

    # A new release of the model: other weights, the same file name and model name.
    new = write_tiny_gguf(gguf_file, quantized=False, seed=7)
    write_models_file(models, [{**entry, "gguf": {"file": str(gguf_file), "sha256": new.sha256}}])
    with run_server(env, tmp_path) as server:
        server.wait_ready()
        served = served_logits(server, "tiny-gguf")
        (listed,) = httpx.get(f"{server.url}/models").json()["models"]

    want = reference_logits(gguf_file, adapter, SERVED_TEXTS)
    assert listed["revision"] == new.sha256[:12]
    assert served == pytest.approx(want, abs=1e-4)
    assert want != pytest.approx(old, abs=1e-2)  # the two releases answer apart
    converted = sorted(p.name for p in (tmp_path / "model-cache" / "gguf").iterdir())
    assert converted == sorted([tiny_gguf.sha256, new.sha256])


# peft notes that the adapter was built on another folder holding the same weights.
@pytest.mark.filterwarnings("ignore:The PEFT config's `base_model_name_or_path` was renamed")
def test_two_starts_racing_on_one_cache_both_serve_and_agree(
    tiny_gguf: TinyGguf, tmp_path: Path
) -> None:
    """Two replicas start together on one empty cache: each converts the GGUF and
    pre-quantizes it in a staging folder of its own (while the other sweeps the cache for
    dead writers' folders); the first rename publishes, the other keeps what it finds."""
    adapter = gguf_adapter(tiny_gguf, tmp_path)
    entry = {
        "name": "tiny-gguf",
        "base": "tiny-llama",
        "gguf": {"file": str(tiny_gguf.path), "sha256": tiny_gguf.sha256},
        "labels": LABELS,
        "max_length": 32,
        "quantization": "nf4",
        "adapters": [{"name": "spam", "path": str(adapter)}],
    }
    cache = tmp_path / "model-cache"
    env = {
        "MODELS_FILE": str(write_models_file(tmp_path / "models.yaml", [entry])),
        "MODEL_CACHE_DIR": str(cache),
    }
    with run_server(env, tmp_path) as first, run_server(env, tmp_path) as second:
        first.wait_ready()
        second.wait_ready()
        answers = [served_logits(server, "tiny-gguf") for server in (first, second)]
        states = [
            httpx.get(f"{server.url}/models").json()["models"][0]["prequantized_cache"]
            for server in (first, second)
        ]

    assert answers[0] == answers[1]
    assert states in (["written", "written"], ["written", "hit"], ["hit", "written"])
    assert [p.name for p in (cache / "gguf").iterdir()] == [tiny_gguf.sha256]
    assert len(list((cache / "prequantized").iterdir())) == 1  # no staging or broken copy
