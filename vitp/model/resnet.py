"""The hybrid's ResNet (BiT style, paper Section 3.1): weight-standardised convolutions and
GroupNorm, a 7x7/2 root conv + 3x3/2 max-pool, bottleneck stages; then 1x1 "patches".

Module names follow timm's hybrid (`patch_embed.backbone.stem.conv`, `...stages.S.blocks.B.conv1`)
so state dicts map one to one. Must not know about Ray or DeepSpeed.
"""
from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

# Two conventions: the official JAX code standardises with (w - mean) / (std + 1e-5) and uses
# flax's GroupNorm eps 1e-6; timm's hybrids use (w - mean) / sqrt(var + 1e-8) and eps 1e-5.
# A model keeps the one its weights were trained with (model.resnet_norm).
ResNetNorm = Literal["bit", "timm"]
GN_EPS = {"bit": 1e-6, "timm": 1e-5}


def pad_same(x: torch.Tensor, kernel: int, stride: int, value: float = 0.0) -> torch.Tensor:
    """TensorFlow's 'SAME' padding (what the JAX code and timm's `*Same` layers use): the output
    is ceil(in / stride) and an odd total pad puts the extra pixel on the right/bottom."""
    pads = []
    for size in (x.shape[-1], x.shape[-2]):  # F.pad takes the last dim first
        total = max((math.ceil(size / stride) - 1) * stride + kernel - size, 0)
        pads += [total // 2, total - total // 2]
    return F.pad(x, pads, value=value) if any(pads) else x


class StdConv2d(nn.Conv2d):
    """Conv2d without bias whose kernel is standardised per output channel at every forward."""

    def __init__(self, cin: int, cout: int, kernel: int, stride: int = 1, norm: ResNetNorm = "bit"):
        super().__init__(cin, cout, kernel, stride=stride, padding=0, bias=False)
        self.norm = norm

    def standardized(self) -> torch.Tensor:
        """The kernel as applied, computed in at least fp32 (a 16-bit variance loses the epsilons)."""
        w = self.weight.to(torch.promote_types(self.weight.dtype, torch.float32))
        mean = w.mean(dim=(1, 2, 3), keepdim=True)
        var = w.var(dim=(1, 2, 3), unbiased=False, keepdim=True)
        if self.norm == "bit":
            w = (w - mean) / (var.sqrt() + 1e-5)
        else:
            w = (w - mean) / torch.sqrt(var + 1e-8)
        return w.to(self.weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = pad_same(x, self.kernel_size[0], self.stride[0])
        return F.conv2d(x, self.standardized(), None, self.stride)


class ConvGN(nn.Module):
    """StdConv -> GroupNorm(32) [-> ReLU]: the `conv`/`norm` pair of the root and the projection."""

    def __init__(self, cin: int, cout: int, kernel: int, stride: int, norm: ResNetNorm, act: bool):
        super().__init__()
        self.conv = StdConv2d(cin, cout, kernel, stride, norm)
        self.norm = nn.GroupNorm(32, cout, eps=GN_EPS[norm])
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(self.conv(x))
        return F.relu(x) if self.act else x


class Stem(ConvGN):
    """Root block: 7x7/2 StdConv, GroupNorm, ReLU, 3x3/2 max-pool (SAME, padded with -inf)."""

    def __init__(self, width: int, norm: ResNetNorm, in_chans: int = 3):
        super().__init__(in_chans, width, 7, 2, norm, act=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = super().forward(x)
        return F.max_pool2d(pad_same(x, 3, 2, value=float("-inf")), 3, 2)


class Bottleneck(nn.Module):
    """Post-activation bottleneck: 1x1 -> 3x3 (carries the stride) -> 1x1 (4x wider), each
    standardised + GroupNorm; the sum with the shortcut goes through ReLU."""

    def __init__(self, cin: int, mid: int, stride: int, norm: ResNetNorm):
        super().__init__()
        cout = 4 * mid
        self.conv1, self.norm1 = StdConv2d(cin, mid, 1, 1, norm), nn.GroupNorm(32, mid, eps=GN_EPS[norm])
        self.conv2, self.norm2 = StdConv2d(mid, mid, 3, stride, norm), nn.GroupNorm(32, mid, eps=GN_EPS[norm])
        self.conv3, self.norm3 = StdConv2d(mid, cout, 1, 1, norm), nn.GroupNorm(32, cout, eps=GN_EPS[norm])
        # a projection where the shape changes (the first block of every stage in the configs)
        self.downsample = (ConvGN(cin, cout, 1, stride, norm, act=False)
                           if cin != cout or stride != 1 else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x if self.downsample is None else self.downsample(x)
        y = F.relu(self.norm1(self.conv1(x)))
        y = F.relu(self.norm2(self.conv2(y)))
        return F.relu(shortcut + self.norm3(self.conv3(y)))


class Stage(nn.Module):
    def __init__(self, cin: int, mid: int, blocks: int, stride: int, norm: ResNetNorm):
        super().__init__()
        self.blocks = nn.Sequential(*(Bottleneck(cin if i == 0 else 4 * mid, mid, stride if i == 0 else 1, norm)
                                      for i in range(blocks)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


class ResNet(nn.Module):
    """Root block then `layers[i]` bottlenecks in stage i (mid width root*2^i, stride 2 after the
    first stage); `layers=()` is the root block alone."""

    def __init__(self, layers: tuple[int, ...], width: int = 64, norm: ResNetNorm = "bit", in_chans: int = 3):
        super().__init__()
        self.stem = Stem(width, norm, in_chans)
        stages, cin = [], width
        for i, n in enumerate(layers):
            stages.append(Stage(cin, width * 2**i, n, 1 if i == 0 else 2, norm))
            cin = 4 * width * 2**i
        self.stages = nn.Sequential(*stages)
        self.out_chans = cin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.stages(self.stem(x))

    @torch.no_grad()
    def init_weights(self, lecun_normal_) -> None:
        """As the JAX code: lecun-normal kernels, GroupNorm 1/0, the last GroupNorm of every
        bottleneck zero (each block starts as its shortcut)."""
        for m in self.modules():
            if isinstance(m, StdConv2d):
                lecun_normal_(m.weight)
            elif isinstance(m, nn.GroupNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        for m in self.modules():
            if isinstance(m, Bottleneck):
                nn.init.zeros_(m.norm3.weight)


class HybridEmbed(nn.Module):
    """Images -> ResNet feature map -> PxP patches of it projected to D (P = 1 in the paper)."""

    def __init__(self, layers: tuple[int, ...], root_width: int, patch: int, width: int,
                 norm: ResNetNorm = "bit", in_chans: int = 3):
        super().__init__()
        self.backbone = ResNet(layers, root_width, norm, in_chans)
        self.patch = patch
        self.proj = nn.Conv2d(self.backbone.out_chans, width, kernel_size=patch, stride=patch)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(self.backbone(x))  # (B, D, H/s, W/s)
        return x.flatten(2).transpose(1, 2)  # (B, N, D), row-major
