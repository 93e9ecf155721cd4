"""Checkpoint load time, three ways, plus the time to merely read the weight files.

Run: `python -m bench.load_time` (or `make bench-load`). Writes bench/reports/
load_time.{md,json}. Two checkpoints: the embedded default base (all-MiniLM-L6-v2) and a
generated ~1.1 B-parameter Llama (TinyLlama's shape, random weights, bf16), built once into
bench/out/ and never committed. Each run is a fresh process (`--worker`), so every load
starts cold in Python; the page cache is warm after the untimed first run of each way, so the
ways compare loaders, not disks. Import time is measured apart from load time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "bench" / "out" / "load_time"
REPORTS = REPO / "bench" / "reports"
WAYS = ("safetensors", "safetensors-no-lowmem", "pickle", "read-only")


def status_kib(field: str) -> int:
    """A memory figure of this process from /proc: VmRSS now, or VmHWM, its peak.

    Not getrusage's ru_maxrss: Linux carries that over from the parent across fork and exec,
    and the parent here has held the 1 B model.
    """
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    return 0


def touch(tensors: Any) -> int:
    """Reads one value from every 4 KiB page of every tensor, and returns their bytes.

    safetensors and torch.load map files lazily: "loaded" weights are read only when first
    used. Touching every page makes each way pay for the bytes, as the first forward would.
    """
    import torch

    total = 0
    for tensor in tensors:
        flat = tensor.detach().reshape(-1)
        step = max(1, 4096 // flat.element_size())
        torch.sum(flat[::step].float())
        total += flat.numel() * flat.element_size()
    return total


def worker(way: str, folder: Path) -> dict[str, Any]:
    """One cold load in this process; returns seconds and memory."""
    start = time.perf_counter()
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    torch.set_num_threads(2)
    # transformers imports a model's module lazily, on first use (~1.3 s): resolve the class
    # here so that the import is counted as import, not as loading.
    model_class = AutoModelForSequenceClassification._model_mapping[
        type(AutoConfig.from_pretrained(folder))
    ]
    imported = time.perf_counter()
    baseline = status_kib("VmRSS")
    if way == "read-only":
        tensors = {}
        for path in sorted(folder.glob("*.safetensors")):
            tensors.update(load_file(path))
        loaded = touch(tensors.values())
    else:
        model = model_class.from_pretrained(
            folder,
            num_labels=2,
            dtype="auto",
            use_safetensors=way != "pickle",
            low_cpu_mem_usage=way != "safetensors-no-lowmem",
        )
        loaded = touch(model.parameters())
    done = time.perf_counter()
    return {
        "import_seconds": imported - start,
        "load_seconds": done - imported,
        "rss_before_mib": baseline / 1024,
        "peak_rss_mib": status_kib("VmHWM") / 1024,
        "weight_bytes_loaded": loaded,
    }


def service_worker() -> dict[str, Any]:
    """The service's own loader on the embedded default (base + adapter), by phase."""
    start = time.perf_counter()
    from api.cli import quiet_libraries
    from api.models.loader import load_model
    from api.models.spec import load_models_file
    from api.settings import Settings

    quiet_libraries()

    imported = time.perf_counter()
    baseline = status_kib("VmRSS")
    (spec,) = load_models_file(None)[:1]
    loaded = load_model(spec, Settings(_env_file=None))  # type: ignore[call-arg]
    return {
        "import_seconds": imported - start,
        "load_seconds": time.perf_counter() - imported,
        "rss_before_mib": baseline / 1024,
        "peak_rss_mib": status_kib("VmHWM") / 1024,
        "weight_bytes_loaded": loaded.weight_bytes,
        "phases": loaded.phases,
    }


def build_billion(folder: Path) -> Path:
    """A ~1.1 B-parameter Llama in bf16, as safetensors and as a pickle .bin, built once."""
    safetensors_dir, pickle_dir = folder / "safetensors", folder / "pickle"
    if (safetensors_dir / "config.json").exists() and (pickle_dir / "pytorch_model.bin").exists():
        return folder
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=22,
        num_attention_heads=32,
        num_key_value_heads=4,
        vocab_size=32000,
        tie_word_embeddings=False,
        dtype="bfloat16",
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    # Random-looking bytes are enough to time a load, and cost no initialisation.
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    for parameter in model.parameters():
        parameter.data.normal_(0, 0.02)
    model.save_pretrained(safetensors_dir, safe_serialization=True)
    pickle_dir.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(pickle_dir)
    torch.save(model.state_dict(), pickle_dir / "pytorch_model.bin")
    return folder


def build_minilm_pickle(folder: Path) -> Path:
    """The embedded base as a pickle .bin too, for the third way."""
    import torch
    from safetensors.torch import load_file

    from api.models.spec import load_models_file

    source = Path(load_models_file(None)[0].base)
    target = folder / "pickle"
    if not (target / "pytorch_model.bin").exists():
        target.mkdir(parents=True, exist_ok=True)
        (target / "config.json").write_bytes((source / "config.json").read_bytes())
        torch.save(load_file(source / "model.safetensors"), target / "pytorch_model.bin")
    return source


def run_worker(args: list[str]) -> dict[str, Any]:
    result = subprocess.run(
        [sys.executable, "-m", "bench.load_time", "--worker", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    last = result.stdout.strip().splitlines()[-1]
    value: dict[str, Any] = json.loads(last)
    return value


def folders(minilm: Path, billion: Path) -> dict[str, dict[str, Path]]:
    """Checkpoint → way → folder to load."""
    mini_pickle = OUT / "minilm" / "pickle"
    return {
        "all-MiniLM-L6-v2 (22.7 M, fp32)": {
            "safetensors": minilm,
            "safetensors-no-lowmem": minilm,
            "pickle": mini_pickle,
            "read-only": minilm,
        },
        "Llama 1.1 B (generated, bf16)": {
            "safetensors": billion / "safetensors",
            "safetensors-no-lowmem": billion / "safetensors",
            "pickle": billion / "pickle",
            "read-only": billion / "safetensors",
        },
    }


def file_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if p.suffix in (".safetensors", ".bin"))


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    loads = [r["load_seconds"] for r in runs]
    return {
        "runs": len(runs),
        "load_median_s": round(statistics.median(loads), 3),
        "load_min_s": round(min(loads), 3),
        "load_max_s": round(max(loads), 3),
        "import_median_s": round(statistics.median(r["import_seconds"] for r in runs), 3),
        "peak_rss_median_mib": round(statistics.median(r["peak_rss_mib"] for r in runs)),
        "rss_before_median_mib": round(statistics.median(r["rss_before_mib"] for r in runs)),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    if args.worker:
        way = args.worker[0]
        value = service_worker() if way == "service" else worker(way, Path(args.worker[1]))
        print(json.dumps(value))
        return 0

    load_average = Path("/proc/loadavg").read_text().split(" ")[0]
    OUT.mkdir(parents=True, exist_ok=True)
    minilm = build_minilm_pickle(OUT / "minilm")
    billion = build_billion(OUT / "llama-1b")
    plan = folders(minilm, billion)
    results: dict[str, dict[str, Any]] = {}
    for checkpoint, ways in plan.items():
        runs: dict[str, list[dict[str, Any]]] = {way: [] for way in ways}
        for way, folder in ways.items():  # untimed: warms the page cache for this way
            run_worker([way, str(folder)])
        for _ in range(args.runs):  # interleaved: a b c d a b c d …
            for way, folder in ways.items():
                runs[way].append(run_worker([way, str(folder)]))
        results[checkpoint] = {
            way: {**summarise(runs[way]), "file_bytes": file_bytes(ways[way])} for way in ways
        }
        print(json.dumps({checkpoint: results[checkpoint]}), flush=True)
    service_runs = [run_worker(["service"]) for _ in range(args.runs + 1)][1:]
    service = {**summarise(service_runs), "phases": service_runs[-1]["phases"]}
    meta = {"date": f"{datetime.now(timezone.utc):%Y-%m-%d}", "load_average": load_average}
    REPORTS.mkdir(parents=True, exist_ok=True)
    (REPORTS / "load_time.json").write_text(
        json.dumps({"meta": meta, "results": results, "service": service}, indent=2),
        encoding="utf-8",
    )
    text = report(results, service, meta)
    (REPORTS / "load_time.md").write_text(text, encoding="utf-8")
    print(text)
    return 0


def report(results: dict[str, Any], service: dict[str, Any], meta: dict[str, Any]) -> str:
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        "unknown CPU",
    )
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    names = {
        "safetensors": "safetensors, low_cpu_mem_usage=True",
        "safetensors-no-lowmem": "safetensors, low_cpu_mem_usage=False",
        "pickle": "pickle .bin (torch.load)",
        "read-only": "read the weight files only (safetensors.load_file)",
    }
    lines = [
        "# Checkpoint load time",
        "",
        f"Machine: {cpu}, {os.cpu_count()} cores, {memory:.0f} GiB. Date: {meta['date']}. "
        f"Load average before: {meta['load_average']}. Each figure: median (min–max) of the "
        "runs, each run a fresh Python process, page cache warm; load time excludes the "
        "import of torch and transformers (reported apart) and includes reading every page "
        "of every weight once (files are mapped lazily: untouched, a load reads nothing). "
        "Peak RSS is the worker's whole process (VmHWM).",
        "",
        "| checkpoint | way | load s, median (min–max) | import s | weight files (MB) | "
        "RSS before load (MiB) | peak RSS (MiB) |",
        "|---|---|---|---|---|---|---|",
    ]
    for checkpoint, ways in results.items():
        for way, r in ways.items():
            lines.append(
                f"| {checkpoint} | {names[way]} | {r['load_median_s']} "
                f"({r['load_min_s']}–{r['load_max_s']}) | {r['import_median_s']} | "
                f"{r['file_bytes'] / 1e6:.0f} | {r['rss_before_median_mib']} | "
                f"{r['peak_rss_median_mib']} |"
            )
    phases = ", ".join(f"{k} {v:.3f}" for k, v in service["phases"].items())
    lines += [
        "",
        f"The service's own loader on the embedded default (base + LoRA adapter, merged, "
        f"dynamic int8): {service['load_median_s']} s median ({service['load_min_s']}–"
        f"{service['load_max_s']}), peak RSS {service['peak_rss_median_mib']} MiB; phases of "
        f"the last run (s): {phases}.",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
