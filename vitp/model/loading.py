"""Weights into a ViT built for another resolution or head, and into a partitioned one:
position-embedding resampling, head/pre-logits/MPP adaptation, and group-wise loading under ZeRO-3.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .vit import Gather, ViT, full_shape


def resample_pos_embed(pos_embed: torch.Tensor, new_grid: int | tuple[int, int],
                       num_prefix_tokens: int = 1) -> torch.Tensor:
    """Resample (1, prefix + gh*gw, D) position embeddings to a new patch grid.

    The class-token embedding is kept as is; the grid part is reshaped to 2-D and resized
    bilinearly (half-pixel centres, as jax.image.resize), then flattened back row-major.
    """
    if isinstance(new_grid, int):
        new_grid = (new_grid, new_grid)
    prefix, grid = pos_embed[:, :num_prefix_tokens], pos_embed[:, num_prefix_tokens:]
    n_old = grid.shape[1]
    g_old = int(math.isqrt(n_old))
    if g_old * g_old != n_old:
        raise ValueError(f"position embedding has {n_old} grid tokens: not a square grid")
    D = grid.shape[-1]
    dtype = grid.dtype
    grid = grid.reshape(1, g_old, g_old, D).permute(0, 3, 1, 2).float()  # (1, D, g, g)
    grid = F.interpolate(grid, size=new_grid, mode="bilinear", align_corners=False)
    grid = grid.permute(0, 2, 3, 1).reshape(1, new_grid[0] * new_grid[1], D).to(dtype)
    return torch.cat([prefix, grid], dim=1)  # (1, prefix + gh'*gw', D)


def adapt_state_dict(model: ViT, state_dict: dict[str, torch.Tensor],
                     keep_head: bool | None = None) -> dict[str, torch.Tensor]:
    """Make a state dict from another resolution / head fit `model`.

    Position embeddings are resampled to the model's grid; a head whose shape differs (or
    `keep_head=False`) is replaced by the model's new one (zero weights, bias `head_bias`); pre-logits weights are
    dropped when the model has a fine-tuning head.
    """
    sd = dict(state_dict)
    if model.mpp is None:  # a masked-patch-prediction pre-training's [mask] embedding and head
        sd = {k: v for k, v in sd.items() if not k.startswith("mpp.")}
    pe = sd.get("pos_embed")
    if pe is not None and pe.shape != full_shape(model.pos_embed):
        sd["pos_embed"] = resample_pos_embed(pe, model.grid)
    own = {n: full_shape(p) for n, p in model.named_parameters()}
    if not isinstance(model.pre_logits, nn.Sequential):
        sd = {k: v for k, v in sd.items() if not k.startswith("pre_logits.")}
    head_fits = all(k in sd and sd[k].shape == own[k] for k in ("head.weight", "head.bias"))
    if keep_head is False or not head_fits:  # the zero-initialised head
        sd["head.weight"] = torch.zeros(own["head.weight"])
        sd["head.bias"] = torch.full(own["head.bias"], float(model.head_bias))  # the new head's bias
    return sd


@torch.no_grad()
def load_grouped(model: ViT, state_dict: Optional[dict[str, torch.Tensor]], gather: Gather) -> None:
    """`load_state_dict` for a partitioned model: one `init_groups` group at a time is gathered
    and filled from `state_dict` (already adapted; it may be None on ranks whose writes `gather`
    discards). Every rank must call it."""
    names = {id(p): n for n, p in model.named_parameters()}
    if state_dict is not None:
        want, have = set(names.values()), set(state_dict)
        if want != have:
            raise ValueError(f"weights do not fit the model: missing {sorted(want - have)[:5]}, "
                             f"unexpected {sorted(have - want)[:5]}")
    for params in model.init_groups():
        with gather(params):
            if state_dict is not None:
                for p in params:
                    p.copy_(state_dict[names[id(p)]])
