"""What a training step minimises: class labels (`train.objective=classify`) or masked patch
prediction (`mpp`: labels unused; the loss is over the corrupted patches only).

Each objective gives the mean loss of a micro-batch and the summed loss / correct / count of an
evaluation batch (count = images, or corrupted patches for mpp).
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F


class Classify:
    name = "classify"

    def start_eval(self) -> None:
        """Nothing to reset between evaluations."""

    def loss(self, engine, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(engine(x).float(), y)

    @torch.no_grad()
    def sums(self, engine, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
        logits = engine(x).float()
        return {"loss_sum": F.cross_entropy(logits, y, reduction="sum").item(),
                "correct": (logits.argmax(-1) == y).sum().item(), "count": y.numel()}


class MaskedPatchPrediction:
    """Cross-entropy of each corrupted patch's 3-bit mean colour (vitp.model.mpp). Targets
    come from the un-normalised input pixels (data.mean / data.std). Evaluation corrupts with a
    fixed seed, so every evaluation of a run scores the same patches of the same images."""

    name = "mpp"

    def __init__(self, mean: Sequence[float], std: Sequence[float], eval_seed: int = 0):
        self.mean, self.std, self.eval_seed = tuple(mean), tuple(std), eval_seed
        self._eval_gen = None

    def _targets(self, engine, x: torch.Tensor) -> torch.Tensor:
        return getattr(engine, "module", engine).colour_targets(x, self.mean, self.std)

    def loss(self, engine, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits, corrupted = engine(x, mpp=True)
        return F.cross_entropy(logits[corrupted].float(), self._targets(engine, x)[corrupted])

    def start_eval(self) -> None:
        self._eval_gen = torch.Generator().manual_seed(self.eval_seed)

    @torch.no_grad()
    def sums(self, engine, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
        if self._eval_gen is None:
            self.start_eval()
        logits, corrupted = engine(x, mpp=True, generator=self._eval_gen)
        logits, t = logits[corrupted].float(), self._targets(engine, x)[corrupted]
        return {"loss_sum": F.cross_entropy(logits, t, reduction="sum").item(),
                "correct": (logits.argmax(-1) == t).sum().item(), "count": t.numel()}


def objective_for(cfg) -> Classify | MaskedPatchPrediction:
    """The objective `cfg.train.objective` names."""
    if cfg.train.objective == "mpp":
        return MaskedPatchPrediction(cfg.data.mean, cfg.data.std, eval_seed=cfg.train.seed)
    return Classify()
