"""Memory model of ViT training per rank: ZeRO model states, DeepSpeed buffers, activations.

Bytes per parameter follow the ZeRO paper, with the fp32 gradient partition DeepSpeed keeps for
its optimizer step; activations follow Korthikanti et al. Derivations: docs/memory.md. Pure
arithmetic on a ViT's shape (no torch): `vitp model`, `vitp plan` and the training loop use it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..errors import InputError
from .flops import param_count
from .variants import ViTSpec, decode_variant

GB = 1e9
# DeepSpeed bucket sizes (elements) our engine sets (train/engine.py reads them from here)
REDUCE_BUCKET = int(5e7)
ALLGATHER_BUCKET = int(5e7)
PREFETCH_BUCKET = int(5e7)  # ZeRO-3 parameter prefetch
PERSISTENCE_THRESHOLD = int(1e5)  # ZeRO-3: smaller parameters stay whole on every rank
SUB_GROUP = int(1e8)  # ZeRO-3 steps the optimizer one sub-group of this many elements at a time
# ZeRO-3 releases a gathered parameter unless it is reused within MAX_REUSE elements, and keeps at
# most MAX_LIVE gathered (DeepSpeed's defaults, 1e9 each, keep a <1e9-parameter model whole
# from the second step on)
MAX_LIVE = int(1e8)
MAX_REUSE = int(2e7)

# Bytes per parameter per rank: (replicated on every rank, partitioned over N ranks).
# Mixed precision (bf16/fp16): 16-bit weights 2, 16-bit grads 2, fp32 master 4 + Adam m, v 8
# (the paper's K = 12), and the fp32 gradient partition DeepSpeed fills for the step, 4.
_MIXED = {0: (20, 0), 1: (4, 16), 2: (2, 18), 3: (0, 18)}
# bf16 at ZeRO-1 (without offload) runs DeepSpeed's BF16 optimizer (see `flat_bf16_optimizer`):
# bf16 weights 2, bf16 grads 2 and the fp32 gradient accumulator 4 on every rank; the fp32
# master and Adam m, v partitioned, 12.
_BF16_ZERO1 = (8, 12)
# fp32: weights 4, grads 4, Adam m, v 8; ZeRO 1-3 keep an fp32 copy of their partition, 4.
_FP32 = {0: (16, 0), 1: (8, 12), 2: (4, 16), 3: (0, 20)}
# The ZeRO paper's figures (mixed precision, 16 bytes a parameter, no fp32 gradient copy).
_PAPER = {0: (16, 0), 1: (4, 12), 2: (2, 14), 3: (0, 16)}


@dataclass(frozen=True)
class MemoryEstimate:
    """Per-rank figures in bytes; `host` is what offload moves to CPU memory."""

    params: int
    states: float  # model states on the device (weights, grads, optimizer)
    buffers: float  # DeepSpeed's communication buckets and ZeRO-3's gathered layers
    activations: float  # kept for backward, micro_batch images
    host: float  # offloaded optimizer states (and ZeRO-3 parameters) in host memory
    paper_states: float  # the ZeRO paper's 16-bytes-a-parameter figure for the same split

    @property
    def device(self) -> float:
        return self.states + self.buffers + self.activations

    def gb(self) -> dict[str, float]:
        return {"params_m": self.params / 1e6, "states_gb": self.states / GB,
                "buffers_gb": self.buffers / GB, "activations_gb": self.activations / GB,
                "host_gb": self.host / GB, "device_gb": self.device / GB,
                "paper_states_gb": self.paper_states / GB}


def flat_bf16_optimizer(precision: str, zero_stage: int, offload_optimizer: bool = False) -> bool:
    """Whether training runs DeepSpeed's BF16 optimizer (train/engine.py asks for it through
    `data_types.grad_accum_dtype: fp32`): bf16 at ZeRO-1 without offload. It keeps the fp32
    masters and the fp32 gradient accumulator as flat buffers, so its step is a few kernels for
    the whole model; DeepSpeed's general ZeRO-1 optimizer, and its bf16 wrapper at stage 0, check
    and scale every parameter on its own, host work that left the GPU idle (docs/memory.md)."""
    return precision == "bf16" and zero_stage == 1 and not offload_optimizer


def _per_param(zero_stage: int, precision: str, offload_optimizer: bool = False) -> tuple[float, float]:
    """(replicated, partitioned) bytes a parameter of the model states."""
    if flat_bf16_optimizer(precision, zero_stage, offload_optimizer):
        return _BF16_ZERO1
    return (_FP32 if precision == "fp32" else _MIXED)[zero_stage]


def states_bytes(params: int, zero_stage: int, world: int, precision: str = "bf16",
                 offload_optimizer: bool = False) -> float:
    """Model-state bytes per rank as DeepSpeed allocates them, before offload moves any to the
    host (`offload_optimizer` only picks which DeepSpeed optimizer that is)."""
    rep, part = _per_param(zero_stage, precision, offload_optimizer)
    return params * (rep + part / world)


def paper_states_bytes(params: int, zero_stage: int, world: int) -> float:
    """The ZeRO paper's model states per rank: DDP 16P, 4P+12P/N, 2P+14P/N, 16P/N."""
    rep, part = _PAPER[zero_stage]
    return params * (rep + part / world)


def largest_layer_params(spec: ViTSpec) -> int:
    """Parameters of the biggest single module (ZeRO-3 gathers one at a time): qkv or an MLP fc."""
    D, M = spec.width, spec.mlp_dim
    return max(3 * D * D + 3 * D, D * M + M, M * D + D)


def activation_bytes(spec: ViTSpec, image_size: int, micro_batch: int, precision: str = "bf16",
                     checkpointing: bool = False, fused_attention: bool = True) -> float:
    """Activations kept for backward: ~34*s*h bytes per layer per image in 16-bit with fused
    attention (+5*a*s^2 without), twice that in fp32; checkpointing keeps each layer's input
    (2*s*h in 16-bit) and recomputes one layer at a time."""
    s, h, a = (image_size // spec.stride) ** 2 + 1, spec.width, spec.heads
    scale = 2.0 if precision == "fp32" else 1.0
    layer = s * h * 34 + (0 if fused_attention else 5 * a * s * s)
    if checkpointing:
        per_image = spec.depth * 2 * s * h + layer
    else:
        per_image = spec.depth * layer
    return per_image * scale * micro_batch


def estimate(variant: str | ViTSpec, image_size: int = 224, *, zero_stage: int = 0, world: int = 1,
             micro_batch: int = 1, precision: str = "bf16", checkpointing: bool = False,
             offload_optimizer: bool = False, offload_params: bool = False, num_classes: int = 1000,
             representation_size: Optional[int] = None) -> MemoryEstimate:
    """Per-rank memory of training `variant` with this ZeRO stage, world and micro-batch."""
    spec = decode_variant(variant) if isinstance(variant, str) else variant
    P = param_count(spec, image_size, num_classes, representation_size)
    states = states_bytes(P, zero_stage, world, precision, offload_optimizer)
    host = 0.0
    w = 4 if precision == "fp32" else 2  # bytes of a training-precision element
    if offload_optimizer and zero_stage >= 1:
        # the optimizer partition (fp32 master or copy, m, v, fp32 grads) lives in host memory
        part = _per_param(zero_stage, precision, offload_optimizer)[1]
        opt = min(16, part) * P / world
        states, host = states - opt, opt
    if offload_params and zero_stage == 3:
        host += w * P / world
        states -= w * P / world
    buffers = 0.0
    if zero_stage >= 1:
        buffers += min(REDUCE_BUCKET, P) * w
    if zero_stage == 3:  # gathered parameters (at most MAX_LIVE) and the largest layer's gradient
        buffers += min(MAX_LIVE, P) * w + w * largest_layer_params(spec)
    elif zero_stage >= 1:
        buffers += min(ALLGATHER_BUCKET, P) * w
    acts = activation_bytes(spec, image_size, micro_batch, precision, checkpointing)
    return MemoryEstimate(params=P, states=states, buffers=buffers, activations=acts, host=host,
                          paper_states=paper_states_bytes(P, zero_stage, world))


# ------------------------------------------------------------------------------- planning
# Relative step cost of a setting, for ranking the ones that fit (lower is better):
# recomputing activations costs one more forward (4/3 of fwd + bwd); ZeRO-3 moves 1.5x the
# data-parallel volume (ZeRO paper); offload steps Adam on the CPU over PCIe (ZeRO-Offload: a
# large slowdown on fast GPUs, so only when nothing else fits); a micro-batch below 8 leaves a
# large GPU under-filled.
CHECKPOINT_COST, ZERO3_COST, OFFLOAD_COST = 4 / 3, 1.5, 4.0
USABLE = 0.9  # of device memory: CUDA context, allocator fragmentation, temporaries


@dataclass(frozen=True)
class Setting:
    zero_stage: int
    micro_batch: int
    checkpointing: bool
    offload: bool
    estimate: MemoryEstimate
    cost: float


def plan(variant: str | ViTSpec, image_size: int = 224, *, gpus: int = 8, gpu_mem_gb: float = 80.0,
         precision: str = "bf16", max_micro_batch: int = 256, num_classes: int = 1000) -> list[Setting]:
    """Every setting that fits `gpu_mem_gb` per GPU, cheapest first: for each ZeRO stage,
    checkpointing and offload choice, the largest power-of-two micro-batch that fits."""
    budget = USABLE * gpu_mem_gb * GB
    out = []
    for offload in (False, True):
        for checkpointing in (False, True):
            for stage in (0, 1, 2, 3):
                if offload and stage == 0:
                    continue
                best = None
                mb = 1
                while mb <= max_micro_batch:
                    est = estimate(variant, image_size, zero_stage=stage, world=gpus, micro_batch=mb,
                                   precision=precision, checkpointing=checkpointing,
                                   offload_optimizer=offload, offload_params=offload and stage == 3,
                                   num_classes=num_classes)
                    if est.device > budget:
                        break
                    best, mb = est, mb * 2
                if best is None:
                    continue
                fit = mb // 2
                cost = ((CHECKPOINT_COST if checkpointing else 1.0) * (ZERO3_COST if stage == 3 else 1.0)
                        * (OFFLOAD_COST if offload else 1.0) * max(1.0, 8 / fit) + 0.01 * stage)
                out.append(Setting(stage, fit, checkpointing, offload, best, cost))
    return sorted(out, key=lambda s: s.cost)


def plan_overrides(best: Setting, variant: str, image_size: int, precision: str, gpus: int,
                   global_batch: int) -> dict[str, object]:
    """A plan's setting as `--set` overrides a recipe takes as they are: `global_batch` kept over
    `gpus` workers, the accumulation derived (the micro-batch halved until it divides: a smaller
    one fits too). InputError when the batch does not split over the GPUs."""
    if global_batch % gpus:
        raise InputError(f"--global-batch {global_batch} does not split over --gpus {gpus}: "
                         "use a multiple of the GPU count")
    micro, per_step = best.micro_batch, global_batch // gpus
    while per_step % micro:
        micro //= 2
    out: dict[str, object] = {
        "model.variant": variant, "data.image_size": image_size, "parallel.precision": precision,
        "parallel.num_workers": gpus, "parallel.global_batch": global_batch,
        "parallel.micro_batch": micro, "parallel.grad_accum": per_step // micro,
        "parallel.zero_stage": best.zero_stage, "model.grad_checkpointing": str(best.checkpointing).lower(),
        "parallel.offload_optimizer": str(best.offload).lower()}
    if best.offload and best.zero_stage == 3:
        out["parallel.offload_params"] = "true"
    return out
