"""Analytic FLOPs and parameter counts of a ViT or hybrid, from its shape alone (no allocation).

Counts the multiply-accumulates of every matmul and conv (a hybrid's ResNet, patch projection, qkv,
attention QK^T and AV, output projection, MLP, pre-logits, head): FLOPs = 2 x MACs, as timm/fvcore.
Training FLOPs ~ 3 x forward (backward costs twice the forward). Used for MFU.
"""
from __future__ import annotations

from typing import Optional

from .variants import ViTSpec, decode_variant


def _spec(variant: str | ViTSpec) -> ViTSpec:
    return decode_variant(variant) if isinstance(variant, str) else variant


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def resnet_cost(s: ViTSpec, image_size: int, in_chans: int = 3) -> tuple[int, int]:
    """(MACs for one image, parameters) of a hybrid's ResNet; (0, 0) for a plain ViT. Convs have
    no bias; every GroupNorm has a scale and a bias per channel; SAME padding: out = ceil(in / s)."""
    if not s.hybrid:
        return 0, 0
    r = s.resnet_width
    hw = _ceil_div(image_size, 2)  # root conv /2
    macs, params = hw * hw * 49 * in_chans * r, 49 * in_chans * r + 2 * r
    hw, cin = _ceil_div(hw, 2), r  # max-pool /2
    for i, blocks in enumerate(s.resnet):
        mid = r * 2**i
        for b in range(blocks):
            stride = 2 if (i > 0 and b == 0) else 1
            out_hw = _ceil_div(hw, stride)
            macs += hw * hw * cin * mid + out_hw * out_hw * (9 * mid * mid + mid * 4 * mid)
            params += cin * mid + 9 * mid * mid + mid * 4 * mid + 2 * (mid + mid + 4 * mid)
            if cin != 4 * mid or stride != 1:  # projection shortcut
                macs += out_hw * out_hw * cin * 4 * mid
                params += cin * 4 * mid + 2 * 4 * mid
            hw, cin = out_hw, 4 * mid
    return macs, params


def forward_flops(variant: str | ViTSpec, image_size: int = 224, num_classes: int = 1000,
                  representation_size: Optional[int] = None, in_chans: int = 3) -> float:
    """Forward FLOPs for one image (2 x MACs of all matmuls; elementwise ops ignored)."""
    s = _spec(variant)
    D, L = s.width, s.depth
    n_patches = (image_size // s.stride) ** 2
    N = n_patches + 1  # tokens including the class token
    macs = resnet_cost(s, image_size, in_chans)[0]
    macs += n_patches * (s.feature_chans * s.patch**2) * D  # patch projection
    per_layer = (
        N * D * 3 * D  # qkv
        + 2 * N * N * D  # QK^T and attention x V, summed over heads
        + N * D * D  # output projection
        + 2 * N * D * s.mlp_dim  # MLP fc1 + fc2
    )
    macs += L * per_layer
    if representation_size:
        macs += D * representation_size
        macs += representation_size * num_classes
    else:
        macs += D * num_classes
    return 2.0 * macs


def training_flops(variant: str | ViTSpec, image_size: int = 224, num_classes: int = 1000,
                   representation_size: Optional[int] = None) -> float:
    """FLOPs of one forward + backward for one image: 3 x forward."""
    return 3.0 * forward_flops(variant, image_size, num_classes, representation_size)


def param_count(variant: str | ViTSpec, image_size: int = 224, num_classes: int = 1000,
                representation_size: Optional[int] = None, in_chans: int = 3) -> int:
    """Parameters of `ViT(...)` computed from the shape (cross-checked against the module)."""
    s = _spec(variant)
    D, L, M = s.width, s.depth, s.mlp_dim
    n = (image_size // s.stride) ** 2
    embed = s.feature_chans * s.patch**2 * D + D + D + (n + 1) * D  # conv w+b, cls, pos
    embed += resnet_cost(s, image_size, in_chans)[1]
    block = (D * 3 * D + 3 * D) + (D * D + D) + (D * M + M) + (M * D + D) + 4 * D
    head_in = representation_size or D
    head = head_in * num_classes + num_classes
    pre = (D * representation_size + representation_size) if representation_size else 0
    return embed + L * block + 2 * D + pre + head


def mfu(images_per_sec: float, flops_per_image_train: float, peak_flops_per_sec: float) -> float:
    """Model FLOPs utilisation: achieved training FLOP/s over the device peak (all devices)."""
    return images_per_sec * flops_per_image_train / peak_flops_per_sec
