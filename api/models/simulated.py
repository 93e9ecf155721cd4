"""A simulated device: a model declared `simulated:` in the models file, for capacity planning
and load tests of everything but the forward.

It loads no weights. Its texts are tokenized by a real tokenizer (the embedded model's base's
unless the declaration names another folder), so admission, the batcher and the cache see real
token counts, and each batch is answered after sleeping what the declared cost says it takes
(`seconds_per_batch + seconds_per_token × tokens`, tokens as a padded forward computes them).
`time.sleep` releases the GIL, as a real forward does while it computes.

A row's logits are drawn from a keyed hash of its token ids: deterministic, a function of the
text alone (never of its batch-mates or the time), so caching, batch invariance and the answer
identity behave as with a real model, and probabilities are their softmax as for one.
"""

from __future__ import annotations

import hashlib
import time
from array import array
from pathlib import Path

import torch

from api.models.checkpoint import folder_fingerprint
from api.models.loader import PHASES, LoadedModel, LoadError, read_tokenizer, timed
from api.models.predictor import BatchProbe, Predictor, batch_tokens, probe_lengths
from api.models.spec import ModelSpec, SimulatedDevice

# No tensor of a simulated model lives anywhere: the meta device says so, and gives it a
# device thread and batch slot of its own, apart from a real CPU or GPU model's.
SIMULATED_DEVICE = torch.device("meta")
# Changing it changes every simulated score: it is part of the answer identity.
SCORE_KEY = b"loraserve-simulated-v1"
# Logits are drawn uniformly from [-LOGIT_RANGE, LOGIT_RANGE]: both labels win for some texts.
LOGIT_RANGE = 4.0
_UINT64 = 2.0**64


def load_simulated(spec: ModelSpec) -> LoadedModel:
    """A simulated model's tokenizer and what the service reports about it."""
    simulated, tokenizer_folder = spec.simulated, spec.tokenizer
    assert simulated is not None and tokenizer_folder is not None and spec.labels is not None
    phases = dict.fromkeys(PHASES, 0.0)
    folder = Path(tokenizer_folder)
    with timed(phases, "resolve"):
        if not folder.is_dir():
            raise LoadError(spec.name, folder, "tokenizer folder does not exist")
        tokenizer = read_tokenizer(spec, folder)
        fingerprint = folder_fingerprint(folder)  # the tokenizer decides the ids, so the scores
    numerics: dict[str, object] = {
        "simulated": simulated.model_dump(),
        "score_key": SCORE_KEY.decode(),
        "device_type": SIMULATED_DEVICE.type,
        "max_length": spec.max_length,
        "labels": spec.labels,
        "problem_type": "single_label_classification",
        "decision_threshold": spec.decision_threshold,
    }
    return LoadedModel(
        spec=spec,
        model=torch.nn.Module(),  # no layers, no weights
        tokenizer=tokenizer,
        device=SIMULATED_DEVICE,
        folder=folder,
        labels=list(spec.labels),
        problem_type="single_label_classification",
        architecture="Simulated",
        base_fingerprint=fingerprint,
        adapter_digests={},
        dtype="float32",
        weight_bytes=0,
        revision=None,
        numerics=numerics,
        phases=phases,
    )


def hashed_logits(ids: list[int], labels: int) -> list[float]:
    """`labels` logits in [-LOGIT_RANGE, LOGIT_RANGE) from a keyed hash of the ids."""
    digest = hashlib.blake2b(
        array("q", ids).tobytes(), key=SCORE_KEY, digest_size=8 * labels
    ).digest()
    return [
        (int.from_bytes(digest[8 * i : 8 * i + 8], "little") / _UINT64 * 2 - 1) * LOGIT_RANGE
        for i in range(labels)
    ]


def batch_seconds(device: SimulatedDevice, batch: list[list[int]]) -> float:
    """What the declared device takes for `batch`: padded, as the batcher counts its tokens."""
    return device.seconds_per_batch + device.seconds_per_token * batch_tokens(batch, packed=False)


class SimulatedPredictor(Predictor):
    """The predictor of a simulated model: encodes with its tokenizer, as any model does, and
    answers each forward with hashed logits after sleeping the batch's cost."""

    def __init__(self, loaded: LoadedModel, pad_to_multiple_of: int | None = None) -> None:
        super().__init__(loaded, pad_to_multiple_of)
        assert loaded.spec.simulated is not None
        self.device = loaded.spec.simulated

    def enable_packing(self) -> bool:
        """Never packs: its batches cost their padded tokens, as declared."""
        return False

    def warm_up(self, max_batch_size: int, max_batch_tokens: int) -> None:
        """Nothing to warm: no weights, no kernels, no allocator."""

    def overhead_tokens(self, repeats: int = 5) -> float | None:
        """The declared cost's own answer, not a timing: per-batch over per-token seconds."""
        if self.device.seconds_per_token <= 0:
            return None
        return self.device.seconds_per_batch / self.device.seconds_per_token

    def probe_batches(self) -> BatchProbe:
        """The variance measured as for a real model, on the scores without the sleeps; the
        costs the declared ones, not slept through."""
        probe = self._probe(probe_lengths(self.max_length))
        together = self._scores(probe)
        alone = torch.cat([self._scores([row]) for row in probe])
        costs = [(batch_tokens(probe, packed=False), batch_seconds(self.device, probe))]
        costs += [(len(row), batch_seconds(self.device, [row])) for row in probe]
        return BatchProbe(float((together - alone).abs().max().item()), tuple(costs))

    def _logits(self, batch: list[list[int]], adapters: list[str | None]) -> torch.Tensor:
        time.sleep(batch_seconds(self.device, batch))
        return self._scores(batch)

    def _scores(self, batch: list[list[int]]) -> torch.Tensor:
        labels = len(self.labels)
        return torch.tensor([hashed_logits(row, labels) for row in batch], dtype=torch.float32)
