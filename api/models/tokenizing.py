"""Texts to token ids through the fast tokenizer's own batch API, safely from any thread.

`tokenizer(texts, truncation=..., max_length=...)` in transformers sets the truncation and
padding of the one Rust tokenizer it wraps on every call, then encodes with it: two calls from
two threads (short texts tokenized on the event loop, long ones in a worker thread) can each
encode under the other's truncation, so a text could be cut, or not, depending on traffic.
It also builds a BatchEncoding per call, which costs more than tokenizing an SMS.

`TextEncoder` keeps two private copies of the Rust tokenizer, each configured once and never
changed after: one that truncates at the model's max length exactly as transformers would
(strategy `longest_first`, the tokenizer's truncation side, stride 0), one that never
truncates. Both have padding off. Encoding is then a pure function of the text, callable from
any thread, and gives transformers' own ids (tests compare them).
"""

from __future__ import annotations

import os
import threading
from typing import Any

from tokenizers import Tokenizer

# Read by the Rust tokenizers at every batch call.
PARALLELISM_VARIABLE = "TOKENIZERS_PARALLELISM"


def keep_tokenizers_serial() -> None:
    """Turns off the Rust tokenizers' own thread pool for this process, unless the
    environment already says otherwise.

    `encode_batch` splits a batch over a pool of as many threads as cores. In the server
    those threads take the cores from torch's intra-op threads, and a forward's parallel
    region then waits for a descheduled thread: measured at 128 clients x 8 texts on 2 cores,
    the 200s kept 0.84 of the saturated throughput with the pool and 0.90-0.92 without it,
    and the saturated throughput itself rose ~15 %. A request's few texts tokenize in tens
    of microseconds on one thread.
    """
    os.environ.setdefault(PARALLELISM_VARIABLE, "false")


class TextEncoder:
    """Token ids of texts, with or without truncation at `max_length`."""

    def __init__(self, tokenizer: Any, max_length: int) -> None:
        self._tokenizer = tokenizer
        self.max_length = max_length
        backend: Tokenizer | None = getattr(tokenizer, "backend_tokenizer", None)
        self._whole: Tokenizer | None = None
        self._cut: Tokenizer | None = None
        # A slow (Python) tokenizer has no backend to copy: it is called as transformers
        # intends, one call at a time.
        self._slow_lock = threading.Lock()
        if backend is not None:
            self._whole = _private_copy(backend, tokenizer)
            self._cut = _private_copy(backend, tokenizer)
            self._cut.enable_truncation(
                max_length, stride=0, strategy="longest_first", direction=tokenizer.truncation_side
            )

    def encode(
        self, texts: list[str], truncate: bool, special_tokens: bool = True
    ) -> list[list[int]]:
        """Each text's ids; cut at `max_length` (special tokens kept) when `truncate`."""
        backend = self._cut if truncate else self._whole
        if backend is None:
            with self._slow_lock:
                found: list[list[int]] = self._tokenizer(
                    texts,
                    truncation=truncate,
                    max_length=self.max_length if truncate else None,
                    add_special_tokens=special_tokens,
                )["input_ids"]
            return found
        return [e.ids for e in backend.encode_batch_fast(texts, add_special_tokens=special_tokens)]

    def decode(self, ids: list[int]) -> str:
        """The text of `ids`, special tokens kept (as transformers' `decode` by default).

        Decoding never touches truncation or padding: only a slow tokenizer needs the lock.
        """
        if self._whole is None:
            with self._slow_lock:
                slow: str = self._tokenizer.decode(ids)
            return slow
        text: str = self._tokenizer.decode(ids)
        return text


def _private_copy(backend: Tokenizer, tokenizer: Any) -> Tokenizer:
    """A copy of `backend` with no truncation and no padding, splitting special tokens in
    text as `tokenizer` does."""
    copy = Tokenizer.from_str(backend.to_str())
    copy.no_truncation()
    copy.no_padding()
    copy.encode_special_tokens = bool(getattr(tokenizer, "split_special_tokens", False))
    return copy
