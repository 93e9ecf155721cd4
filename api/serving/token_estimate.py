"""How many tokens a text will be, told from its characters before it is tokenized: enough to
refuse a request under overload without tokenizing it (api.serving.classify)."""

from __future__ import annotations

from dataclasses import dataclass, field

from api.serving.running_quantile import RunningQuantile

# The lower quartile of tokens per character over the texts tokenized lately: a text is
# estimated shorter than most are, so a request refused on its estimate is one that its
# real length would have refused too, but for the texts of an unusual make-up.
QUANTILE = 0.25
# Per text tokenized, in natural-log units: it settles within a few hundred texts, and
# follows a change in what clients send (another language, longer texts) as fast.
STEP = 0.05
# Below this no tokenizer goes (a character makes at least a byte, a token at most a word
# or two), and above it a text of special tokens alone would lift it too far.
FLOOR, CEILING = 0.01, 4.0


@dataclass
class TokenEstimate:
    """Tokens per character of one model's texts, learnt from the texts it tokenizes."""

    max_length: int
    _per_character: RunningQuantile = field(
        default_factory=lambda: RunningQuantile(
            QUANTILE, STEP, start=0.25, floor=FLOOR, ceiling=CEILING
        )
    )
    _seen: bool = False

    def observe(self, texts: list[str], rows: list[list[int]]) -> None:
        """Adds the texts as tokenized."""
        for text, ids in zip(texts, rows, strict=True):
            if text:
                self._per_character.observe(max(len(ids), 1) / len(text))
        self._seen = True

    def lengths(self, texts: list[str]) -> dict[int, int] | None:
        """The texts' estimated rows (length: count), each at most `max_length` and at
        least one token; None before any text was tokenized."""
        if not self._seen:
            return None
        ratio = self._per_character.value
        lengths: dict[int, int] = {}
        for text in texts:
            length = min(self.max_length, max(1, int(len(text) * ratio)))
            lengths[length] = lengths.get(length, 0) + 1
        return lengths
