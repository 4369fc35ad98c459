"""Module-level functions the partitioned-construction tests run on spawned gloo processes."""
import numpy as np
import torch

from pipeline.config import apply_overrides
from pipeline.recipes import debug


def cfg_for(variant: str, precision: str, extra=()):
    return apply_overrides(debug(), [
        f"model.variant={variant}", "parallel.zero_stage=3", f"parallel.precision={precision}",
        "parallel.num_workers=2", "parallel.micro_batch=2", "parallel.grad_accum=1",
        "parallel.global_batch=4", *extra])


def partitioned_build(rank, world, variant, precision, extra=()):
    """Build as training does under ZeRO-3; report each rank's share right after construction
    and the whole parameters (gathered) as numpy on rank 0."""
    import deepspeed

    from pipeline.train.engine import param_groups
    from pipeline.train.loop import build_model_and_engine

    cfg = cfg_for(variant, precision, extra)
    engine, _, _ = build_model_and_engine(cfg, world)
    shares = {n: (int(p.ds_tensor.numel()), int(p.ds_numel)) for n, p in engine.module.named_parameters()}
    full = {}
    for name, p in engine.module.named_parameters():
        with deepspeed.zero.GatheredParameters([p]):
            full[name] = p.detach().float().numpy().copy()
    names = {id(p): n for n, p in engine.module.named_parameters()}
    decay = sorted(names[id(p)] for p in param_groups(engine.module, 0.1)[0]["params"])
    return {"shares": shares, "full": full if rank == 0 else None, "decay": decay}

