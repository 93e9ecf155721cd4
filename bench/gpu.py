"""The GPU benchmark: the users' two models in their exact shapes, served together by the real
server on one GPU, each figure beside the users' target.

Run on a machine with one NVIDIA GPU, from the repository root: `python -m bench.gpu` writes
bench/reports/gpu.{md,json}, naming the device. `python -m bench.gpu --smoke` runs the same
code on tiny shapes on whatever device there is (the CPU where there is no GPU), with few
iterations, into bench/out/gpu-smoke/: the test suite runs it so that this path cannot rot.
Its figures are not a GPU's, and it never writes into bench/reports/.

What it does (5.9 minutes on an H200, the full plan: 8 s a point at each of 1–128 clients;
`--seconds 4 --clients 1,8,32,64,128` takes about 4):

1. builds EXAONE-3.5-2.4B-Instruct as the hub ships it (EXAONE layout) with a rank-16 LoRA
   adapter, and KoELECTRA-small-v3-discriminator with a LoRA adapter, from their configs with
   random weights drawn on the GPU (bench/gpu_models.py), into bench/out/gpu/;
2. starts the real server (`python -m api.cli`) on them, as the users declare them (EXAONE nf4
   with a bfloat16 compute dtype, KoELECTRA bf16, MAX_MEMORY_GB=16), three times: a first start
   (EXAONE converted to the Llama layout, quantized, saved pre-quantized), a start with
   PREQUANTIZED_CACHE=false (quantized at start from the converted folder), a later start (from
   the pre-quantized checkpoint); each timed from the spawn to /ready 200, with /models' load
   phases; then reads of the files alone (the page cache is warm by then);
3. on the later start's server: batch latency at 1/8/32 texts of 128 and 512 tokens, GPU
   memory allocated and reserved, throughput and p99 at 1–128 clients per model (clients in
   processes of at most 16: bench/load_clients.py), and the cascade (KoELECTRA first, EXAONE
   on doubt);
4. KoELECTRA again with PACK_BATCHES=false: packed against padded batches on the GPU;
5. once the servers are stopped, the same batches in this process (bench/gpu_forward.py): the
   model's own call and `Predictor.forward`, beside the served batch time.

A GPU machine's image may lack what the service needs beyond torch and a few common packages,
or hold other versions: requirements/gpu-machine.txt lists what this benchmark ran with, and
how to carry it as wheels to a machine that cannot reach PyPI.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import platform
import shutil
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import yaml

from api.settings import load_settings
from bench import gpu_forward, gpu_load, gpu_report
from bench.gpu_models import LABELS, TINY, USERS, BuiltModels, Shapes, build_all, texts
from bench.harness import write_report
from bench.load_worker import read_bytes

REPO = Path(__file__).resolve().parents[1]
REPORTS = REPO / "bench" / "reports"
OUT = REPO / "bench" / "out"
BATCH_SIZES = (1, 8, 32)
EXAONE, KOELECTRA, CASCADE = "exaone", "koelectra", "cascade"
# The cascade's threshold is set so that this share of the texts goes on to EXAONE: the most
# the embedded cascade was allowed when its threshold was fitted (scripts/train_llm_adapter).
ESCALATED_SHARE = 0.10


@dataclass(frozen=True)
class Plan:
    """What one run measures, and for how long."""

    shapes: Shapes
    lengths: tuple[int, int]  # tokens per text: the short (also the load's) and the long
    repeats: int
    clients: tuple[int, ...]
    seconds: float
    warmup: float
    cascade_clients: int


FULL = Plan(
    USERS,
    lengths=(128, 512),
    repeats=10,
    clients=(1, 2, 4, 8, 16, 32, 64, 128),
    seconds=8.0,
    warmup=2.0,
    cascade_clients=32,
)
SMOKE = Plan(
    TINY, lengths=(32, 64), repeats=1, clients=(1, 4), seconds=1.0, warmup=0.2, cascade_clients=4
)


def koelectra_entry(base: Path, adapter: Path, max_length: int) -> dict[str, Any]:
    """KoELECTRA as the users declare it (docs/models.md): bf16, its spam adapter."""
    return {
        "name": KOELECTRA,
        "base": str(base),
        "quantization": "none",
        "dtype": "bfloat16",
        "adapters": [{"name": "spam", "path": str(adapter)}],
        "labels": LABELS,
        "max_length": max_length,
    }


def models_file(path: Path, built: BuiltModels, max_length: int) -> Path:
    """The users' models file (docs/models.md's), pointing at the built folders."""
    entries: list[dict[str, Any]] = [
        koelectra_entry(built.koelectra, built.koelectra_adapter, max_length),
        {
            "name": EXAONE,
            "base": str(built.exaone),
            "quantization": "nf4",
            "compute_dtype": "bfloat16",
            "adapters": [{"name": "spam", "path": str(built.exaone_adapter)}],
            "labels": LABELS,
            "max_length": max_length,
        },
    ]
    path.write_text(yaml.safe_dump({"models": entries}, sort_keys=False), encoding="utf-8")
    return path


def server_env(work: Path, models: Path, device: str, longest: int) -> dict[str, str]:
    """The users' settings, caches off (every request reaches the model)."""
    return {
        "MODELS_FILE": str(models),
        "MODEL_CACHE_DIR": str(work / "model-cache"),
        "DISK_CACHE_DIR": str(work / "answers"),
        "DISK_CACHE_MAX_BYTES": "0",
        "LRU_CACHE_ENTRIES": "0",
        "DEVICE": device,
        "MAX_MEMORY_GB": "16",
        # 32 texts of 512 tokens in one forward, as the latency grid asks (default 8,192).
        "MAX_BATCH_TOKENS": str(max(BATCH_SIZES) * longest),
        # Every request queued and answered: the latencies are what a client would wait, not
        # cut short by 429s (which the default gives a request expected past 2 s).
        "ADMISSION_CONTROL": "false",
        "OFFLINE": "true",
    }


def start_record(started: gpu_load.Started) -> dict[str, Any]:
    """A start's time to ready and each model's load phases and pre-quantized state."""
    return {
        "ready_s": started.ready_s,
        "listening_s": started.listening_s,
        "models": {
            name: {
                "load_seconds": model["load_seconds"],
                "prequantized_cache": model["prequantized_cache"],
                "weight_bytes": model["weight_bytes"],
                "device": model["device"],
                "packed_batches": model["packed_batches"],
                "batch_max_logit_difference": model["batch_max_logit_difference"],
            }
            for name, model in started.models.items()
        },
    }


def only_entry(folder: Path) -> Path:
    """The one folder named by a digest under `folder` (a cache of this run's models)."""
    (entry,) = [path for path in folder.iterdir() if len(path.name) == 64]
    return entry


def reads(built: BuiltModels, work: Path) -> dict[str, dict[str, float]]:
    """Reading each folder's weight files alone into memory: the floor of a load."""
    cache = work / "model-cache"
    folders = {
        "EXAONE source (EXAONE layout)": built.exaone,
        "EXAONE converted (Llama layout)": only_entry(cache / "exaone-llama"),
        "EXAONE pre-quantized (nf4)": only_entry(cache / "prequantized"),
        "KoELECTRA": built.koelectra,
    }
    result = {}
    for title, folder in folders.items():
        seconds = []
        for _ in range(3):
            began = time.perf_counter()
            size = len(read_bytes(folder))
            seconds.append(time.perf_counter() - began)
        result[title] = {"gb": size / 1e9, "read_s": statistics.median(seconds)}
    return result


def measure_served(url: str, plan: Plan, corpus: dict[str, dict[int, list[str]]]) -> dict[str, Any]:
    """Everything measured on one running server with both models."""
    short = plan.lengths[0]
    memory = {"after load": gpu_load.gpu_memory(url)}
    latency = [
        {"model": model, "tokens": tokens, **latency_of(url, model, corpus, tokens, size, plan)}
        for model in (KOELECTRA, EXAONE)
        for tokens in plan.lengths
        for size in BATCH_SIZES
    ]
    memory["after the latency grid"] = gpu_load.gpu_memory(url)
    throughput = [
        gpu_load.load(url, model, corpus[model][short], clients, plan.seconds, plan.warmup)
        for model in (KOELECTRA, EXAONE)
        for clients in plan.clients
    ]
    cascade = gpu_load.load(
        url, CASCADE, corpus[KOELECTRA][short], plan.cascade_clients, plan.seconds, plan.warmup
    )
    memory["at the end"] = gpu_load.gpu_memory(url)
    return {"latency": latency, "throughput": throughput, "cascade": cascade, "memory": memory}


def latency_of(
    url: str,
    model: str,
    corpus: dict[str, dict[int, list[str]]],
    tokens: int,
    size: int,
    plan: Plan,
) -> dict[str, Any]:
    return gpu_load.batch_latency(url, model, corpus[model][tokens], size, plan.repeats)


def measure_padded(url: str, plan: Plan, corpus: dict[str, dict[int, list[str]]]) -> dict[str, Any]:
    """KoELECTRA on a server with PACK_BATCHES=false: padded batches, beside the packed ones."""
    size = max(BATCH_SIZES)
    return {
        "latency": [
            {"model": KOELECTRA, "tokens": n, **latency_of(url, KOELECTRA, corpus, n, size, plan)}
            for n in plan.lengths
        ],
        "throughput": gpu_load.load(
            url,
            KOELECTRA,
            corpus[KOELECTRA][plan.lengths[0]],
            plan.cascade_clients,
            plan.seconds,
            plan.warmup,
        ),
    }


def run(plan: Plan, work: Path, smoke: bool) -> dict[str, Any]:
    """The whole benchmark; its raw figures."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    began = time.perf_counter()
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    built = build_all(work / "models", plan.shapes, torch.device(device))
    build_s = time.perf_counter() - began
    if device == "cuda":
        # Each weight was drawn here in float32 and moved to the host; without this, torch
        # keeps the blocks it drew them in (the embedding matrix alone is ~1 GB) reserved in
        # this process, which nvidia-smi's "used" counts beside the server's.
        torch.cuda.empty_cache()
    corpus = {
        KOELECTRA: {n: texts(built.koelectra, n, 64, seed=n) for n in plan.lengths},
        EXAONE: {n: texts(built.exaone, n, 64, seed=n + 1) for n in plan.lengths},
    }
    longest = max(plan.lengths)
    env = server_env(work, models_file(work / "models.yaml", built, longest), device, longest)
    starts: dict[str, Any] = {}
    with gpu_load.server(env, work / "server-first.log") as first:
        starts["first start"] = start_record(first)
        pool = corpus[KOELECTRA][plan.lengths[0]]
        threshold = gpu_load.threshold_for_share(first.url, KOELECTRA, pool, ESCALATED_SHARE)
    # Quantized at start; padded batches too, for KoELECTRA's packed-against-padded figures
    # (PACK_BATCHES changes no load phase but the warm-up's packing check).
    at_start = {**env, "PREQUANTIZED_CACHE": "false", "PACK_BATCHES": "false"}
    with gpu_load.server(at_start, work / "server-quantize-at-start.log") as quantized:
        starts["quantized at start"] = start_record(quantized)
        padded = measure_padded(quantized.url, plan, corpus)
    later_env = {**env, "CASCADE_THRESHOLD": repr(threshold)}
    with gpu_load.server(later_env, work / "server-later.log") as later:
        starts["later start"] = start_record(later)
        file_reads = reads(built, work)
        served = measure_served(later.url, plan, corpus)
    # After the servers: the GPU holds only what this process loads, with their settings.
    settings = load_settings(_env_file=None, **{name.lower(): v for name, v in env.items()})
    forward = gpu_forward.forward_times(
        work / "models.yaml", settings, corpus, BATCH_SIZES, plan.repeats
    )
    return {
        "meta": meta(device, smoke, plan, time.perf_counter() - began, build_s),
        "starts": starts,
        "reads": file_reads,
        **served,
        "padded": padded,
        "forward": forward,
        "cascade_threshold": threshold,
    }


def meta(device: str, smoke: bool, plan: Plan, wall_s: float, build_s: float) -> dict[str, Any]:
    """The device, the software, and what this run was."""
    return {
        **environment(device),
        "smoke": smoke,
        "plan": {
            **asdict(plan),
            "shapes": {"exaone_parameters": plan.shapes.exaone_parameters, **asdict(plan.shapes)},
        },
        "wall_s": wall_s,
        "build_s": build_s,
        "command": " ".join(["python -m bench.gpu", *sys.argv[1:]]),
    }


def environment(device: str) -> dict[str, Any]:
    """The date, the device (its GPU's name, memory, CUDA and driver) and the software."""
    versions: dict[str, str | None] = {}
    for name in ("torch", "transformers", "peft", "bitsandbytes", "accelerate"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    gpu = None
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        gpu = {
            "name": torch.cuda.get_device_name(0),
            "memory_gb": props.total_memory / 1e9,
            "cuda": torch.version.cuda,
            "driver": gpu_load.nvidia_smi_field("driver_version"),
        }
    return {
        "date": f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC",
        "device": device,
        "gpu": gpu,
        "cpu": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "versions": versions,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--smoke", action="store_true", help="tiny shapes, any device, few iterations"
    )
    parser.add_argument(
        "--work", type=Path, help="models, caches and server logs (default bench/out/gpu[-smoke])"
    )
    parser.add_argument(
        "--out",
        type=Path,
        help="where gpu.md and gpu.json go (default bench/reports; with --smoke the work folder)",
    )
    parser.add_argument("--seconds", type=float, help="seconds per load point")
    parser.add_argument(
        "--clients",
        type=lambda text: tuple(int(n) for n in text.split(",")),
        help="client counts, e.g. 1,8,32,128",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print(
            "bench.gpu measures a GPU and none is visible to torch here; `--smoke` runs the "
            "same code on tiny shapes on this device, writing outside bench/reports",
            file=sys.stderr,
        )
        return 2
    plan = SMOKE if args.smoke else FULL
    if args.seconds is not None:
        plan = replace(plan, seconds=args.seconds)
    if args.clients is not None:
        plan = replace(plan, clients=args.clients)
    work = args.work or OUT / ("gpu-smoke" if args.smoke else "gpu")
    out = args.out or (work if args.smoke else REPORTS)
    if args.smoke and out.resolve() == REPORTS.resolve():
        print("--smoke figures are not a GPU's: they never go into bench/reports", file=sys.stderr)
        return 2
    report = run(plan, work, args.smoke)
    write_report(out, "gpu", report, gpu_report.markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
