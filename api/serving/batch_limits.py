"""When the batcher flushes a batch, and how many requests its queue holds."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BatchLimits:
    """When a batch is flushed: full by texts or tokens (padding counted), or waited enough.

    `overhead_tokens` is what one forward pass costs beyond its tokens, in tokens. With it,
    the pending rows are cut into batches of similar length that cost least in all (each
    batch: the overhead plus its padded tokens), and the batch holding the oldest row runs;
    the others wait for the next turn. None: the rows closest in length to the oldest join
    it as long as they fit.

    `packed`: batches run without padding (api.models.packing), so a batch costs its real
    tokens whatever the lengths in it: the oldest rows join first, while they fit; the cost
    model is not used.

    `refill_wait_seconds`: once a batch is answered, the next one waits up to this long for
    the requests it answered to come back (clients that send their next text when they have
    their answer: a pool of workers calling the service), unless it is full before. Without
    it, such clients split into two halves that take turns, each half a batch, so batches
    stay half the size they could be, and on a CPU the event loop's work for one half slows
    the other half's forward. The wait is for rows that are expected: after a request
    answered in part, or with nothing answered, no batch waits.
    """

    max_batch_size: int = 32
    max_batch_tokens: int = 8192
    max_wait_seconds: float = 0.002
    max_queue_requests: int = 256
    overhead_tokens: float | None = None
    packed: bool = False
    refill_wait_seconds: float = 0.0
