"""The model alone, no HTTP: texts per second of `Predictor.forward` in a loop.

Run by `bench.throughput` in a process of its own (`python -m bench.raw_model BODIES`), so
the thread count is set before torch starts and nothing else shares the process. It loads the
model as the server does (the same settings from the environment, the server's `Registry`:
packing where it applies, the same warm-up), tokenizes every text once with
`Predictor.encode` — tokenizing is then not timed — and prints one JSON line: texts/s for
each way of forming batches.

- `batch32`: batches of 32 in the texts' own order, run as the server runs them (packed
  where the model packs) — the "model's own limit" the served system is compared with;
- `batch32_sorted`: the same texts sorted by length first, so a padded batch carries almost
  no padding — the best case for a padding batcher;
- `batch32_padded`: batch32 padded to each batch's longest row (what packing saves);
- `batch1`: one text per forward — what a server without batching can reach at most.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from api.cli import quiet_libraries
from api.models.predictor import Predictor
from api.models.registry import Registry
from api.models.spec import load_models_file
from api.settings import load_settings

Rows = list[list[int]]


def load_predictor(threads: int) -> Predictor:
    """The first declared model (the embedded default unless MODELS_FILE says otherwise)."""
    quiet_libraries()
    torch.set_num_threads(threads)
    settings = load_settings(torch_num_threads=threads)
    spec = load_models_file(settings.models_file, settings.adapter_dirs)[0]
    registry = Registry([spec], settings)
    registry.load_all()  # loads, packs where it applies, warms up: what the server does
    registry.close()  # its device thread: here every forward runs on the main thread
    return registry.models[spec.name].predictor


def batches_of(rows: Rows, size: int) -> list[Rows]:
    """Consecutive batches of `size` rows (a short last one is dropped: every batch is full)."""
    return [rows[i : i + size] for i in range(0, len(rows) - size + 1, size)]


def texts_per_second(predictor: Predictor, batches: list[Rows], seconds: float) -> float:
    """Forwards the batches in a loop, cycling, for about `seconds` after one warm-up batch."""
    adapter = predictor.loaded.spec.active_default_adapter  # what a request naming none gets
    predictor.forward(batches[0], [adapter] * len(batches[0]))
    done, index = 0, 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        batch = batches[index % len(batches)]
        predictor.forward(batch, [adapter] * len(batch))
        done += len(batch)
        index += 1
    return done / (time.perf_counter() - start)


def measure(bodies: Path, threads: int, seconds: float) -> dict[str, float]:
    """Texts/s for each batching of the texts in `bodies` (one JSON body a line)."""
    texts = [json.loads(line)["inputs"] for line in bodies.read_text("utf-8").splitlines()]
    predictor = load_predictor(threads)
    rows = predictor.encode(texts)
    by_length = sorted(rows, key=len)
    padded = Predictor(predictor.loaded, predictor.pad_to_multiple_of)  # never packs
    return {
        "batch32": texts_per_second(predictor, batches_of(rows, 32), seconds),
        "batch32_sorted": texts_per_second(predictor, batches_of(by_length, 32), seconds),
        "batch32_padded": texts_per_second(padded, batches_of(rows, 32), seconds),
        "batch1": texts_per_second(predictor, batches_of(rows, 1), seconds),
        "packed": float(predictor.packs_batches),
        "threads": float(torch.get_num_threads()),
        "mean_tokens": sum(map(len, rows)) / len(rows),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "bodies", type=Path, help="file of JSON bodies {'inputs': text}, one a line"
    )
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--seconds", type=float, default=8.0, help="timed seconds per batching")
    args = parser.parse_args()
    print(json.dumps(measure(args.bodies, args.threads, args.seconds)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
