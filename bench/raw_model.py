"""The model alone, no HTTP: texts per second of `Predictor.forward` in a loop.

Run by `bench.throughput` in a process of its own (`python -m bench.raw_model BODIES`), so
the thread count is set before torch starts and nothing else shares the process. It loads the
model as the server does (the same settings from the environment, the server's `Registry`:
packing where it applies, the same warm-up, start-up's heap frozen), tokenizes every text
once with `Predictor.encode` — tokenizing is then not timed — and prints one JSON line:
texts/s for each way of forming batches.

With `--serve` it stays up instead: it prints one JSON line once loaded (the texts' mean
length, whether it packs), then answers each line read on stdin, a JSON object
`{"seconds": s, "batchings": [...]}`, with one JSON line of texts/s for each batching named.
`bench.throughput` runs the model's own limit this way between its served runs, so that the
ratio of the two is not the machine's drift between two moments minutes apart.

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
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from api.models.predictor import Predictor
from api.models.registry import Registry
from api.models.spec import load_models_file
from api.observability.logs import quiet_libraries
from api.serving.heap import ServingHeap
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
    ServingHeap(settings.gc_gen0_threshold).settle()  # as the server does once ready
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


BATCHINGS = ("batch32", "batch32_sorted", "batch32_padded", "batch1")
Measure = Callable[[str, float], float]  # (batching, seconds) -> texts/s


def prepare(bodies: Path, threads: int) -> tuple[Measure, dict[str, float]]:
    """The model loaded and the texts of `bodies` (one JSON body a line) tokenized: a function
    timing one batching, and what describes the run (mean tokens, packing, threads)."""
    texts = [json.loads(line)["inputs"] for line in bodies.read_text("utf-8").splitlines()]
    predictor = load_predictor(threads)
    rows = predictor.encode(texts)
    padded = Predictor(predictor.loaded, predictor.pad_to_multiple_of)  # never packs
    runs = {
        "batch32": (predictor, batches_of(rows, 32)),
        "batch32_sorted": (predictor, batches_of(sorted(rows, key=len), 32)),
        "batch32_padded": (padded, batches_of(rows, 32)),
        "batch1": (predictor, batches_of(rows, 1)),
    }

    def measure(batching: str, seconds: float) -> float:
        runner, batches = runs[batching]
        return texts_per_second(runner, batches, seconds)

    described = {
        "packed": float(predictor.packs_batches),
        "threads": float(torch.get_num_threads()),
        "mean_tokens": sum(map(len, rows)) / len(rows),
    }
    return measure, described


def serve(measure: Measure, described: dict[str, float]) -> None:
    """Answers each request line on stdin with a line of texts/s, until stdin closes."""
    print(json.dumps(described), flush=True)
    for line in sys.stdin:
        asked = json.loads(line)
        found = {name: measure(name, float(asked["seconds"])) for name in asked["batchings"]}
        print(json.dumps(found), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "bodies", type=Path, help="file of JSON bodies {'inputs': text}, one a line"
    )
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--seconds", type=float, default=8.0, help="timed seconds per batching")
    parser.add_argument("--serve", action="store_true", help="measure on request (see above)")
    args = parser.parse_args()
    measure, described = prepare(args.bodies, args.threads)
    if args.serve:
        serve(measure, described)
    else:
        found = {name: measure(name, args.seconds) for name in BATCHINGS}
        print(json.dumps({**found, **described}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
