"""The parts of a Transformer encoder block (eq. 2-3): patch embedding, multi-head self-attention,
the MLP, stochastic depth and the pre-LN block; vit.py puts them together. No Ray or DeepSpeed.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class PatchEmbed(nn.Module):
    """Cut the image into PxP patches and project each to D: a PxP conv with stride P is that map."""

    def __init__(self, patch: int, width: int, in_chans: int = 3):
        super().__init__()
        self.patch = patch
        self.proj = nn.Conv2d(in_chans, width, kernel_size=patch, stride=patch)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(x)  # (B, D, H/P, W/P)
        return x.flatten(2).transpose(1, 2)  # (B, N, D) with N = HW/P^2, row-major patch order


class Attention(nn.Module):
    """Multi-head self-attention through `scaled_dot_product_attention` (flash / mem-efficient)."""

    def __init__(self, width: int, heads: int, attn_dropout: float = 0.0):
        super().__init__()
        assert width % heads == 0, f"heads {heads} must divide width {width}"
        self.heads = heads
        self.head_dim = width // heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.attn_dropout = attn_dropout

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        B, N, D = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.heads, self.head_dim)  # (B, N, 3, H, d)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each (B, H, N, d)
        return q, k, v

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, D = x.shape
        q, k, v = self._qkv(x)
        p = self.attn_dropout if self.training else 0.0
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=p)  # (B, H, N, d)
        return self.proj(out.transpose(1, 2).reshape(B, N, D))

    def attention_weights(self, x: torch.Tensor) -> torch.Tensor:
        """softmax(QK^T / sqrt(d)) explicitly, (B, H, N, N): for attention maps and tests."""
        q, k, _ = self._qkv(x)
        return (q @ k.transpose(-2, -1) * self.head_dim**-0.5).softmax(dim=-1)


class MLP(nn.Module):
    """Two linear layers with GELU between (exact erf GELU, as the official code)."""

    def __init__(self, width: int, mlp_dim: int, dropout: float = 0.0):
        super().__init__()
        self.fc1 = nn.Linear(width, mlp_dim)
        self.fc2 = nn.Linear(mlp_dim, width)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc2(self.drop(F.gelu(self.fc1(x)))))


def drop_path(x: torch.Tensor, rate: float, training: bool) -> torch.Tensor:
    """Stochastic depth (Huang et al. 2016): in training, each sample's residual branch `x` is
    dropped whole with probability `rate` and the kept ones scaled by 1 / (1 - rate), so the
    expectation is unchanged; the identity in evaluation."""
    if not training or rate <= 0.0:
        return x
    keep = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(1.0 - rate)
    return x * keep / (1.0 - rate)


def drop_path_rates(rate: float, depth: int) -> list[float]:
    """Each block's stochastic-depth rate: linear from 0 at the first block to `rate` at the last
    (timm's and DeiT's rule)."""
    return [rate * i / (depth - 1) if depth > 1 else rate for i in range(depth)]


class Block(nn.Module):
    """Pre-LN encoder block: z' = MSA(LN(z)) + z ; z = MLP(LN(z')) + z'  (eq. 2-3); with
    `drop_path`, each residual branch is dropped per sample at that rate in training."""

    def __init__(self, width: int, mlp_dim: int, heads: int, dropout: float = 0.0,
                 attn_dropout: float = 0.0, drop_path: float = 0.0):
        super().__init__()
        self.norm1 = nn.LayerNorm(width, eps=1e-6)
        self.attn = Attention(width, heads, attn_dropout)
        self.drop = nn.Dropout(dropout)
        self.norm2 = nn.LayerNorm(width, eps=1e-6)
        self.mlp = MLP(width, mlp_dim, dropout)
        self.drop_path = drop_path

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + drop_path(self.drop(self.attn(self.norm1(x))), self.drop_path, self.training)
        return x + drop_path(self.mlp(self.norm2(x)), self.drop_path, self.training)
