"""A hybrid's ResNet in other layouts: the official `.npz` names, timm's stem-only naming, and
which HYBRIDS row a state dict's shapes are.

The npz names are top-level (`conv_root`, `block{s}/unit{u}/conv{r}`; docs/hybrid_and_mpp.md).
"""
from __future__ import annotations

import re
from typing import Any, Callable, Mapping, Optional

import numpy as np
import torch

from ..errors import InputError
from .variants import HYBRIDS, VARIANTS

BACKBONE = "patch_embed.backbone."


def f32(a: Any) -> torch.Tensor:
    """numpy / torch -> contiguous fp32 torch tensor (we convert in fp32; bf16 sources upcast)."""
    if isinstance(a, torch.Tensor):
        return a.detach().to(torch.float32).contiguous()
    return torch.from_numpy(np.ascontiguousarray(np.asarray(a, dtype=np.float32)))


def _kernel(a: np.ndarray) -> np.ndarray:
    return a.transpose(3, 2, 0, 1)  # HWIO -> OIHW


def resnet_from_npz(keys: list[str], get: Callable[[str], np.ndarray]) -> dict[str, torch.Tensor]:
    """The ResNet part of an official hybrid `.npz` in our naming ({} for a plain ViT).
    `keys` are the npz keys below the checkpoint's prefix; `get(key)` reads one."""
    if "conv_root/kernel" not in keys:
        return {}
    out = {f"{BACKBONE}stem.conv.weight": f32(_kernel(get("conv_root/kernel")))}
    for ours, theirs in (("weight", "scale"), ("bias", "bias")):
        # old checkpoints keep GroupNorm params as (1, 1, 1, C)
        out[f"{BACKBONE}stem.norm.{ours}"] = f32(get(f"gn_root/{theirs}").reshape(-1))
    for key in keys:
        m = re.match(r"block(\d+)/unit(\d+)/(conv|gn)(\d|_proj)/(kernel|scale|bias)$", key)
        if not m:
            continue
        s, u, kind, which, leaf = int(m.group(1)) - 1, int(m.group(2)) - 1, m.group(3), m.group(4), m.group(5)
        base = f"{BACKBONE}stages.{s}.blocks.{u}."
        if which == "_proj":
            name = base + ("downsample.conv.weight" if kind == "conv" else
                           f"downsample.norm.{'weight' if leaf == 'scale' else 'bias'}")
        else:
            name = base + (f"conv{which}.weight" if kind == "conv" else
                           f"norm{which}.{'weight' if leaf == 'scale' else 'bias'}")
        a = get(key)
        out[name] = f32(_kernel(a) if kind == "conv" else a.reshape(-1))
    return out


def timm_to_ours(sd: Mapping[str, Any]) -> dict[str, Any]:
    """timm's stem-only hybrid (R+Ti/16) keeps the root as the backbone itself
    (`patch_embed.backbone.conv`); ours always nests it as `patch_embed.backbone.stem`."""
    return {re.sub(r"^patch_embed\.backbone\.(conv|norm)\.", BACKBONE + r"stem.\1.", k): v
            for k, v in sd.items()}


def ours_to_timm(sd: Mapping[str, Any]) -> dict[str, Any]:
    if any(k.startswith(BACKBONE + "stages.") for k in sd):
        return dict(sd)
    return {k.replace(BACKBONE + "stem.", BACKBONE): v for k, v in sd.items()}


def hybrid_layout(sd: Mapping[str, torch.Tensor]) -> Optional[tuple[tuple[int, ...], int]]:
    """(bottleneck blocks per stage, root width) of a hybrid state dict in our naming, else None."""
    root = sd.get(f"{BACKBONE}stem.conv.weight")
    if root is None:
        return None
    blocks: dict[int, set[int]] = {}
    for k in sd:
        if m := re.match(re.escape(BACKBONE) + r"stages\.(\d+)\.blocks\.(\d+)\.", k):
            blocks.setdefault(int(m.group(1)), set()).add(int(m.group(2)))
    return tuple(len(blocks[s]) for s in sorted(blocks)), int(root.shape[0])


def hybrid_variant(vit: str, layers: tuple[int, ...], patch: int, root: int) -> str:
    """The HYBRIDS name with these shapes, or an InputError that says how to add one."""
    for name, row in HYBRIDS.items():
        if row == (vit, layers, patch, root):
            return name
    raise InputError(
        f"hybrid weights with ResNet blocks {layers}, root width {root}, {patch}x{patch} patches and a "
        f"{vit} Transformer: no row of vitp.model.variants.HYBRIDS has that shape; add one there "
        f"(name -> (ViT row, blocks, patch, root width)) to import them. Known: {HYBRIDS}"
    )


def vit_rows(depth: int, width: int, mlp_dim: int, heads: Optional[int]) -> list[str]:
    """Names of the VARIANTS rows with this Transformer shape (heads None: any)."""
    return [n for n, (d, w, m, h) in VARIANTS.items()
            if (d, w, m) == (depth, width, mlp_dim) and (heads is None or h == heads)]
