"""Tokenizing gathered per turn of the event loop: each request gets exactly the ids the model's
own tokenizer gives its texts, and its refusals, whoever it was gathered with."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest
from transformers import AutoTokenizer

from api.models.predictor import NoTokens, TextTooLong, UnservableText
from api.models.simulated import SimulatedPredictor, load_simulated
from api.models.spec import load_models_file
from api.serving.gathered_encoding import (
    INLINE_MAX_CHARS,
    Encoded,
    EncodeMany,
    GatheredEncoder,
)
from tests.support.tiny_models import write_models_file

MAX_LENGTH = 16
TEXTS = [
    "Free entry in 2 a wkly comp to win FA Cup final tkts",
    "see you at lunch",
    "URGENT! You have won a 1 week FREE membership in our prize draw " * 3,
    "무료 쿠폰 당첨! 지금 바로 확인하세요",
    "ok",
]


class Recorder:
    """The predictor's encode_many, recording each call's requests and thread."""

    def __init__(self, encode_many: EncodeMany) -> None:
        self.encode_many = encode_many
        self.calls: list[tuple[int, str]] = []

    def __call__(self, requests: list[list[str]], truncate: bool) -> Encoded:
        self.calls.append((len(requests), threading.current_thread().name))
        return self.encode_many(requests, truncate)


@pytest.fixture(scope="module")
def predictor(tmp_path_factory: pytest.TempPathFactory) -> SimulatedPredictor:
    entry = {
        "name": "sim",
        "simulated": {"seconds_per_batch": 0.0, "seconds_per_token": 0.0},
        "labels": ["ham", "spam"],
        "max_length": MAX_LENGTH,
    }
    models = write_models_file(tmp_path_factory.mktemp("gathered") / "m.yaml", [entry])
    (spec,) = load_models_file(models)
    return SimulatedPredictor(load_simulated(spec))


@pytest.fixture(scope="module")
def reference(predictor: SimulatedPredictor) -> Any:
    """The tokenizer as transformers loads it from the model's folder: the reference ids."""
    return AutoTokenizer.from_pretrained(predictor.loaded.spec.tokenizer)


def expected(reference: Any, texts: list[str], truncate: bool) -> list[list[int]]:
    cut = {"truncation": True, "max_length": MAX_LENGTH} if truncate else {}
    ids: list[list[int]] = reference(texts, **cut)["input_ids"]
    return ids


def requests_of(count: int) -> list[list[str]]:
    """`count` requests of one to three texts each, every text different."""
    return [
        [f"{TEXTS[(i + j) % len(TEXTS)]} #{i}.{j}" for j in range(1 + i % 3)] for i in range(count)
    ]


def short_requests(count: int) -> list[list[str]]:
    """`count` requests of two texts each, all within MAX_LENGTH tokens."""
    return [[f"see you at {i}", "ok"] for i in range(count)]


def gathered(
    encoder: GatheredEncoder, requests: list[list[str]], truncates: list[bool]
) -> list[list[list[int]]]:
    """Every request sent in the same turn of a new event loop."""

    async def all_at_once() -> list[list[list[int]]]:
        calls = (encoder.encode(texts, cut) for texts, cut in zip(requests, truncates, strict=True))
        return await asyncio.gather(*calls)

    found: list[list[list[int]]] = asyncio.run(all_at_once())
    return found


def test_requests_of_one_turn_are_tokenized_in_one_call_each_with_its_own_ids(
    predictor: SimulatedPredictor, reference: Any
) -> None:
    recorder = Recorder(predictor.encode_many)
    # Every fourth request asks not to cut its texts, which fit.
    requests = [
        short if i % 4 == 0 else texts
        for i, (short, texts) in enumerate(zip(short_requests(24), requests_of(24), strict=True))
    ]
    truncates = [i % 4 != 0 for i in range(len(requests))]
    assert sum(len(text) for texts in requests for text in texts) <= INLINE_MAX_CHARS
    found = gathered(GatheredEncoder(recorder), requests, truncates)
    for texts, cut, ids in zip(requests, truncates, found, strict=True):
        assert ids == expected(reference, texts, cut)
    # One call per truncation setting, each for all the requests with it, on the loop.
    loop_thread = threading.current_thread().name
    assert sorted(recorder.calls) == [(6, loop_thread), (18, loop_thread)]


def test_a_turn_over_the_inline_limit_is_tokenized_in_a_thread(
    predictor: SimulatedPredictor, reference: Any
) -> None:
    recorder = Recorder(predictor.encode_many)
    requests = [[f"{TEXTS[2]} #{i}"] for i in range(INLINE_MAX_CHARS // len(TEXTS[2]) + 2)]
    truncates = [True] * len(requests)
    found = gathered(GatheredEncoder(recorder), requests, truncates)
    assert found == [expected(reference, texts, True) for texts in requests]
    ((count, thread),) = recorder.calls
    assert count == len(requests)
    assert thread != threading.current_thread().name


@pytest.mark.parametrize(
    ("refused", "truncate", "error", "index"),
    [
        (["ok", "word " * 40], False, TextTooLong, 1),  # over the limit, not to be cut
        (["hello", "", "there"], True, NoTokens, 1),  # nothing but special tokens
    ],
)
def test_a_refused_request_fails_alone_with_its_own_index(
    predictor: SimulatedPredictor,
    reference: Any,
    refused: list[str],
    truncate: bool,
    error: type[UnservableText],
    index: int,
) -> None:
    encoder = GatheredEncoder(predictor.encode_many)
    others = short_requests(6)

    async def together() -> list[Any]:
        calls = [encoder.encode(texts, truncate) for texts in others]
        calls.insert(3, encoder.encode(refused, truncate))
        return await asyncio.gather(*calls, return_exceptions=True)

    found = asyncio.run(together())
    failure = found.pop(3)
    assert isinstance(failure, error)
    assert f"inputs[{index}]" in str(failure)
    for texts, ids in zip(others, found, strict=True):
        assert ids == expected(reference, texts, truncate)


def test_a_tokenizer_failure_fails_its_turn_and_the_next_turn_is_served(
    predictor: SimulatedPredictor, reference: Any
) -> None:
    failing = {"on": True}

    def flaky(requests: list[list[str]], truncate: bool) -> Encoded:
        if failing["on"]:
            raise RuntimeError("tokenizer broke")
        return predictor.encode_many(requests, truncate)

    encoder = GatheredEncoder(flaky)
    requests = requests_of(5)

    async def two_turns() -> tuple[list[Any], list[Any]]:
        first = await asyncio.gather(
            *(encoder.encode(texts, True) for texts in requests), return_exceptions=True
        )
        failing["on"] = False
        second = await asyncio.gather(*(encoder.encode(texts, True) for texts in requests))
        return first, second

    first, second = asyncio.run(two_turns())
    assert [str(error) for error in first] == ["tokenizer broke"] * len(requests)
    assert second == [expected(reference, texts, True) for texts in requests]


def test_a_request_cancelled_while_waiting_leaves_the_others_answered(
    predictor: SimulatedPredictor, reference: Any
) -> None:
    encoder = GatheredEncoder(predictor.encode_many)
    requests = requests_of(8)

    async def one_cancelled() -> list[Any]:
        tasks = [asyncio.create_task(encoder.encode(texts, True)) for texts in requests]
        await asyncio.sleep(0)  # every task is waiting for the turn's flush
        tasks[2].cancel()
        return await asyncio.gather(*tasks, return_exceptions=True)

    found = asyncio.run(one_cancelled())
    assert isinstance(found.pop(2), asyncio.CancelledError)
    del requests[2]
    assert found == [expected(reference, texts, True) for texts in requests]


def test_jobs_left_by_a_stopped_loop_do_not_stall_the_next_loop(
    predictor: SimulatedPredictor, reference: Any
) -> None:
    encoder = GatheredEncoder(predictor.encode_many)

    loop = asyncio.new_event_loop()
    waiting = loop.create_task(encoder.encode([TEXTS[1]], True))
    loop.call_soon(loop.stop)  # after the task has queued its job, before the flush runs
    loop.run_forever()
    assert not waiting.done()
    loop.set_exception_handler(lambda _, __: None)  # its task is abandoned on purpose
    loop.close()

    async def on_a_new_loop() -> list[list[int]]:
        return await asyncio.wait_for(encoder.encode([TEXTS[0]], True), 5)

    assert asyncio.run(on_a_new_loop()) == expected(reference, [TEXTS[0]], True)


def test_encode_many_matches_encode_per_request(predictor: SimulatedPredictor) -> None:
    requests = [*requests_of(7), ["too long " * 40]]
    many = predictor.encode_many(requests, False)
    for texts, found in zip(requests, many, strict=True):
        try:
            alone: Any = predictor.encode(texts, False)
        except UnservableText as refusal:
            alone = refusal
        if isinstance(alone, UnservableText):
            assert type(found) is type(alone) and str(found) == str(alone)
        else:
            assert found == alone
    assert isinstance(many[-1], TextTooLong)
