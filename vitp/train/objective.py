"""What a training step minimises: class labels (`train.objective=classify`: softmax or sigmoid, with
Mixup / CutMix / label smoothing) or masked patch prediction (`mpp`: labels unused; the loss is over the
corrupted patches only). Each gives the mean loss of a micro-batch and the summed loss / correct / count
of an evaluation batch (count = images, or corrupted patches for mpp).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ..config.augreg import augreg_of
from .mixing import Mixing, smooth_targets


class Classify:
    """Class labels: softmax cross-entropy, or (`loss="sigmoid"`) a binary cross-entropy per class summed
    over classes (big_vision's ImageNet-21k loss), on targets from `mixing` (Mixup / CutMix / label
    smoothing; mixing.py). Its random draws come from (seed, step, rank): `at_step` before each step."""

    name = "classify"

    def __init__(self, loss: str = "softmax", mixing: Mixing | None = None, seed: int = 0):
        self.kind, self.mixing, self.seed = loss, mixing, seed
        self._rng = np.random.default_rng([seed & 0xFFFFFFFF])

    def at_step(self, step: int, rank: int) -> None:
        """The draws of optimizer step `step` on rank `rank` (the same after a resume)."""
        self._rng = np.random.default_rng([self.seed & 0xFFFFFFFF, step, rank, 0x6D6978])

    def start_eval(self) -> None:
        """Nothing to reset between evaluations."""

    def _soft(self, logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        if self.kind == "sigmoid":
            per_image = F.binary_cross_entropy_with_logits(logits, targets, reduction="none").sum(-1)
        else:
            per_image = -(targets * F.log_softmax(logits, dim=-1)).sum(-1)
        return per_image.mean() if reduction == "mean" else per_image.sum()

    def loss(self, engine, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.mixing is not None:
            x, targets, _ = self.mixing(x, y, self._rng)
            return self._soft(engine(x).float(), targets)
        logits = engine(x).float()
        if self.kind == "softmax":
            return F.cross_entropy(logits, y)
        return self._soft(logits, smooth_targets(y, logits.shape[-1], 0.0))

    @torch.no_grad()
    def sums(self, engine, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
        """Evaluation on the true labels (no mixing, no smoothing); top-1 is the argmax's hit, which for
        the sigmoid loss on single-label data is big_vision's prec@1."""
        logits = engine(x).float()
        loss = (F.cross_entropy(logits, y, reduction="sum") if self.kind == "softmax"
                else self._soft(logits, smooth_targets(y, logits.shape[-1], 0.0), reduction="sum"))
        return {"loss_sum": loss.item(), "correct": (logits.argmax(-1) == y).sum().item(), "count": y.numel()}


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

    def at_step(self, step: int, rank: int) -> None:
        """The corruption draws come from torch's generator (seeded at the start, like dropout)."""

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
    t = cfg.train
    if t.objective == "mpp":
        return MaskedPatchPrediction(cfg.data.mean, cfg.data.std, eval_seed=t.seed)
    mixing = Mixing(cfg.model.num_classes, augreg_of(cfg).mixup_alpha, t.cutmix_alpha, t.label_smoothing)
    return Classify(t.loss, mixing if mixing.mixes or mixing.smoothing else None, seed=t.seed)
