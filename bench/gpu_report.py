"""bench.gpu's report: its raw figures as markdown, each beside the users' target."""

from __future__ import annotations

from typing import Any

from bench.load_clients import CLIENTS_PER_PROCESS

# The users' targets (the issue's words).
BATCH_MS = 100.0  # "a batch under 100 ms"
MEMORY_GB = 16.0  # "GPU memory under 16 GB"
RESPONSE_MS = 2000.0  # "a response under 2 s"
TEXTS_PER_HOUR = 10_000  # "10,000 samples an hour"
LOAD_S = (5.0, 8.0)  # "checkpoint loading cut from 32 s to 5–8 s"
LOAD_BEFORE_S = 32.0
LOAD_PHASES = ("resolve", "weights", "quantize", "save_quantized", "adapters")
PHASES = (*LOAD_PHASES, "warmup")
EXAONE, KOELECTRA, CASCADE = "exaone", "koelectra", "cascade"


def markdown(report: dict[str, Any]) -> str:
    """The whole report."""
    meta = report["meta"]
    lines = [
        "# GPU benchmark: the users' deployment",
        "",
        *header(meta),
        "",
        "## Against the users' targets",
        "",
        *targets(report),
        "",
        "## Load time by phase",
        "",
        *load_lines(report),
        "",
        "## Batch latency",
        "",
        *latency_lines(report),
        "",
        "## The forward alone",
        "",
        *forward_lines(report),
        "",
        "## GPU memory",
        "",
        *memory_lines(report),
        "",
        "## Throughput and p99, 1–128 clients",
        "",
        *throughput_lines(report),
        "",
        "## Packing on the GPU",
        "",
        *packing_lines(report),
        "",
        "## The cascade on the GPU",
        "",
        *cascade_lines(report),
        "",
        *reading(report),
        "## Notes",
        "",
        *notes(meta),
    ]
    return "\n".join(lines) + "\n"


def reading(report: dict[str, Any]) -> list[str]:
    """What the figures say of each forward and of the server that feeds it; nothing for a
    smoke run, whose figures are not a GPU's."""
    if report["meta"]["smoke"]:
        return []
    largest = max((row["tokens"], row["texts"]) for row in report["forward"])
    calls = {
        model: [row["model_ms"] for row in report["forward"] if row["model"] == model]
        for model in (KOELECTRA, EXAONE)
    }
    big = next(
        row["model_ms"]
        for row in report["forward"]
        if (row["model"], row["tokens"], row["texts"]) == (EXAONE, *largest)
    )
    smaller = [ms for ms in calls[EXAONE] if ms != big]
    most = max(p["clients"] for p in report["throughput"])
    served = next(
        p["texts_per_s"]
        for p in report["throughput"]
        if (p["model"], p["clients"]) == (KOELECTRA, most)
    )
    tokens, texts = largest
    few = report["meta"]["plan"]["lengths"][0]  # the load points' text length
    batch = latency_of(report, KOELECTRA, few, texts)["forward_ms"]
    device = 1000 * texts / batch
    return [
        "## What the figures say",
        "",
        f"- **Both forwards are bound by launching kernels from Python, not by the GPU.** The "
        f"model's own call took {min(calls[KOELECTRA]):.1f}–{max(calls[KOELECTRA]):.1f} ms "
        f"for KoELECTRA at every shape, and {min(smaller):.0f}–{max(smaller):.0f} ms for "
        f"EXAONE at every shape but {texts} × {tokens} tokens, where the arithmetic takes "
        f"over ({big:.1f} ms).",
        f"- **One text a request, the server feeds KoELECTRA at {served / device:.0%} of what "
        f"the device does**: {served:,.0f} texts/s at {most} clients, where a served forward of "
        f"{texts} texts of {few} tokens takes {batch:.1f} ms ({device:,.0f} texts/s in "
        "such batches). Each forward takes turns at the GIL with the event loop; replicas, "
        "each with a GIL of its own, feed it more ([Replicas on one GPU](gpu-replicas.md)).",
        "",
    ]


def header(meta: dict[str, Any]) -> list[str]:
    versions = ", ".join(f"{name} {v}" for name, v in meta["versions"].items() if v)
    gpu = meta["gpu"]
    device = (
        f"**{gpu['name']}** ({gpu['memory_gb']:.0f} GB, CUDA {gpu['cuda']}, driver "
        f"{gpu['driver'] or 'unknown'})"
        if gpu
        else f"**{meta['device']}** (no GPU)"
    )
    lines = [
        f"Device: {device}; host {meta['cpu']}, Python {meta['python']}; {versions}. "
        f"{meta['date']}. Made by `{meta['command']}` in {meta['wall_s'] / 60:.1f} min "
        f"(building the random-weight models: {meta['build_s']:.0f} s); raw figures in "
        "gpu.json.",
    ]
    if meta["smoke"]:
        lines += [
            "",
            f"**SMOKE RUN on {meta['device']}: tiny shapes, few iterations. These figures are "
            "not a GPU measurement and say nothing about the targets; the run only shows that "
            "the benchmark's code path works.**",
        ]
    return lines


def met(ok: bool, smoke: bool) -> str:
    if smoke:
        return "— (smoke)"
    return "yes" if ok else "**no**"


def ms(value: float | None) -> str:
    return "—" if value is None else f"{value:,.1f}"


def gb(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}"


def latency_of(report: dict[str, Any], model: str, tokens: int, texts: int) -> dict[str, Any]:
    return next(
        row
        for row in report["latency"]
        if (row["model"], row["tokens"], row["texts"]) == (model, tokens, texts)
    )


def load_s(start: dict[str, Any], model: str) -> float:
    """A model's load time, warm-up left out."""
    phases: dict[str, float] = start["models"][model]["load_seconds"]
    return sum(phases.get(phase, 0.0) for phase in LOAD_PHASES)


def peak_memory(report: dict[str, Any]) -> tuple[float | None, float | None]:
    """The largest reserved and driver-used GB over the run's readings."""
    readings = list(report["memory"].values())
    reserved = [r["reserved_gb"] for r in readings if r["reserved_gb"] is not None]
    used = [r["driver_used_gb"] for r in readings if r["driver_used_gb"] is not None]
    return (max(reserved) if reserved else None, max(used) if used else None)


def targets(report: dict[str, Any]) -> list[str]:
    smoke = report["meta"]["smoke"]
    few, many = report["meta"]["plan"]["lengths"]
    short = latency_of(report, EXAONE, few, 32)
    long = latency_of(report, EXAONE, many, 32)
    reserved, used = peak_memory(report)
    memory = used if used is not None else reserved
    worst_p99 = {
        model: max((p["p99_ms"] or 0.0) for p in report["throughput"] if p["model"] == model)
        for model in (KOELECTRA, EXAONE)
    }
    best_hour = max(p["texts_per_hour"] for p in report["throughput"] if p["model"] == EXAONE)
    later, at_start = report["starts"]["later start"], report["starts"]["quantized at start"]
    exaone_load = load_s(later, EXAONE)
    return [
        "| target | measured | met |",
        "|---|---|---|",
        f"| a batch under {BATCH_MS:.0f} ms | EXAONE, one forward of 32 texts × {few} tokens: "
        f"{ms(short['forward_ms'])} ms (32 × {many}: {ms(long['forward_ms'])} ms) "
        f"| {met(short['forward_ms'] < BATCH_MS, smoke)} |",
        f"| GPU memory under {MEMORY_GB:.0f} GB | both models, peak over the run: "
        f"{gb(used)} GB used (driver), {gb(reserved)} GB reserved by torch "
        f"| {met(memory is not None and memory < MEMORY_GB, smoke)} |",
        f"| a response under {RESPONSE_MS / 1000:.0f} s | worst p99 over 1–"
        f"{max(report['meta']['plan']['clients'])} clients, one {few}-token text a request: "
        f"EXAONE {ms(worst_p99[EXAONE])} ms, KoELECTRA {ms(worst_p99[KOELECTRA])} ms "
        f"| {met(max(worst_p99.values()) < RESPONSE_MS, smoke)} |",
        f"| {TEXTS_PER_HOUR:,} samples an hour | EXAONE alone, best: {best_hour:,.0f} texts/h "
        f"| {met(best_hour >= TEXTS_PER_HOUR, smoke)} |",
        f"| checkpoint load {LOAD_S[0]:.0f}–{LOAD_S[1]:.0f} s (was {LOAD_BEFORE_S:.0f} s) "
        f"| EXAONE from its pre-quantized checkpoint: {exaone_load:.1f} s (quantized at start: "
        f"{load_s(at_start, EXAONE):.1f} s); the whole process to ready, both models warm: "
        f"{later['ready_s']:.1f} s | {met(exaone_load <= LOAD_S[1], smoke)} |",
    ]


def load_lines(report: dict[str, Any]) -> list[str]:
    lines = [
        "| start | model | pre-quantized | "
        + " | ".join(f"{phase} s" for phase in PHASES)
        + " | load s | process to first answer s | process to ready s |",
        "|---|---|---|" + "---|" * (len(PHASES) + 3),
    ]
    for title, start in report["starts"].items():
        # Not recorded by runs before it was measured.
        listening = start.get("listening_s")
        first_answer = "—" if listening is None else f"{listening:.1f}"
        for name, model in start["models"].items():
            phases = " | ".join(f"{model['load_seconds'].get(p, 0.0):.2f}" for p in PHASES)
            lines.append(
                f"| {title} | {name} | {model['prequantized_cache'] or '—'} | {phases} "
                f"| {load_s(start, name):.2f} | {first_answer} | {start['ready_s']:.1f} |"
            )
    lines += [
        "",
        "Reading the files alone (raw bytes into memory, page cache warm, median of 3):",
        "",
        "| files | GB | read s | GB/s |",
        "|---|---|---|---|",
    ]
    for title, read in report["reads"].items():
        rate = read["gb"] / read["read_s"] if read["read_s"] else 0.0
        lines.append(f"| {title} | {read['gb']:.2f} | {read['read_s']:.2f} | {rate:.1f} |")
    lines += [
        "",
        "First start: EXAONE converted into the Llama layout (resolve), quantized while loaded "
        "(weights) and saved pre-quantized (save_quantized). Quantized at start: "
        "PREQUANTIZED_CACHE=false, from the converted folder. Later start: from the "
        "pre-quantized checkpoint, its sha256 checked against its manifest (resolve). The "
        "process times count from the spawn: to its first answer of any status (the port "
        "opens once Python's imports are done and the app is built), and to /ready 200 (CUDA's "
        "start, every model's load and warm-up too).",
    ]
    return lines


def latency_lines(report: dict[str, Any]) -> list[str]:
    lines = [
        "One request of n texts, cache off, MAX_BATCH_TOKENS=16384 so that each request is one "
        f"batch; median of {report['meta']['plan']['repeats']} after one warm-up. forward: the "
        "server's batch time (`loraserve_batch_inference_seconds`); request: the client's.",
        "",
        "| model | tokens | texts | forward ms | request ms | batches | under 100 ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in report["latency"]:
        lines.append(
            f"| {row['model']} | {row['tokens']} | {row['texts']} | {ms(row['forward_ms'])} "
            f"| {ms(row['client_ms'])} | {row['batches_per_request']:.0f} "
            f"| {met(row['forward_ms'] < BATCH_MS, report['meta']['smoke'])} |"
        )
    return lines


def graphed_note(report: dict[str, Any]) -> str:
    """Which models' predictor rows replayed CUDA graphs (runs before CUDA_GRAPHS say none)."""
    graphed = sorted({row["model"] for row in report["forward"] if row.get("predictor_graphed")})
    return f"; replayed as CUDA graphs for {', '.join(graphed)}, as served" if graphed else ""


def forward_lines(report: dict[str, Any]) -> list[str]:
    """The served batch time beside the same batch in the benchmark's own process."""
    served = {(row["model"], row["tokens"], row["texts"]): row for row in report["latency"]}
    lines = [
        "The same batches in the benchmark's own process, each model loaded alone with the "
        "server's loader once the servers had stopped; median of "
        f"{report['meta']['plan']['repeats']} after two warm-ups, the device synchronized. "
        "model: the model's own call on padded ids already on the device; predictor: "
        "`Predictor.forward`, what the batch worker calls (ids from the host, scores back"
        f"{graphed_note(report)}); served: the batch time above.",
        "",
        "| model | tokens | texts | model ms | predictor ms | served ms |",
        "|---|---|---|---|---|---|",
    ]
    for row in report["forward"]:
        batch = served[(row["model"], row["tokens"], row["texts"])]
        lines.append(
            f"| {row['model']} | {row['tokens']} | {row['texts']} | {ms(row['model_ms'])} "
            f"| {ms(row['predictor_ms'])} | {ms(batch['forward_ms'])} |"
        )
    return lines


def memory_lines(report: dict[str, Any]) -> list[str]:
    lines = [
        "| when | allocated GB (torch) | reserved GB (torch) | used GB (nvidia-smi) "
        f"| under {MEMORY_GB:.0f} GB |",
        "|---|---|---|---|---|",
    ]
    for when, reading in report["memory"].items():
        peak = reading["driver_used_gb"] or reading["reserved_gb"]
        lines.append(
            f"| {when} | {gb(reading['allocated_gb'])} | {gb(reading['reserved_gb'])} "
            f"| {gb(reading['driver_used_gb'])} "
            f"| {met(peak is not None and peak < MEMORY_GB, report['meta']['smoke'])} |"
        )
    weights = {
        name: model["weight_bytes"] / 1e9
        for name, model in report["starts"]["later start"]["models"].items()
    }
    lines += [
        "",
        "Weights as loaded (`/models` weight_bytes): "
        + ", ".join(f"{name} {size:.2f} GB" for name, size in weights.items())
        + ". MAX_MEMORY_GB=16 bounds the weights; activations and the allocator's cache come "
        "on top, which reserved and used show.",
    ]
    return lines


def throughput_lines(report: dict[str, Any]) -> list[str]:
    plan = report["meta"]["plan"]
    lines = [
        "Closed-loop clients (httpx and asyncio, in processes of at most "
        f"{CLIENTS_PER_PROCESS} clients each, on the same host), one "
        f"{plan['lengths'][0]}-token text a "
        f"request, cache off, {plan['seconds']:.0f} s a point after {plan['warmup']:.0f} s of "
        "warm-up; ADMISSION_CONTROL=false, so every request is queued and answered and p99 is "
        "what a client waits (the default would answer 429 to a request expected past 2 s).",
        "",
        "| model | clients | texts/s | texts/hour | p50 ms | p99 ms | statuses "
        f"| p99 under {RESPONSE_MS / 1000:.0f} s | {TEXTS_PER_HOUR:,}/h |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    smoke = report["meta"]["smoke"]
    for point in report["throughput"]:
        lines.append(
            f"| {point['model']} | {point['clients']} | {point['texts_per_s']:,.1f} "
            f"| {point['texts_per_hour']:,.0f} | {ms(point['p50_ms'])} | {ms(point['p99_ms'])} "
            f"| {statuses(point)} | {met((point['p99_ms'] or 0.0) < RESPONSE_MS, smoke)} "
            f"| {met(point['texts_per_hour'] >= TEXTS_PER_HOUR, smoke)} |"
        )
    return lines


def statuses(point: dict[str, Any]) -> str:
    return ", ".join(f"{code}: {count}" for code, count in point["statuses"].items()) or "none"


def packing_lines(report: dict[str, Any]) -> list[str]:
    later = report["starts"]["later start"]["models"]
    lines = [
        "What each model's load found (`/models`): whether its batches run packed (checked "
        "against padded at load, refused where they differ), and the largest logit difference "
        "of a probe text alone and among batch-mates.",
        "",
        "| model | packed batches | batch max logit difference |",
        "|---|---|---|",
    ]
    for name, model in later.items():
        difference = model["batch_max_logit_difference"]
        shown = "—" if difference is None else f"{difference:.3g}"
        lines.append(f"| {name} | {model['packed_batches']} | {shown} |")
    padded = report["padded"]
    few, many = report["meta"]["plan"]["lengths"]
    lines += [
        "",
        "KoELECTRA as loaded above, beside the quantized-at-start server, which ran with "
        "PACK_BATCHES=false:",
        "",
        f"| KoELECTRA | 32 × {few} forward ms | 32 × {many} forward ms "
        f"| texts/s at {padded['throughput']['clients']} clients | p99 ms |",
        "|---|---|---|---|---|",
    ]
    clients = padded["throughput"]["clients"]
    matching = [
        p for p in report["throughput"] if p["model"] == KOELECTRA and p["clients"] == clients
    ]
    as_served = matching[0] if matching else None
    rows = [
        (
            "as loaded (packed: " + str(later[KOELECTRA]["packed_batches"]) + ")",
            [latency_of(report, KOELECTRA, n, 32) for n in (few, many)],
            as_served,
        ),
        ("PACK_BATCHES=false", padded["latency"], padded["throughput"]),
    ]
    for title, latency, point in rows:
        lines.append(
            f"| {title} | {ms(latency[0]['forward_ms'])} | {ms(latency[1]['forward_ms'])} "
            f"| {'—' if point is None else format(point['texts_per_s'], ',.1f')} "
            f"| {'—' if point is None else ms(point['p99_ms'])} |"
        )
    if not later[KOELECTRA]["packed_batches"]:
        lines += [
            "",
            "Both rows ran padded batches: KoELECTRA's load kept them padded on this device "
            "(on a GPU every model does, docs/batching.md), so this compares two servers whose "
            "KoELECTRA runs alike, and their difference is the run's own spread.",
        ]
    return lines


def cascade_lines(report: dict[str, Any]) -> list[str]:
    cascade = report["cascade"]
    clients = cascade["clients"]
    alone = {p["model"]: p for p in report["throughput"] if p["clients"] == clients}
    answered = sum(cascade["answered_by"].values())
    escalated = cascade["answered_by"].get(EXAONE, 0)
    share = escalated / answered if answered else 0.0
    lines = [
        f'`"model": "cascade"` at {clients} clients: KoELECTRA first, EXAONE for the texts '
        "whose top probability is below CASCADE_THRESHOLD. Random weights make the probabilities "
        "meaningless, so the threshold was set from KoELECTRA's scores of the texts "
        f"({report['cascade_threshold']:.6f}) to send about a tenth of them on, the most the "
        f"embedded cascade was allowed: {share:.1%} went. This measures what the cascade costs "
        "on the GPU, not its accuracy (bench/reports/cascade.md has that, on CPU).",
        "",
        f"| served as | texts/s at {clients} clients | p50 ms | p99 ms | escalated |",
        "|---|---|---|---|---|",
    ]
    for name in (KOELECTRA, EXAONE):
        point = alone.get(name)
        if point is not None:
            lines.append(
                f"| {name} alone | {point['texts_per_s']:,.1f} | {ms(point['p50_ms'])} "
                f"| {ms(point['p99_ms'])} | — |"
            )
    lines.append(
        f"| cascade | {cascade['texts_per_s']:,.1f} | {ms(cascade['p50_ms'])} "
        f"| {ms(cascade['p99_ms'])} | {escalated} of {answered} ({share:.1%}) |"
    )
    return lines


def notes(meta: dict[str, Any]) -> list[str]:
    shapes = meta["plan"]["shapes"]
    return [
        f"- Models: EXAONE-3.5-2.4B-Instruct's shapes ({shapes['exaone_parameters'] / 1e9:.2f} B "
        "parameters, EXAONE layout as the hub ships it, converted at the first start) with a "
        f"rank-{shapes['exaone_lora_rank']} LoRA on q/k/v/out in every block and its head; "
        "KoELECTRA-small-v3-discriminator's shapes with a rank-"
        f"{shapes['koelectra_lora_rank']} LoRA on query/value and its head. Random weights, "
        "drawn on the device (bench/gpu_models.py): the costs are a trained model's, the "
        "answers are not.",
        "- Declared as the users' models file of docs/models.md: EXAONE nf4 (double quantization, "
        f"bfloat16 compute), KoELECTRA bfloat16, max_length {max(meta['plan']['lengths'])}, "
        "MAX_MEMORY_GB=16; caches off.",
        "- Tokenizers: word-level over made-up words, so that each text is exactly "
        f"{' or '.join(map(str, meta['plan']['lengths']))} tokens (checked by tokenizing); the "
        "real tokenizers are not needed to time a forward.",
        "- The clients share the host with the server; the server process is the same "
        "`python -m api.cli` the users run.",
    ]
