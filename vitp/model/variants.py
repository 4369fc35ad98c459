"""The ViT variant table: "B/16" names a shape (paper Table 1 plus big_vision's small sizes);
"R50+B/16" names a hybrid (a BiT ResNet whose feature map is cut into 1x1 patches, Table 5).

Owns ViTSpec, VARIANTS, HYBRIDS and decode_variant. A leaf module: must not import torch, or anything
from `vitp` except `vitp.errors` (config validation imports it).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from ..errors import ConfigError


@dataclass(frozen=True)
class ViTSpec:
    """Shape of a ViT: the numbers of paper Table 1 plus the patch size. A hybrid also has the
    ResNet's bottleneck blocks per stage (`resnet`; () = the root block alone) and its root width;
    its `patch` is then taken on the ResNet's feature map."""

    name: str
    patch: int
    depth: int
    width: int
    mlp_dim: int
    heads: int
    resnet: Optional[tuple[int, ...]] = None
    resnet_width: int = 64

    @property
    def hybrid(self) -> bool:
        return self.resnet is not None

    @property
    def stride(self) -> int:
        """Image pixels per token side: the patch, times the ResNet's downsampling (the root's
        conv/2 and max-pool/2, then /2 in every stage after the first)."""
        if self.resnet is None:
            return self.patch
        return self.patch * 4 * 2 ** max(len(self.resnet) - 1, 0)

    @property
    def feature_chans(self) -> int:
        """Channels the patch projection reads: RGB, or the ResNet's last stage (4x its mid width)."""
        if self.resnet is None:
            return 3
        return self.resnet_width * (4 * 2 ** (len(self.resnet) - 1) if self.resnet else 1)


# name -> (depth, width, mlp_dim, heads). "mu", "pico" and "nano" are for tests and the debug recipe;
# "nano" is Ti's width at depth 2: the smallest model whose qkv and MLP weights ZeRO-3 partitions
# (over its 1e5-element persistence threshold, vitp/model/memory.py).
VARIANTS: dict[str, tuple[int, int, int, int]] = {
    "mu": (1, 32, 128, 2),
    "pico": (2, 64, 128, 4),
    "nano": (2, 192, 768, 3),
    "Ti": (12, 192, 768, 3),
    "S": (12, 384, 1536, 6),
    "M": (12, 512, 2048, 8),
    "B": (12, 768, 3072, 12),
    "L": (24, 1024, 4096, 16),
    "H": (32, 1280, 5120, 16),
}

# Hybrids: name -> (ViT row, bottleneck blocks per ResNet stage, patch on the feature map, root
# width). The official configs (docs/hybrid_and_mpp.md); "R50" with three stages is (3, 4, 9) so
# that the map is /16. "R+Ti/16" keeps its official name although the root block's /4 and 8x8
# patches make it /32. "R+pico/8" and "R8+pico/8" (root width 32) are test and demo sizes.
HYBRIDS: dict[str, tuple[str, tuple[int, ...], int, int]] = {
    "R50+B/16": ("B", (3, 4, 9), 1, 64),
    "R50+L/32": ("L", (3, 4, 6, 3), 1, 64),
    "R26+B/32": ("B", (2, 2, 2, 2), 1, 64),
    "R26+S/32": ("S", (2, 2, 2, 2), 1, 64),
    "R+Ti/16": ("Ti", (), 8, 64),
    "R+pico/8": ("pico", (), 2, 32),
    "R8+pico/8": ("pico", (1, 1), 1, 32),
}

# The variants the paper and docs/paper.md name; tests iterate over these.
PAPER_VARIANTS = ("Ti/16", "S/16", "B/16", "L/16", "H/14", "B/32", "L/32", "B/8")

_VARIANT_RE = re.compile(r"^([A-Za-z]+)/(\d+)$")


def decode_variant(variant: str) -> ViTSpec:
    """Decode "B/16" or a hybrid's "R50+B/16" into a ViTSpec; raise ConfigError naming the
    valid names otherwise."""
    if variant.strip() in HYBRIDS:
        name, layers, patch, root = HYBRIDS[variant.strip()]
        depth, width, mlp_dim, heads = VARIANTS[name]
        return ViTSpec(name=variant.strip(), patch=patch, depth=depth, width=width, mlp_dim=mlp_dim,
                       heads=heads, resnet=layers, resnet_width=root)
    m = _VARIANT_RE.match(variant.strip())
    if not m or m.group(1) not in VARIANTS:
        valid = ", ".join(f"{n}/<patch>" for n in VARIANTS)
        raise ConfigError(
            f"model.variant={variant!r} is not a ViT variant: use NAME/PATCH with NAME one of "
            f"{valid} (e.g. 'B/16', 'H/14'), or a hybrid: {', '.join(HYBRIDS)}"
        )
    name, patch = m.group(1), int(m.group(2))
    if patch <= 0:
        raise ConfigError(f"model.variant={variant!r}: patch size must be positive")
    depth, width, mlp_dim, heads = VARIANTS[name]
    return ViTSpec(name=name, patch=patch, depth=depth, width=width, mlp_dim=mlp_dim, heads=heads)
