"""Masked patch prediction (paper Section 4.6, Appendix B.1.2): corrupt half of the patch
embeddings (80% a learnable [mask] embedding, 10% another random patch's, 10% kept) and predict
each corrupted patch's 3-bit mean colour (512 classes) from its output token.
The paper leaves the colour quantisation open; ours is in docs/hybrid_and_mpp.md section 5.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

BITS = 3
NUM_COLOURS = 2 ** (3 * BITS)  # 512


class MPPHead(nn.Module):
    """The [mask] embedding and the linear map from an output token to the 512 colour logits."""

    def __init__(self, width: int):
        super().__init__()
        self.mask_token = nn.Parameter(torch.zeros(1, 1, width))
        self.head = nn.Linear(width, NUM_COLOURS)

    def forward(self, tokens: torch.Tensor, generator: Optional[torch.Generator] = None):
        """Corrupt patch embeddings (B, N, D): see `corrupt`. A module call, so that ZeRO-3's hooks
        gather the [mask] embedding first."""
        return corrupt(tokens, self.mask_token, generator=generator)

    @torch.no_grad()
    def init_weights(self) -> None:
        nn.init.normal_(self.mask_token, std=0.02)
        nn.init.zeros_(self.head.weight)  # like the class head: uniform 1/512 at step 0
        nn.init.zeros_(self.head.bias)


def colour_targets(images: torch.Tensor, token_pixels: int, mean: Sequence[float],
                   std: Sequence[float]) -> torch.Tensor:
    """(B, 3, H, W) normalised images -> (B, N) colour classes, row-major like the tokens.

    Each token's pixels (token_pixels x token_pixels) are un-normalised to [0, 1] and averaged per
    channel; each channel mean falls in one of 8 equal bins; class = 64 r + 8 g + b."""
    m = torch.tensor(mean, dtype=torch.float32, device=images.device).view(1, 3, 1, 1)
    s = torch.tensor(std, dtype=torch.float32, device=images.device).view(1, 3, 1, 1)
    rgb = (images.float() * s + m).clamp(0, 1)
    avg = F.avg_pool2d(rgb, token_pixels)  # (B, 3, g, g)
    bins = (avg * 2**BITS).long().clamp(max=2**BITS - 1)
    cls = bins[:, 0] * 2 ** (2 * BITS) + bins[:, 1] * 2**BITS + bins[:, 2]  # (B, g, g)
    return cls.flatten(1)


def corrupt(tokens: torch.Tensor, mask_token: torch.Tensor, rate: float = 0.5,
            generator: Optional[torch.Generator] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Corrupt round(rate * N) patch embeddings of each image (B, N, D); returns the new tokens
    and the corrupted positions (B, N) bool. Of the corrupted: 80% -> `mask_token`, 10% -> the
    embedding of a random patch of a random image in the batch, 10% unchanged (BERT's rule)."""
    B, N, D = tokens.shape
    dev = tokens.device

    def rand(*shape):
        return torch.rand(*shape, generator=generator, device="cpu").to(dev)

    k = max(1, round(rate * N))
    chosen = rand(B, N).argsort(dim=1)[:, :k]  # k random positions per image
    corrupted = torch.zeros(B, N, dtype=torch.bool, device=dev).scatter_(1, chosen, True)
    u = rand(B, N)
    to_mask = corrupted & (u < 0.8)
    to_random = corrupted & (u >= 0.8) & (u < 0.9)
    flat = tokens.reshape(B * N, D)
    pick = (rand(B, N) * (B * N)).long().clamp(max=B * N - 1)  # any patch of the batch
    out = torch.where(to_random.unsqueeze(-1), flat[pick.flatten()].view(B, N, D), tokens)
    out = torch.where(to_mask.unsqueeze(-1), mask_token.to(tokens.dtype).expand(B, N, D), out)
    return out, corrupted
