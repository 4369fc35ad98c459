"""One optimizer step and one evaluation pass on a DeepSpeed engine; throughput/MFU/memory.

Plain torch + DeepSpeed (no Ray), so it runs the same inside a Ray Train worker, in a
single-process benchmark on a GPU, and in unit tests.
"""
from __future__ import annotations

import math
import resource
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch

from .objective import Classify


@dataclass
class StepResult:
    loss: float  # mean over the micro-batches of this optimizer step (this rank)
    lr: float
    grad_norm: float
    images: int  # images this rank processed in the step
    seconds: float
    skipped: bool = False  # no update was applied: a loss or the grad norm was not finite (any rank)


def _grad_norm(engine) -> float:
    """Global grad norm (before clipping) as DeepSpeed computed it for the step just taken."""
    g = engine.get_global_grad_norm()
    if g is None:
        return float("nan")
    return float(g.item() if torch.is_tensor(g) else g)


def _local_grad_norm(engine) -> float:
    """Stage 0 keeps full, already all-reduced gradients on every rank: their norm is global."""
    sq = [p.grad.detach().float().pow(2).sum() for p in engine.module.parameters() if p.grad is not None]
    return torch.stack(sq).sum().sqrt().item() if sq else float("nan")


@contextmanager
def skip_update(engine):
    """Inside: the engine's step() at the accumulation boundary applies no update, and the engine
    counts it as skipped (`engine.skipped_steps`, `was_step_applied()` False, LR scheduler held).

    Every DeepSpeed wrapper (none for fp32 stage 0; fp16/bf16; ZeRO-1/2/3, offloaded or not) moves
    the weights only through the client optimizer's step() on its fp32 master copy, then copies
    the masters into the model weights: untouched masters copy back to the same bits. The no-op
    step raises the wrapper's `overflow` flag, which the engine reads right after, exactly as for
    an fp16 overflow. Wrappers that detect a non-finite grad norm themselves never call it.
    """
    opt, wrapper = engine.basic_optimizer, engine.optimizer
    saved = vars(opt).get("step")  # torch's LR scheduler wraps step() on the instance
    had_overflow = "overflow" in vars(wrapper)

    def no_update(*args, **kwargs):
        wrapper.overflow = True

    opt.step = no_update
    try:
        yield
    finally:
        if saved is None:
            del opt.step
        else:
            opt.step = saved
        if not had_overflow and "overflow" in vars(wrapper):
            del wrapper.overflow  # a plain torch optimizer (stage 0): later steps must apply


def train_step(engine, micro_batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
               nan_drill: bool = False, objective=None) -> StepResult:
    """Forward/backward each micro-batch, then DeepSpeed's step at the accumulation boundary.

    `micro_batches` yields `grad_accum` pairs (images (B,3,H,W) on the device, labels (B,)).
    A step whose loss (any micro-batch, any rank) or global grad norm is not finite applies no
    update (`skip_update`); all ranks agree through one all-reduce per step. `nan_drill`: the
    loss is multiplied by NaN, a real NaN through backward (the train.nan_drill fault drill).
    `objective`: what the loss is (vitp.train.objective; default: class labels).
    """
    objective = objective or Classify()
    t0 = time.perf_counter()
    engine.train()
    losses, images = [], 0
    lr = engine.get_lr()[0]  # the LR this step uses (the scheduler advances inside step())
    device = next(engine.module.parameters()).device
    dtype = next(engine.module.parameters()).dtype
    stage0 = engine.zero_optimization_stage() == 0
    grad_norm, skip = float("nan"), False
    for x, y in micro_batches:
        loss = objective.loss(engine, x.to(dtype), y)
        if nan_drill:
            loss = loss * float("nan")
        engine.backward(loss)
        losses.append(loss.detach())
        if engine.is_gradient_accumulation_boundary():
            if stage0:  # ZeRO wrappers check their (partitioned) grad norm themselves
                grad_norm = _local_grad_norm(engine)
            finite = bool(torch.stack(losses).isfinite().all()) and (not stage0 or math.isfinite(grad_norm))
            skip = all_reduce_max({"nonfinite": float(not finite)}, device)["nonfinite"] > 0  # any rank
        with skip_update(engine) if skip else nullcontext():
            engine.step()  # applies the update only at the accumulation boundary
        images += x.shape[0]
    if len(losses) != engine.gradient_accumulation_steps():
        raise RuntimeError(
            f"got {len(losses)} micro-batches for one step, expected grad_accum="
            f"{engine.gradient_accumulation_steps()}: the data stream ended mid-step"
        )
    loss = torch.stack(losses).mean().item()
    applied = engine.was_step_applied() if hasattr(engine, "was_step_applied") else not skip
    return StepResult(loss=loss, lr=lr, grad_norm=grad_norm if stage0 else _grad_norm(engine),
                      images=images, seconds=time.perf_counter() - t0, skipped=skip or not applied)


@torch.no_grad()
def evaluate(engine_or_model, batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
             objective=None) -> dict[str, float]:
    """Summed loss / correct / count on this rank (the caller all-reduces across ranks)."""
    objective = objective or Classify()
    module = getattr(engine_or_model, "module", engine_or_model)
    was_training = module.training
    module.eval()
    dtype = next(module.parameters()).dtype
    objective.start_eval()
    total = {"loss_sum": 0.0, "correct": 0, "count": 0}
    for x, y in batches:
        for k, v in objective.sums(engine_or_model, x.to(dtype), y).items():
            total[k] += v
    module.train(was_training)
    return total


def all_reduce_sum(values: dict[str, float], device: torch.device,
                   op: str = "SUM") -> dict[str, float]:
    """Sum (or `op`: MAX, MIN) a dict of scalars over all ranks (no-op without a process group)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return values
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(t, op=getattr(torch.distributed.ReduceOp, op))
    return dict(zip(keys, t.tolist()))


def all_reduce_max(values: dict[str, float], device: torch.device) -> dict[str, float]:
    return all_reduce_sum(values, device, op="MAX")


def memory_gb(device: torch.device) -> float:
    """Peak memory of this process: CUDA allocator peak on GPU, max RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # ru_maxrss is KiB


def group(it: Iterator, n: int) -> Iterator[list]:
    """Chunk an iterator into lists of n (the micro-batches of one optimizer step)."""
    buf = []
    for item in it:
        buf.append(item)
        if len(buf) == n:
            yield buf
            buf = []
