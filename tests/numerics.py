"""Float32 tolerances derived from a computation's depth and scale, so a comparison between two
implementations (ours vs timm, vs a numpy reference) holds on any CPU.

Two implementations of the same function in float32 differ by roundoff: each matmul or conv with
fan-in K adds a relative error of about eps32 * sqrt(K) (random-walk accumulation), and N such
layers in sequence add up, again as a random walk, to eps32 * sqrt(K * N) of the output's scale.
Which kernels a CPU picks (AVX2 or AVX-512, one thread or two) moves the result within that
envelope, never much beyond it; measured on R50+B/16 (K 3072, N 126, logits up to 2.2): 0.01 to
0.22 of one unit, so two units leave ~9x headroom on any machine. Exactness (the same function,
not just close) is asserted separately in float64, where roundoff is 2^29 times smaller.
"""
import math

import torch
from torch import nn

EPS32 = torch.finfo(torch.float32).eps  # 2^-23


def f32_tolerance(model: nn.Module, y: torch.Tensor, units: float = 2.0) -> float:
    """Absolute tolerance for comparing `model`'s float32 output `y` with another implementation's:
    units * eps32 * sqrt(max fan-in * sequential layers) * max|y|. Sequential layers: every Linear
    and Conv2d, plus the two attention matmuls of each Transformer block."""
    layers = [m for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv2d))]
    fan_in = max(m.weight[0].numel() for m in layers)
    blocks = len(getattr(model, "blocks", ()))
    depth = len(layers) + 2 * blocks
    return units * EPS32 * math.sqrt(fan_in * depth) * float(y.abs().max())
