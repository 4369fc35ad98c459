"""The ViT variant table: "B/16" names a shape (paper Table 1 plus big_vision's small sizes).

Owns ViTSpec, VARIANTS and decode_variant. A leaf module: must not import torch, or anything
from `pipeline` except `pipeline.errors` (config validation imports it).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import ConfigError


@dataclass(frozen=True)
class ViTSpec:
    """Shape of a ViT: the numbers of paper Table 1 plus the patch size."""

    name: str
    patch: int
    depth: int
    width: int
    mlp_dim: int
    heads: int


# name -> (depth, width, mlp_dim, heads). "mu" and "pico" are for tests and the debug recipe.
VARIANTS: dict[str, tuple[int, int, int, int]] = {
    "mu": (1, 32, 128, 2),
    "pico": (2, 64, 128, 4),
    "Ti": (12, 192, 768, 3),
    "S": (12, 384, 1536, 6),
    "M": (12, 512, 2048, 8),
    "B": (12, 768, 3072, 12),
    "L": (24, 1024, 4096, 16),
    "H": (32, 1280, 5120, 16),
}

# The variants the paper and docs/paper.md name; tests iterate over these.
PAPER_VARIANTS = ("Ti/16", "S/16", "B/16", "L/16", "H/14", "B/32", "L/32", "B/8")

_VARIANT_RE = re.compile(r"^([A-Za-z]+)/(\d+)$")


def decode_variant(variant: str) -> ViTSpec:
    """Decode "B/16" into a ViTSpec; raise ConfigError naming the valid names otherwise."""
    m = _VARIANT_RE.match(variant.strip())
    if not m or m.group(1) not in VARIANTS:
        valid = ", ".join(f"{n}/<patch>" for n in VARIANTS)
        raise ConfigError(
            f"model.variant={variant!r} is not a ViT variant: use NAME/PATCH with NAME one of "
            f"{valid} (e.g. 'B/16', 'H/14')"
        )
    name, patch = m.group(1), int(m.group(2))
    if patch <= 0:
        raise ConfigError(f"model.variant={variant!r}: patch size must be positive")
    depth, width, mlp_dim, heads = VARIANTS[name]
    return ViTSpec(name=name, patch=patch, depth=depth, width=width, mlp_dim=mlp_dim, heads=heads)
