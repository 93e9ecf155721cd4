"""The warm-up's batches: the largest the batcher can form, so start-up meets serving's peak.

The batcher (`api.serving.batching`) forms batches of at most `MAX_BATCH_SIZE` rows whose
tokens stay within `MAX_BATCH_TOKENS` (padded: rows × longest row; packed: the real tokens),
except that one row runs alone whatever its length; no row is longer than the model's
`max_length`. A warm-up larger than that (the old `MAX_BATCH_SIZE` × `max_length`) could run
out of memory at start-up where serving would fit; a smaller one would leave serving's peak
for the first busy minute.

Which of the shapes it can form needs the most memory depends on the model: what grows with
the tokens (the linear layers' activations) is largest at the most tokens, what grows with
rows × length² (attention scores, where the kernel materialises them) at the longest rows,
and `MAX_BATCH_TOKENS // max_length` rows of `max_length` may hold up to a row's worth of
tokens less than another shape. So the warm-up runs the shape largest in each measure (one
batch when they coincide, as with powers of two). `PAD_TO_MULTIPLE_OF` pads warm-up and
served batches alike, so shapes are compared as the forward sees them. A packed batch is one
batch that is largest in both: rows of `max_length`, and one more row with the tokens left.
"""

from __future__ import annotations


def warmup_batches(
    max_length: int,
    max_batch_size: int,
    max_batch_tokens: int,
    packed: bool = False,
    pad_to_multiple_of: int | None = None,
) -> list[list[int]]:
    """The row lengths of each warm-up batch (one or two batches)."""
    if packed:
        rows = min(max_batch_size, max(1, max_batch_tokens // max_length))
        lengths = [max_length] * rows
        left = max_batch_tokens - rows * max_length
        if rows < max_batch_size and left > 0:
            lengths.append(left)
        return [lengths]
    shapes = []  # (rows, length) of every batch of longest rows the batcher can form
    for rows in range(1, max_batch_size + 1):
        length = max_length if rows == 1 else min(max_length, max_batch_tokens // rows)
        if length < 1:
            break
        shapes.append((rows, length))
    multiple = pad_to_multiple_of or 1

    def padded(length: int) -> int:
        return -(-length // multiple) * multiple

    def tokens(shape: tuple[int, int]) -> int:
        return shape[0] * padded(shape[1])

    def attention(shape: tuple[int, int]) -> int:
        return shape[0] * padded(shape[1]) ** 2

    most_tokens = max(shapes, key=lambda shape: (tokens(shape), attention(shape)))
    most_attention = max(shapes, key=lambda shape: (attention(shape), tokens(shape)))
    chosen = dict.fromkeys([most_attention, most_tokens])
    return [[length] * rows for rows, length in chosen]
