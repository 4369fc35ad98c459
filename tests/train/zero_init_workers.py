"""Module-level functions the partitioned-construction tests run on spawned gloo processes."""
import numpy as np
import torch

from vitp.config import apply_overrides
from vitp.recipes import debug


def cfg_for(variant: str, precision: str, extra=()):
    return apply_overrides(debug(), [
        f"model.variant={variant}", "parallel.zero_stage=3", f"parallel.precision={precision}",
        "parallel.num_workers=2", "parallel.micro_batch=2", "parallel.grad_accum=1",
        "parallel.global_batch=4", *extra])


def partitioned_build(rank, world, variant, precision, extra=()):
    """Build as training does under ZeRO-3; report each rank's share right after construction
    and the whole parameters (gathered) as numpy on rank 0."""
    import deepspeed

    from vitp.train.engine import param_groups
    from vitp.train.loop import build_model_and_engine

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



def partitioned_mpp_steps(rank, world, variant, extra=()):
    """Masked patch prediction on a partitioned model: build, then three optimizer steps on a fixed
    batch; the losses and the [mask] embedding (gathered) before and after, on rank 0."""
    import deepspeed

    from vitp.train.loop import build_model_and_engine
    from vitp.train.objective import objective_for
    from vitp.train.step import train_step

    cfg = cfg_for(variant, "fp32", ["train.objective=mpp", *extra])
    engine, _, _ = build_model_and_engine(cfg, world)
    mask = engine.module.mpp.mask_token
    with deepspeed.zero.GatheredParameters([mask]):
        before = mask.detach().float().numpy().copy()
    g = torch.Generator().manual_seed(rank)
    x = torch.rand(cfg.parallel.micro_batch, 3, cfg.data.image_size, cfg.data.image_size, generator=g) * 2 - 1
    objective = objective_for(cfg)
    losses = [train_step(engine, [(x, torch.zeros(len(x), dtype=torch.long))], objective=objective).loss
              for _ in range(3)]
    with deepspeed.zero.GatheredParameters([mask]):
        after = mask.detach().float().numpy().copy()
    partitioned = sorted(n for n, p in engine.module.named_parameters() if p.ds_tensor.numel() < p.ds_numel)
    return {"losses": losses, "before": before, "after": after, "partitioned": partitioned}
