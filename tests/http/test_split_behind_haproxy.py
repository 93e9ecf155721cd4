"""Split replicas (`SPLIT_FRONT_END=true`, one process starting its front end, as a container
runs it) behind HAProxy running the compose profile's docker/haproxy/haproxy.cfg with only its
addresses changed (its own health check, intervals, retries and redispatch).

SIGTERM to one replica under load: its `/ready` turns 503 at once, on a connection kept
alive from before the signal and on a new one alike (the front end's listener stays open
while it drains); HAProxy's check, which opens a new connection for each check, reads that
503 and takes the replica out (L7STS 503, not a refused connection: the drain is held open
past two checks); requests HAProxy sends it meanwhile are answered 503 and replayed on the
other replica (`retry-on ... 503`, `option redispatch`); the load sees only 200s; the replica
answers what it had accepted and exits 0.
"""

from __future__ import annotations

import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests.support.haproxy_process import HAPROXY_CONFIG, Balancer, load_balancer
from tests.support.in_process import wait_for
from tests.support.load_client import metric, run_load, sms_texts
from tests.support.server_process import ServerProcess
from tests.support.split import split_replicas
from tests.support.tiny_models import LABELS, TinyModel, simulated_entry, write_models_file

# The load's model is the tiny BERT (the first, the default). HELD goes to `slow`, a simulated
# model on a device thread of its own (a simulated model's), so the load's batches on the
# leaving replica run on beside it. HELD is 5 texts of 512 tokens: with MAX_BATCH_TOKENS at
# 2048, a batch of 4, then one of 1, 3 s each. The SIGTERM is sent once the first batch runs
# (the fifth text waiting in the queue), so the drain has at least the second batch's 3 s to
# wait for: longer than the checks that take the replica out, so what takes it out is its
# /ready's 503, and HAProxy goes on sending it requests until then.
SLOW = simulated_entry(
    name="slow",
    labels=LABELS,
    max_length=512,
    simulated={"seconds_per_batch": 3.0, "seconds_per_token": 0.0},
)
MAX_BATCH_TOKENS = 2048
HELD = {
    "inputs": [f"held {i} " + "words " * 600 for i in range(5)],
    "model": "slow",
    "cache": False,
}
LOAD_SECONDS = 12.0
SIGTERM_AFTER_SECONDS = 3.0  # the load runs on both replicas by then


def health_check() -> tuple[float, int]:
    """The config's check interval (seconds) and how many failed checks take a server out."""
    [line] = [
        line.split("#")[0].split()
        for line in HAPROXY_CONFIG.read_text(encoding="utf-8").splitlines()
        if line.split()[:2] == ["default-server", "check"]
    ]
    inter = line[line.index("inter") + 1]
    assert inter.endswith("s") and not inter.endswith("ms"), inter
    return float(inter.removesuffix("s")), int(line[line.index("fall") + 1])


@dataclass
class Seen:
    """What the thread that sends the SIGTERM saw, for the test's own thread to check."""

    ready_before: int = 0
    kept_alive: list[tuple[float, int]] = field(default_factory=list)  # (s after SIGTERM, status)
    kept_alive_503: httpx.Response | None = None
    fresh: httpx.Response | None = None
    down: dict[str, dict[str, str]] | None = None  # HAProxy's rows once the replica is down
    down_after: float = 0.0
    held: list[int] = field(default_factory=list)
    exit_code: int | None = None
    error: BaseException | None = None


def sigterm_mid_load(leaving: ServerProcess, balancer: Balancer, seen: Seen, bound: float) -> None:
    """Sends `leaving` its SIGTERM mid-load, with HELD in flight, and records its /ready on a
    kept-alive connection (polled, `bound` seconds at most, until 503) and on a new one,
    HAProxy's row once it is down, HELD's answer and the replica's exit code."""
    try:
        time.sleep(SIGTERM_AFTER_SECONDS)
        with httpx.Client(base_url=leaving.url, timeout=30) as kept:
            seen.ready_before = kept.get("/ready").status_code  # the connection is open now

            def post_held() -> None:
                answer = httpx.post(f"{leaving.url}/predict", json=HELD, timeout=30)
                seen.held.append(answer.status_code)

            held = threading.Thread(target=post_held)
            held.start()
            wait_for(
                lambda: metric(leaving.url, "loraserve_queue_depth", model="slow") == 1,
                30,
                "HELD's first batch running, its last text queued",
            )
            sigterm_at = time.monotonic()
            leaving.process.send_signal(signal.SIGTERM)
            # The parent passes the signal on to its front end: a first probe may beat it.
            while (elapsed := time.monotonic() - sigterm_at) < bound:
                answer = kept.get("/ready")
                seen.kept_alive.append((elapsed, answer.status_code))
                if answer.status_code == 503:
                    seen.kept_alive_503 = answer
                    break
                time.sleep(0.01)
        seen.fresh = httpx.get(f"{leaving.url}/ready", timeout=5)  # a new connection
        while time.monotonic() - sigterm_at < 30:
            rows = balancer.servers()
            if rows["replica1"]["status"] == "DOWN":
                seen.down, seen.down_after = rows, time.monotonic() - sigterm_at
                break
            time.sleep(0.05)
        held.join(timeout=60)
        seen.exit_code = leaving.process.wait(timeout=60)
    except BaseException as exc:  # checked by the test's own thread
        seen.error = exc


def test_sigterm_to_a_split_replica_behind_haproxy_takes_it_out_and_the_load_sees_only_200s(
    tiny_bert: TinyModel, tmp_path: Path
) -> None:
    inter, fall = health_check()
    # The first check after the SIGTERM comes within `inter`, the last of `fall` within
    # `fall * inter`: HELD holds the drain open 3 s past the SIGTERM at least.
    assert fall * inter <= 2, "HAProxy's checks are slower now: make HELD hold the drain longer"
    tiny = {
        "name": "tiny",
        "base": str(tiny_bert.base),
        "labels": LABELS,
        "max_length": 32,
        "adapters": [{"name": "spam", "path": str(tiny_bert.adapters["spam"])}],
    }
    models = write_models_file(tmp_path / "models.yaml", [tiny, SLOW])
    seen = Seen()
    # Each replica's disk tier in its own folder (the default, relative to the folder it runs in).
    env = {
        "MODELS_FILE": str(models),
        "MAX_BATCH_TOKENS": str(MAX_BATCH_TOKENS),
        "ADMISSION_CONTROL": "false",  # nothing but the drain refuses
    }
    folders = [tmp_path / "replica1", tmp_path / "replica2"]  # HAProxy's names, in this order
    with (
        split_replicas(folders, env) as replicas,
        load_balancer(tmp_path, replicas) as balancer,
    ):
        leaving = replicas[0]
        thread = threading.Thread(target=sigterm_mid_load, args=(leaving, balancer, seen, inter))
        thread.start()
        try:
            result = run_load(balancer.url, clients=8, seconds=LOAD_SECONDS, texts=sms_texts())
        finally:
            thread.join(timeout=120)
        rows = balancer.servers()
    summary = result.summary()
    print(
        summary,
        {
            name: (r["status"], r["stot"], r["hrsp_5xx"], r["wretr"], r["wredis"])
            for name, r in rows.items()
        },
        seen.kept_alive,
        seen.down_after,
    )
    assert seen.error is None, f"{seen.error!r}\n{leaving.log()}"
    assert seen.ready_before == 200

    # /ready is 503 at once: within one check interval of the SIGTERM (so the next check
    # reads it), on the connection kept alive from before it, and on a new one.
    assert seen.kept_alive_503 is not None, seen.kept_alive
    assert seen.kept_alive_503.json()["error"]["message"] == "front end is draining"
    assert seen.kept_alive_503.headers["retry-after"] == "5"
    assert seen.fresh is not None and seen.fresh.status_code == 503

    # HAProxy took it out on its /ready's 503 (L7STS: the HTTP check's status; a refused
    # connection would be L4CON), after `fall` checks, while HELD still held the drain open.
    assert seen.down is not None, "HAProxy never had the draining replica down"
    out = seen.down["replica1"]
    assert (out["check_status"], out["check_code"]) == ("L7STS", "503"), (seen, out)
    assert seen.held == [200]  # accepted before the SIGTERM: answered by the drain

    # Until then HAProxy sent it requests, which its front end answered 503 (draining) and
    # HAProxy replayed on the other replica (`retry-on ... 503`, `option redispatch 1`);
    # from then on the load went to the other replica alone. The load saw nothing of it.
    assert int(rows["replica1"]["wredis"]) > 0, rows["replica1"]
    assert rows["replica1"]["stot"] == out["stot"]
    assert int(rows["replica2"]["stot"]) > int(seen.down["replica2"]["stot"])
    assert rows["replica1"]["status"] == "DOWN"
    assert result.statuses[200] > 0 and set(result.statuses) == {200}, summary
    assert result.transport_errors == 0, summary

    # The replica answered what it had accepted and exited 0 (its front end, then itself).
    assert seen.exit_code == 0, leaving.log()
