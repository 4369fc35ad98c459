"""Weight EMA under ZeRO 0-3: each rank keeps the exponential moving average of its own fp32 master
fragment of every parameter (no gather per step), written beside a checkpoint as one safetensors file
per rank (each fragment with its offset in the flattened parameter) and read back at any world size
from the saved fragments that overlap the new ones. `full_ema` puts the fragments together (export).
"""
from __future__ import annotations

import json
import os
from typing import Iterator

import torch

from .. import storage

DIR = "ema"  # <checkpoint>/ema/rank_NNNNN.safetensors


def fp32_fragments(engine) -> Iterator[tuple[str, int, torch.Tensor]]:
    """(name, offset in the flattened parameter, this rank's fp32 master values there) for every
    parameter this rank holds a piece of: ZeRO-3's partition, ZeRO-1/2's and the bf16 optimizer's
    fragment, or (fp32 without ZeRO) the parameter itself. Views the optimizer updates in place."""
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    masters = _replicated_masters(engine.optimizer)
    for name, p in engine.module.named_parameters():
        if hasattr(p, "ds_id"):  # ZeRO-3: rank r holds [r x part, (r + 1) x part), the last one padded
            part, whole = p.partition_numel(), p.ds_numel
            n = max(0, min(part, whole - rank * part))
            if n:
                yield name, rank * part, _zero3_partition(p).view(-1)[:n]
        elif getattr(p, "_hp_mapping", None) is not None:
            yield name, p._hp_mapping.lp_fragment_address.start, p._hp_mapping.get_hp_fragment().view(-1)
        elif id(p) in masters:  # 16-bit weights without ZeRO: DeepSpeed's fp32 copy of all of them
            yield name, 0, masters[id(p)]
        elif p.dtype == torch.float32 and engine.zero_optimization_stage() == 0:
            yield name, 0, p.detach().view(-1)


def _zero3_partition(p) -> torch.Tensor:
    """ZeRO-3's fp32 partition of `p`, where the optimizer keeps it. DeepSpeed's public
    `safe_get_local_fp32_param` moves it to the accelerator: with the optimizer offloaded to the CPU
    that is a copy, which the EMA would then average forever; its own lookup (0.19) is the view."""
    opt = p._z3_optimizer
    if hasattr(opt, "_get_fp32_opt_state_partition"):
        return opt._get_fp32_opt_state_partition(p, release_swap_buffers=True)[0]
    from deepspeed.utils import safe_get_local_fp32_param  # lazy: deepspeed

    return safe_get_local_fp32_param(p)


def _replicated_masters(optimizer) -> dict[int, torch.Tensor]:
    """{id(16-bit parameter): its fp32 master, flattened} of DeepSpeed's FP16 optimizers (which also
    carry bf16 below ZeRO-1): `fp32_groups` beside `fp16_groups`, or one flat fp32 buffer per group."""
    groups = getattr(optimizer, "fp16_groups", None)
    if groups is None or not (hasattr(optimizer, "fp32_groups") or hasattr(optimizer, "fp32_groups_flat")):
        return {}
    out = {}
    for i, params in enumerate(groups):
        if hasattr(optimizer, "fp32_groups"):
            out.update({id(p): m.detach().view(-1) for p, m in zip(params, optimizer.fp32_groups[i])})
            continue
        offset, flat = 0, optimizer.fp32_groups_flat[i]
        for p in params:
            out[id(p)] = flat.narrow(0, offset, p.numel())
            offset += p.numel()
    return out


class WeightEMA:
    """ema <- decay x ema + (1 - decay) x weights after every applied step, on this rank's fragments.
    Where every rank holds all of it (fp32 without ZeRO), only rank 0 writes it."""

    def __init__(self, engine, decay: float):
        self.engine, self.decay, self.updates = engine, decay, 0
        # fp32 without ZeRO keeps a whole copy on every rank; DeepSpeed's bf16 optimizer partitions it
        self.replicated = engine.zero_optimization_stage() == 0 and not any(
            getattr(p, "_hp_mapping", None) is not None for p in engine.module.parameters())
        self.reset()

    def reset(self) -> None:
        """Start from the weights as they are (a fresh run, or a checkpoint saved without EMA)."""
        self._watch()
        self.ema = {name: (offset, t.detach().float().clone()) for name, offset, t in self.views}
        self.updates = 0

    def _watch(self) -> None:
        """The master fragments' views, looked up once (ZeRO-3's lookup synchronises a CUDA stream per
        parameter) and again after every checkpoint load, which may replace DeepSpeed's buffers."""
        self.views = list(fp32_fragments(self.engine))

    @torch.no_grad()
    def update(self) -> None:
        for name, _, t in self.views:
            self.ema[name][1].lerp_(t.float(), 1.0 - self.decay)
        self.updates += 1

    def whole(self, everywhere: bool = True) -> dict[str, torch.Tensor] | None:
        """The whole EMA state dict (fp32) on every rank (or on rank 0 only, None elsewhere): a collective
        that gathers one block's fragments at a time (the model's `init_groups`), never all at once."""
        module = self.engine.module
        dist = torch.distributed.is_initialized()
        rank, world = (torch.distributed.get_rank(), torch.distributed.get_world_size()) if dist else (0, 1)
        names = {id(p): n for n, p in module.named_parameters()}
        out = {}
        for params in module.init_groups():
            group = [names[id(p)] for p in params]
            mine = {} if self.replicated and rank else {n: self.ema[n] for n in group if n in self.ema}
            parts = [None] * world
            if not dist:
                parts = [mine]
            elif everywhere:
                torch.distributed.all_gather_object(parts, mine)
            else:
                torch.distributed.gather_object(mine, parts if rank == 0 else None, dst=0)
            if everywhere or rank == 0:
                out.update(_put_together({n: _full_shape(p) for p, n in zip(params, group)},
                                         ((n, o, t) for part in parts for n, (o, t) in part.items())))
        return out if everywhere or rank == 0 else None

    def save(self, directory: str, rank: int) -> None:
        """This rank's fragments into <directory>/ema/rank_NNNNN.safetensors (local; the checkpoint's marker
        lists it)."""
        if self.replicated and rank:
            return
        from safetensors.torch import save_file

        os.makedirs(os.path.join(directory, DIR), exist_ok=True)
        shapes = {n: list(_full_shape(p)) for n, p in self.engine.module.named_parameters()}
        meta = {"offsets": {n: o for n, (o, _) in self.ema.items()}, "shapes": shapes, "decay": self.decay,
                "updates": self.updates}
        save_file({n: t.contiguous() for n, (_, t) in self.ema.items()},
                  os.path.join(directory, DIR, f"rank_{rank:05d}.safetensors"), metadata={"ema": json.dumps(meta)})

    def load(self, directory: str) -> bool:
        """This rank's fragments from a checkpoint saved at any world size; False (and a reset) when
        it has no EMA."""
        saved = list(_saved(os.path.join(directory, DIR)))
        if not saved:
            self.reset()
            return False
        self._watch()
        for name, (offset, t) in self.ema.items():
            filled = 0
            for meta, handle in saved:
                start = meta["offsets"].get(name)
                if start is None:
                    continue
                length = handle.get_slice(name).get_shape()[0]
                lo, hi = max(offset, start), min(offset + t.numel(), start + length)
                if lo < hi:
                    t[lo - offset:hi - offset] = handle.get_slice(name)[lo - start:hi - start]
                    filled += hi - lo
            if filled < t.numel():  # overlapping saves (replicated) fill more; less is a gap
                raise RuntimeError(f"{directory}: the saved EMA of {name} does not cover this rank's part")
        self.updates = int(saved[0][0]["updates"])
        return True


def _full_shape(p: torch.Tensor) -> torch.Size:
    return getattr(p, "ds_shape", p.shape)


def _saved(folder: str):
    """(metadata, open safetensors handle) of every rank file in a checkpoint's ema/ folder (data only)."""
    from safetensors import safe_open

    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        if name.endswith(".safetensors"):
            handle = safe_open(os.path.join(folder, name), framework="pt")
            yield json.loads(handle.metadata()["ema"]), handle


def full_ema(directory: str) -> dict[str, torch.Tensor] | None:
    """The whole EMA state dict (fp32) of a checkpoint (a path or URI), or None when it has none."""
    path = storage.join(directory, DIR)
    if not storage.exists(path):
        return None
    with storage.local_copy(path) as folder:
        saved = list(_saved(folder))
        if not saved:
            return None
        return _put_together({n: torch.Size(s) for n, s in saved[0][0]["shapes"].items()},
                             ((n, start, handle.get_tensor(n)) for meta, handle in saved
                              for n, start in meta["offsets"].items()))


def _put_together(shapes: dict[str, torch.Size], pieces) -> dict[str, torch.Tensor]:
    """{name: whole fp32 tensor of `shapes[name]`} from (name, offset in the flattened tensor, fragment)."""
    flat = {n: torch.zeros(shape.numel()) for n, shape in shapes.items()}
    for name, offset, t in pieces:
        flat[name][offset:offset + t.numel()] = t
    return {n: flat[n].view(shapes[n]) for n in flat}
