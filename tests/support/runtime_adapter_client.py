"""Tests' client for run-time adapters on the real server: the requests (predict, load,
the adapter list, a metric), the answers plain transformers + peft give, a server with
run-time adapters on the tiny BERT, and an adapter written into a watched folder."""

from __future__ import annotations

import hashlib
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import torch
from peft import PeftModel
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from tests.support.server_process import ServerProcess, run_server
from tests.support.tiny_models import LABELS, WORDS, TinyModel, tiny_models_file

TOLERANCE = 1e-5  # RELIABILITY.md: the same scores to 1e-5 on CPU, whatever the path
# Texts of the tiny vocabulary, all distinct; 3 to 7 words each.
TEXTS = [
    " ".join(WORDS[(7 * index + 5 * word) % len(WORDS)] for word in range(3 + index % 5))
    for index in range(40)
]
ADMIN_KEY = "admin-key-for-tests"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}  # the load and unload routes need it


@dataclass(frozen=True)
class Weights:
    """An adapter folder, and what plain transformers + peft answer with it, text by text."""

    folder: Path
    answers: dict[str, tuple[float, ...]]

    def gave(self, text: str, answer: tuple[float, ...]) -> bool:
        """Whether `answer` is this adapter's answer to `text`."""
        expected = self.answers[text]
        return all(abs(a - b) <= TOLERANCE for a, b in zip(answer, expected, strict=True))

    @property
    def digest(self) -> str:
        return hashlib.sha256((self.folder / "adapter_model.safetensors").read_bytes()).hexdigest()


def reference(base: Path, folder: Path, texts: list[str]) -> dict[str, tuple[float, ...]]:
    """Probabilities from transformers and peft alone, each text on its own: none of the
    service's code (no packing, batching, run-time attaching or caching)."""
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForSequenceClassification.from_pretrained(base, num_labels=len(LABELS))
    model = PeftModel.from_pretrained(model, folder).eval()
    answers = {}
    with torch.inference_mode():
        for text in texts:
            inputs = tokenizer(text, truncation=True, max_length=32, return_tensors="pt")
            answers[text] = tuple(torch.softmax(model(**inputs).logits[0], -1).tolist())
    return answers


@contextmanager
def served(tiny: TinyModel, folder: Path, **env: str) -> Iterator[ServerProcess]:
    """The real server on the tiny BERT with its own adapter `spam`, taking run-time ones
    from under the test session's folder (where every adapter of these tests is built)."""
    models = tiny_models_file(folder, tiny, adapters=("spam",), runtime_adapters=True)
    settings = {
        "MODELS_FILE": str(models),
        "DISK_CACHE_DIR": str(folder / "cache"),
        "ADMIN_API_KEY": ADMIN_KEY,
        "ADAPTER_ROOTS": str(folder.parent),
        **env,
    }
    with run_server(settings, folder) as server:
        server.wait_ready()
        yield server


def answer_of(response: httpx.Response) -> tuple[float, ...]:
    """One text's answer as probabilities in label order."""
    assert response.status_code == 200, response.text
    scores = {entry["label"]: entry["score"] for entry in response.json()}
    return tuple(scores[label] for label in LABELS)


def predict(client: httpx.Client, text: str, adapter: str | None, **extra: Any) -> httpx.Response:
    body = {"inputs": text, **({"adapter": adapter} if adapter else {}), **extra}
    return client.post("/predict", json=body)


def load(client: httpx.Client, name: str, folder: Path, **fields: Any) -> httpx.Response:
    body = {"lora_name": name, "lora_path": str(folder), **fields}
    return client.post("/v1/load_lora_adapter", json=body, headers=ADMIN)


def runtime_adapters(client: httpx.Client) -> dict[str, dict[str, Any]]:
    """GET /v1/adapters: the tiny model's run-time adapters by name."""
    [model] = client.get("/v1/adapters").json()["models"]
    return {a["name"]: a for a in model["adapters"] if a["source"] != "models_file"}


def served_set(client: httpx.Client) -> dict[str, tuple[str, str, bool]]:
    """Each run-time adapter's digest, load time and residency: what a refusal must not move."""
    return {
        name: (entry["digest"], entry["loaded_at"], entry["resident"])
        for name, entry in runtime_adapters(client).items()
    }


def metric(client: httpx.Client, name: str, **labels: str) -> float:
    """One sample of the server's /metrics (0 when absent)."""
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return 0.0


def eventually(check: Callable[[], bool], what: str, seconds: float = 15.0) -> None:
    """Polls `check` until true (a watched-folder change takes a scan or two)."""
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, f"not within {seconds} s: {what}"
        time.sleep(0.05)


def put(folder: Path, source: Path, pinned: bool = False) -> None:
    """Writes an adapter into the watched folder as a deploy would: copied aside, then
    renamed in (a folder) or replaced file by file (an update)."""
    staging = folder.parent / f".{folder.name}.new"
    shutil.copytree(source, staging)
    if pinned:
        (staging / "pinned").touch()
    if not folder.exists():
        staging.rename(folder)
        return
    for path in staging.iterdir():
        path.replace(folder / path.name)
    staging.rmdir()
