"""One optimizer step and one evaluation pass on a DeepSpeed engine; throughput/MFU/memory.

Plain torch + DeepSpeed (no Ray), so it runs the same inside a Ray Train worker, in a
single-process benchmark on a GPU, and in unit tests.
"""
from __future__ import annotations

import resource
import time
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch
import torch.nn.functional as F


@dataclass
class StepResult:
    loss: float  # mean over the micro-batches of this optimizer step (this rank)
    lr: float
    grad_norm: float
    images: int  # images this rank processed in the step
    seconds: float


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


def train_step(engine, micro_batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> StepResult:
    """Forward/backward each micro-batch, then DeepSpeed's step at the accumulation boundary.

    `micro_batches` yields `grad_accum` pairs (images (B,3,H,W) on the device, labels (B,)).
    """
    t0 = time.perf_counter()
    engine.train()
    losses, images = [], 0
    lr = engine.get_lr()[0]  # the LR this step uses (the scheduler advances inside step())
    dtype = next(engine.module.parameters()).dtype
    stage0 = engine.zero_optimization_stage() == 0
    grad_norm = float("nan")
    for x, y in micro_batches:
        logits = engine(x.to(dtype))  # (B, K)
        loss = F.cross_entropy(logits.float(), y)
        engine.backward(loss)
        if stage0 and engine.is_gradient_accumulation_boundary():
            grad_norm = _local_grad_norm(engine)
        engine.step()  # applies the update only at the accumulation boundary
        losses.append(loss.detach())
        images += x.shape[0]
    if len(losses) != engine.gradient_accumulation_steps():
        raise RuntimeError(
            f"got {len(losses)} micro-batches for one step, expected grad_accum="
            f"{engine.gradient_accumulation_steps()}: the data stream ended mid-step"
        )
    loss = torch.stack(losses).mean().item()
    return StepResult(loss=loss, lr=lr, grad_norm=grad_norm if stage0 else _grad_norm(engine),
                      images=images, seconds=time.perf_counter() - t0)


@torch.no_grad()
def evaluate(engine_or_model, batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, float]:
    """Summed loss / correct / count on this rank (the caller all-reduces across ranks)."""
    module = getattr(engine_or_model, "module", engine_or_model)
    was_training = module.training
    module.eval()
    dtype = next(module.parameters()).dtype
    total_loss, correct, count = 0.0, 0, 0
    for x, y in batches:
        logits = engine_or_model(x.to(dtype)).float()
        total_loss += F.cross_entropy(logits, y, reduction="sum").item()
        correct += (logits.argmax(-1) == y).sum().item()
        count += y.numel()
    module.train(was_training)
    return {"loss_sum": total_loss, "correct": correct, "count": count}


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
