"""Causal-LM adapters as classifiers: a prompt, and one label word per label.

Many spam adapters for an LLM are trained as causal LMs: the model answers a prompt with a
label word ("spam"/"ham", "스팸"/"정상"). One forward pass scores them, no generation loop: a
label's score is the softmax, over the labels, of the next-token logit of its word's first
token at the end of the prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from api.models.spec import ModelSpec

TEXT_SLOT = "{text}"


class LabelWordsError(ValueError):
    """Label words that cannot tell the labels apart."""


def first_token_ids(tokenizer: Any, label_words: dict[str, str]) -> list[int]:
    """The first token of each label's word, in label order; refused when two labels'
    words begin with the same token (their scores would always be equal) or a word is empty."""
    ids: dict[int, str] = {}
    for label, word in label_words.items():
        tokens = tokenizer(word, add_special_tokens=False)["input_ids"]
        if not tokens:
            raise LabelWordsError(f"label {label!r}: its word {word!r} has no tokens")
        other = ids.setdefault(tokens[0], label)
        if other != label:
            shown = tokenizer.convert_ids_to_tokens(tokens[0])
            raise LabelWordsError(
                f"labels {other!r} and {label!r}: their words {label_words[other]!r} and "
                f"{word!r} both begin with the token {shown!r}; choose words that differ there"
            )
    return list(ids)


@dataclass(frozen=True)
class Prompt:
    """Renders a text into the model's prompt, through the chat template if asked."""

    template: str
    chat_template: bool
    tokenizer: Any

    @classmethod
    def of(cls, spec: ModelSpec, tokenizer: Any) -> Prompt:
        assert spec.prompt is not None
        if spec.chat_template and not getattr(tokenizer, "chat_template", None):
            raise LabelWordsError("chat_template: true, but the tokenizer has no chat template")
        return cls(spec.prompt, spec.chat_template, tokenizer)

    @property
    def adds_special_tokens(self) -> bool:
        """A chat template writes its own special tokens; a plain prompt gets the tokenizer's."""
        return not self.chat_template

    def render(self, text: str) -> str:
        """The prompt with `text` in its slot (by replacement: braces in texts stay as sent)."""
        content = self.template.replace(TEXT_SLOT, text)
        if not self.chat_template:
            return content
        rendered: str = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
        )
        return rendered
