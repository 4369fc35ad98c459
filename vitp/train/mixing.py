"""Mixup (Zhang et al. 2018), CutMix (Yun et al. 2019), label smoothing: a micro-batch and its soft targets.
Each micro-batch is mixed with itself rolled by one (big_vision's rule), one lambda per micro-batch from the
caller's RNG: it is what one device holds for one forward (mixing across micro-batches or ranks would keep
or exchange a global batch of images). Targets are smoothed, then mixed (timm's order). No DeepSpeed, Ray.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


def smooth_targets(y: torch.Tensor, num_classes: int, smoothing: float) -> torch.Tensor:
    """(B,) class ids -> (B, K) float32 targets: 1 - smoothing + smoothing / K on the label, smoothing / K
    elsewhere (each row sums to one)."""
    off = smoothing / num_classes
    t = torch.full((y.shape[0], num_classes), off, dtype=torch.float32, device=y.device)
    return t.scatter_(1, y.long().unsqueeze(1), 1.0 - smoothing + off)


def cutmix_box(rng: np.random.Generator, lam: float, h: int, w: int) -> tuple[int, int, int, int]:
    """A box (y0, y1, x0, x1) of about (1 - lam) of the image: sides sqrt(1 - lam) of the image's, its
    centre uniform, clipped to the borders (so it can be smaller; the caller recomputes lambda)."""
    ratio = float(np.sqrt(1.0 - lam))
    ch, cw = int(h * ratio), int(w * ratio)
    cy, cx = int(rng.integers(0, h)), int(rng.integers(0, w))
    return (max(cy - ch // 2, 0), min(cy + ch // 2, h), max(cx - cw // 2, 0), min(cx + cw // 2, w))


@dataclass(frozen=True)
class Mixing:
    """What a config asks for: Mixup / CutMix alphas (0 = off; both on: one of them per micro-batch, even
    odds), label smoothing, and the class count of the targets."""

    num_classes: int
    mixup_alpha: float = 0.0
    cutmix_alpha: float = 0.0
    smoothing: float = 0.0

    @property
    def mixes(self) -> bool:
        return self.mixup_alpha > 0 or self.cutmix_alpha > 0

    def __call__(self, x: torch.Tensor, y: torch.Tensor,
                 rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor, float]:
        """Images (B, C, H, W) and labels (B,) -> (mixed images, (B, K) targets, the weight of the
        images' own labels). Without Mixup or CutMix: the images unchanged and lambda 1."""
        targets = smooth_targets(y, self.num_classes, self.smoothing)
        if not self.mixes or x.shape[0] < 2:
            return x, targets, 1.0
        cut = self.cutmix_alpha > 0 and (self.mixup_alpha <= 0 or rng.random() < 0.5)
        alpha = self.cutmix_alpha if cut else self.mixup_alpha
        lam = float(rng.beta(alpha, alpha))
        partner = x.roll(1, dims=0)
        if cut:
            h, w = x.shape[-2:]
            y0, y1, x0, x1 = cutmix_box(rng, lam, h, w)
            x = x.clone()
            x[..., y0:y1, x0:x1] = partner[..., y0:y1, x0:x1]
            lam = 1.0 - (y1 - y0) * (x1 - x0) / float(h * w)  # the pixels each label really has
        else:
            x = (lam * x.float() + (1.0 - lam) * partner.float()).to(x.dtype)
        return x, lam * targets + (1.0 - lam) * targets.roll(1, dims=0), lam
