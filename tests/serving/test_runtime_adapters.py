"""Adapters at run time, on the real server: load and predict, swap under concurrent traffic,
unload with requests queued, refusals that change nothing, eviction and reload, the watched
folder, and a restart. Every answer is checked against plain transformers + peft."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from api.batch.local import started_service
from tests.support.in_process import make_settings, spec_for
from tests.support.runtime_adapter_client import (
    ADMIN,
    ADMIN_KEY,
    TEXTS,
    TOLERANCE,
    Weights,
    answer_of,
    eventually,
    load,
    metric,
    predict,
    put,
    reference,
    runtime_adapters,
    served,
    served_set,
)
from tests.support.tiny_models import LABELS, TinyModel, build_adapter, build_bert

CACHE_OFF = {"LRU_CACHE_ENTRIES": "0", "DISK_CACHE_MAX_BYTES": "0"}
ADAPTERS_PAGE = Path(__file__).resolve().parents[2] / "docs" / "adapters.md"


@pytest.fixture(scope="module")
def weights(tiny_bert: TinyModel, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Weights]:
    """Three run-time adapters for the tiny BERT (v2 also adapts `key`, which the served
    model's own adapter leaves alone), and that own adapter, `spam`, with their answers."""
    root = tmp_path_factory.mktemp("runtime-adapters")
    folders = {
        "v1": build_adapter(tiny_bert.base, root / "v1", ["query", "value"], seed=11),
        "v2": build_adapter(tiny_bert.base, root / "v2", ["query", "value", "key"], seed=12),
        "v3": build_adapter(tiny_bert.base, root / "v3", ["query", "value"], seed=13),
        "spam": tiny_bert.adapters["spam"],
    }
    found = {name: Weights(f, reference(tiny_bert.base, f, TEXTS)) for name, f in folders.items()}
    for first, second in (("v1", "v2"), ("v2", "v3"), ("v1", "v3")):  # told apart on every text
        for text in TEXTS:
            pairs = zip(found[first].answers[text], found[second].answers[text], strict=True)
            gap = max(abs(a - b) for a, b in pairs)
            assert gap > 100 * TOLERANCE, (first, second, text)
    return found


# --- load, predict, swap under traffic ------------------------------------------------------


@dataclass(frozen=True)
class Sent:
    """One request of the traffic: when it went and came back, and what it answered."""

    adapter: str
    text: str
    sent: float
    received: float
    status: int
    answer: tuple[float, ...]  # empty unless 200


def traffic(url: str, adapter: str, stop: threading.Event, offset: int, done: list[Sent]) -> None:
    """Requests one after another, cycling through the texts (so half come from the cache
    after the first round), each appended to `done` once answered, until `stop`."""
    with httpx.Client(base_url=url, timeout=30) as client:
        index = offset
        while not stop.is_set():
            text = TEXTS[index % len(TEXTS)]
            index += 1
            sent = time.monotonic()
            response = predict(client, text, adapter)
            received = time.monotonic()
            answer = answer_of(response) if response.status_code == 200 else ()
            done.append(Sent(adapter, text, sent, received, response.status_code, answer))


def test_load_predict_and_swap_under_traffic_serve_old_or_new_weights_never_mixed_or_stale(
    tiny_bert: TinyModel, weights: dict[str, Weights], tmp_path: Path
) -> None:
    v1, v2 = weights["v1"], weights["v2"]
    # Admission control off: on a busy machine it may refuse some of the traffic (429).
    env = {"ADMISSION_CONTROL": "false"}
    with (
        served(tiny_bert, tmp_path, **env) as server,
        httpx.Client(base_url=server.url) as client,
    ):
        loaded = load(client, "live", v1.folder)
        assert loaded.status_code == 200, loaded.text
        assert loaded.json()["result"] == "loaded"
        entry = loaded.json()["adapter"]
        assert (entry["digest"], entry["rank"], entry["source"]) == (v1.digest, 4, "api")
        for text in TEXTS:  # answers from the new adapter, and now in the cache under v1
            assert v1.gave(text, answer_of(predict(client, text, "live")))

        sent: list[Sent] = []  # appended to by the clients' threads

        def answered_since(moment: float) -> int:
            return sum(one.adapter == "live" and one.sent > moment for one in list(sent))

        stop = threading.Event()
        with ThreadPoolExecutor(max_workers=5) as pool:
            # Four clients on the adapter being swapped, one on the model's own adapter.
            clients = [("live", 9 * n) for n in range(4)] + [("spam", 0)]
            futures = [pool.submit(traffic, server.url, a, stop, o, sent) for a, o in clients]
            eventually(lambda: answered_since(0.0) >= 8, "traffic")
            swaps = []
            for new in (v2, v1, v2):  # swapped, swapped back (its cache entries valid again)
                started = time.monotonic()
                swapped = load(client, "live", new.folder)
                swaps.append((started, time.monotonic(), new))
                assert swapped.status_code == 200, swapped.text
                assert swapped.json()["result"] == "swapped"
                assert swapped.json()["adapter"]["digest"] == new.digest
                # Requests sent after the swap answered, several per client, before the next.
                eventually(lambda: answered_since(swaps[-1][1]) >= 8, "traffic after a swap")
            stop.set()
            for future in futures:
                future.result()

    assert all(one.status == 200 for one in sent), {one.status for one in sent}
    spam = [one for one in sent if one.adapter == "spam"]
    assert spam and all(weights["spam"].gave(one.text, one.answer) for one in spam)
    live = [one for one in sent if one.adapter == "live"]
    by = {
        name: [one for one in live if w.gave(one.text, one.answer)] for name, w in weights.items()
    }
    # Every answer is the old weights' or the new ones': none mixed, none from elsewhere.
    others = [one for one in live if one not in by["v1"] and one not in by["v2"]]
    assert not others, others[:3]
    # A request sent after a swap answered is answered by the new weights: none stale (the
    # texts were all cached under the old ones), none from the old version still finishing.
    for index, (_, answered, new) in enumerate(swaps):
        until = swaps[index + 1][0] if index + 1 < len(swaps) else float("inf")
        after = [one for one in live if answered < one.sent and one.received < until]
        assert after, f"no traffic after swap {index}"
        assert all(new.gave(one.text, one.answer) for one in after), index
    assert by["v1"] and by["v2"]


# --- unload --------------------------------------------------------------------------------


def test_unload_answers_the_queued_requests_first_then_404(
    tiny_bert: TinyModel, weights: dict[str, Weights], tmp_path: Path
) -> None:
    # Queued rows wait up to 5 s for batch-mates: the unload arrives while they wait.
    env = {"MAX_BATCH_WAIT_SECONDS": "5", "MAX_BATCH_SIZE": "64", "ADMISSION_CONTROL": "false"}
    v1, queued = weights["v1"], TEXTS[:8]
    with (
        served(tiny_bert, tmp_path, **env, **CACHE_OFF) as server,
        httpx.Client(base_url=server.url, timeout=30) as client,
    ):
        assert load(client, "gone", v1.folder).status_code == 200

        def one(text: str) -> tuple[httpx.Response, float]:
            with httpx.Client(base_url=server.url, timeout=30) as own:
                response = predict(own, text, "gone")
                return response, time.monotonic()

        with ThreadPoolExecutor(max_workers=len(queued)) as pool:
            futures = [pool.submit(one, text) for text in queued]
            eventually(
                lambda: metric(client, "loraserve_queue_depth", model="tiny") == len(queued),
                "the requests queued",
            )
            unload_sent = time.monotonic()
            unloaded = client.post(
                "/v1/unload_lora_adapter", json={"lora_name": "gone"}, headers=ADMIN
            )
            answers = [future.result() for future in futures]

        assert unloaded.status_code == 200, unloaded.text
        assert unloaded.json()["adapter"]["name"] == "gone"
        for text, (response, received) in zip(queued, answers, strict=True):
            assert v1.gave(text, answer_of(response))  # answered, with its weights
            assert received > unload_sent  # it was queued when the unload came
        after = predict(client, queued[0], "gone")
        assert after.status_code == 404
        assert "'gone'" in after.json()["error"]["message"]
        assert "gone" not in runtime_adapters(client)
        again = client.post("/v1/unload_lora_adapter", json={"lora_name": "gone"}, headers=ADMIN)
        assert again.status_code == 404


# --- refusals ------------------------------------------------------------------------------


def test_an_adapter_for_another_base_or_with_a_bad_sha256_is_refused_and_nothing_changes(
    tiny_bert: TinyModel, weights: dict[str, Weights], tmp_path: Path
) -> None:
    other_base = build_bert(tmp_path / "other-bert", seed=3)  # same architecture, other weights
    foreign = build_adapter(other_base, tmp_path / "foreign", ["query", "value"], seed=11)
    v1, v2 = weights["v1"], weights["v2"]
    with served(tiny_bert, tmp_path) as server, httpx.Client(base_url=server.url) as client:
        assert load(client, "keep", v1.folder).status_code == 200
        before = served_set(client)

        refusals = [
            (load(client, "newcomer", foreign), "another base"),
            (load(client, "keep", foreign), "another base"),  # a swap refused: v1 stays
            (load(client, "keep", v2.folder, sha256="0" * 64), "sha256"),
            (load(client, "newcomer", v2.folder, sha256="f" * 64), "sha256"),
        ]
        for response, reason in refusals:
            assert response.status_code == 422, response.text
            message = response.json()["error"]["message"]
            assert reason in message, message
            assert "adapter_" in message  # names the file

        assert served_set(client) == before
        assert predict(client, TEXTS[0], "newcomer").status_code == 404
        for text in TEXTS[:10]:
            assert v1.gave(text, answer_of(predict(client, text, "keep", cache=False)))
            assert weights["spam"].gave(text, answer_of(predict(client, text, None)))
        own = load(client, "spam", v2.folder)  # the models file's adapter stays as it is
        assert own.status_code == 409 and "models file" in own.json()["error"]["message"]
        assert metric(client, "loraserve_adapter_loads_total", result="refused") == len(refusals)
        assert load(client, "keep", v2.folder, sha256=v2.digest).json()["result"] == "swapped"


# --- eviction and reload -------------------------------------------------------------------


def test_least_recently_used_adapters_are_evicted_and_attached_again_on_demand(
    tiny_bert: TinyModel, weights: dict[str, Weights], tmp_path: Path
) -> None:
    env = {"MAX_ADAPTERS_PER_MODEL": "2", **CACHE_OFF}
    with served(tiny_bert, tmp_path, **env) as server, httpx.Client(base_url=server.url) as client:
        assert load(client, "a", weights["v1"].folder, pinned=True).status_code == 200
        assert load(client, "b", weights["v2"].folder).status_code == 200
        assert load(client, "c", weights["v3"].folder).status_code == 200
        resident = {name: entry["resident"] for name, entry in runtime_adapters(client).items()}
        assert resident == {"a": True, "b": False, "c": True}  # b: unpinned, least recent
        assert metric(client, "loraserve_adapter_evictions_total", model="tiny") == 1
        assert metric(client, "loraserve_adapters_resident", model="tiny") == 2

        for text in TEXTS[:5]:  # b waits to be attached again, then answers with its weights
            assert weights["v2"].gave(text, answer_of(predict(client, text, "b")))
        resident = {name: entry["resident"] for name, entry in runtime_adapters(client).items()}
        assert resident == {"a": True, "b": True, "c": False}  # c: now the least recent
        assert metric(client, "loraserve_adapter_loads_total", result="reloaded") == 1
        for text in TEXTS[:5]:
            assert weights["v3"].gave(text, answer_of(predict(client, text, "c")))
            assert weights["v1"].gave(text, answer_of(predict(client, text, "a")))
        assert metric(client, "loraserve_adapter_loads_total", result="reloaded") == 2
        assert metric(client, "loraserve_adapter_evictions_total", model="tiny") == 3
        assert runtime_adapters(client)["a"]["resident"]  # pinned: never evicted

        # Pins never exceed the residency limit.
        assert load(client, "b", weights["v2"].folder, pinned=True).json()["result"] == "unchanged"
        third = load(client, "c", weights["v3"].folder, pinned=True)
        assert third.status_code == 409 and "pinned" in third.json()["error"]["message"]


# --- the watched folder and a restart ------------------------------------------------------


def test_the_watched_folder_is_followed_and_a_restart_serves_the_same_set(
    tiny_bert: TinyModel, weights: dict[str, Weights], tmp_path: Path
) -> None:
    v1, v2, v3 = weights["v1"], weights["v2"], weights["v3"]
    watched = tmp_path / "adapters"
    put(watched / "tiny" / "alpha", v1.folder, pinned=True)
    other_base = build_bert(tmp_path / "other-bert", seed=3)
    foreign = build_adapter(other_base, tmp_path / "foreign", ["query", "value"], seed=11)
    env = {"ADAPTERS_DIR": str(watched), "ADAPTERS_POLL_SECONDS": "0.2"}

    def answers(client: httpx.Client, name: str) -> Callable[[Weights], bool]:
        def gave(w: Weights) -> bool:
            response = predict(client, TEXTS[0], name, cache=False)
            return response.status_code == 200 and w.gave(TEXTS[0], answer_of(response))

        return gave

    with served(tiny_bert, tmp_path, **env) as server, httpx.Client(base_url=server.url) as client:
        # Ready means the folder's adapters are in: no 404 window after a start.
        assert all(v1.gave(text, answer_of(predict(client, text, "alpha"))) for text in TEXTS)
        listed = runtime_adapters(client)["alpha"]
        assert (listed["source"], listed["pinned"], listed["digest"]) == ("folder", True, v1.digest)

        put(watched / "tiny" / "beta", v2.folder)  # added
        eventually(lambda: answers(client, "beta")(v2), "beta added")
        put(watched / "tiny" / "alpha", v3.folder)  # changed
        eventually(lambda: answers(client, "alpha")(v3), "alpha changed")
        shutil.rmtree(watched / "tiny" / "beta")  # removed
        eventually(lambda: predict(client, TEXTS[0], "beta").status_code == 404, "beta removed")

        put(watched / "tiny" / "bad", foreign)  # refused: for another base
        put(watched / "tiny" / "spam", v2.folder)  # the models file's name: stays as it is
        put(watched / "nomodel" / "x", v2.folder)  # no such model: left alone
        eventually(lambda: "another base" in server.log(), "the foreign adapter refused")
        time.sleep(1.0)  # several scans more
        assert predict(client, TEXTS[0], "bad").status_code == 404
        assert weights["spam"].gave(TEXTS[0], answer_of(predict(client, TEXTS[0], "spam")))
        before = {n: (e["digest"], e["pinned"]) for n, e in runtime_adapters(client).items()}
        assert before == {"alpha": (v3.digest, True)}  # its pin file stayed
        server.stop()

    (tmp_path / "again").mkdir()
    with (
        served(tiny_bert, tmp_path / "again", **env) as server,
        httpx.Client(base_url=server.url) as client,
    ):
        after = {n: (e["digest"], e["pinned"]) for n, e in runtime_adapters(client).items()}
        assert after == before
        assert all(v3.gave(text, answer_of(predict(client, text, "alpha"))) for text in TEXTS)
        assert predict(client, TEXTS[0], "beta").status_code == 404


# --- the documentation's example (docs/adapters.md) ----------------------------------------------


def test_the_documented_curl_example_runs_word_for_word(
    tiny_bert: TinyModel, weights: dict[str, Weights], tmp_path: Path
) -> None:
    part = ADAPTERS_PAGE.read_text(encoding="utf-8")
    found = re.search(r"```bash\n(.*?)```", part, re.DOTALL)
    assert found is not None
    v1 = weights["v1"]
    with served(tiny_bert, tmp_path) as server:
        script = found.group(1).replace("localhost:8000", server.url.removeprefix("http://"))
        script = script.replace("/adapters/spam-v2", str(v1.folder))
        env = {"PATH": os.environ["PATH"], "ADMIN_API_KEY": ADMIN_KEY}  # as the docs page says
        run = subprocess.run(
            ["bash", "-c", script], capture_output=True, text=True, timeout=60, env=env
        )
    assert run.returncode == 0, run.stderr
    answers, decoder, at = [], json.JSONDecoder(), 0
    while at < len(run.stdout):  # curl -s prints each answer with no newline after it
        answer, at = decoder.raw_decode(run.stdout, at)
        answers.append(answer)
    loaded, predicted, listed, unloaded = answers
    assert (loaded["result"], loaded["adapter"]["pinned"]) == ("loaded", True)
    text = "Txt STOP to 85069"
    [expected] = reference(tiny_bert.base, v1.folder, [text]).values()
    scores = {entry["label"]: entry["score"] for entry in predicted}
    assert Weights(v1.folder, {text: expected}).gave(text, tuple(scores[k] for k in LABELS))
    [model] = listed["models"]
    assert [a["name"] for a in model["adapters"]] == ["spam", "spam-v2"]
    assert unloaded["result"] == "unloaded"


# --- a load whose caller goes ---------------------------------------------------------------


async def test_a_cancelled_load_leaves_no_adapter_attached_and_its_retry_attaches_one(
    tiny_bert: TinyModel,
    weights: dict[str, Weights],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The split cancels a forward after 60 s or on a reconnect, a client may go: the device
    thread still finishes an attach it has begun. Cancelled then, the load leaves peft's own
    list as it was once the attach has run; the retry adds one copy."""
    settings = make_settings(adapter_roots=[weights["v1"].folder.parent])
    spec = spec_for(tiny_bert, adapters=("spam",), runtime_adapters=True)
    async with started_service(settings, [spec]) as service:
        runner = service.runners["tiny"]
        predictor = runner.served.predictor
        peft_names = runner.served.loaded.model.peft_config.keys
        before = set(peft_names())
        attaching = threading.Event()
        attach = predictor.attach_adapter

        def slow_attach(*args: Any, **kwargs: Any) -> Any:  # the real attach, begun slowly
            attaching.set()
            time.sleep(0.5)
            return attach(*args, **kwargs)

        monkeypatch.setattr(predictor, "attach_adapter", slow_attach)
        load = service.load_adapter("tiny", "v1", str(weights["v1"].folder), None, False)
        loading = asyncio.create_task(load)
        while not attaching.is_set():
            await asyncio.sleep(0.01)
        loading.cancel()  # while the device thread attaches
        with pytest.raises(asyncio.CancelledError):
            await loading
        await runner.adapters.settled()
        assert set(peft_names()) == before, "a cancelled load left an adapter attached"
        assert [a.name for a in runner.adapters.listing()] == ["spam"]
        retry = service.load_adapter("tiny", "v1", str(weights["v1"].folder), None, False)
        _, retried = await retry
        await runner.adapters.settled()
        assert retried.result == "loaded"
        assert len(set(peft_names()) - before) == 1
