"""Functions the resize tests run on spawned gloo processes (no Ray): another world size."""
import dataclasses

import torch

from vitp.config import ExperimentConfig
from workers import cfg_for

# --------------------------------------------------------------------------- resize (another world)


def global_batches(cfg: ExperimentConfig, rank: int, world: int, steps: int, start: int = 0, seed: int = 0):
    """Learnable micro-batches from step `start` on whose global batches are the same at every
    world size: step s draws its global_batch images from a generator seeded by (seed, s); its
    grad_accum x world micro-batches are cut in order and rank r takes every world-th one."""
    p, S, K = cfg.parallel, cfg.data.image_size, cfg.model.num_classes
    band = S // K if S >= K else 1
    for step in range(start, steps):
        g = torch.Generator().manual_seed(seed * 100_003 + step)
        y = torch.randint(0, K, (p.global_batch,), generator=g)
        x = torch.randn(p.global_batch, 3, S, S, generator=g) * 0.3
        for i, k in enumerate(y.tolist()):
            x[i, :, (k * band) % S:(k * band) % S + band, :] += 2.0
        for a in range(p.grad_accum):
            lo = (a * world + rank) * p.micro_batch
            yield x[lo:lo + p.micro_batch], y[lo:lo + p.micro_batch]


def full_optimizer_state(engine) -> dict[str, dict]:
    """Collective: every parameter's full (unpartitioned) fp32 master weight and Adam moments, by
    name, as numpy. Stage 0 keeps them whole; ZeRO-3 gathers with DeepSpeed's safe_get_full_*.
    ZeRO-1/2 are gathered here from each rank's flat partition: DeepSpeed 0.19.8 links the
    moments of a second param group only lazily after its first step, too late for
    safe_get_full_optimizer_state (it raises "exp_avg not found" for the no-decay group). bf16 at
    ZeRO-1 runs DeepSpeed's BF16 optimizer, whose flat partitions have another name."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    stage, opt = engine.zero_optimization_stage(), engine.optimizer
    out = {}
    for name, p in engine.module.named_parameters():
        if stage == 0:
            st = engine.basic_optimizer.state[p]
            vals = {"fp32": p.data, "exp_avg": st["exp_avg"], "exp_avg_sq": st["exp_avg_sq"]}
        elif stage == 3:
            vals = {"fp32": safe_get_full_fp32_param(p),
                    **{k: safe_get_full_optimizer_state(p, k) for k in ("exp_avg", "exp_avg_sq")}}
        else:
            vals = {}
            for key in ("fp32", "exp_avg", "exp_avg_sq"):
                buf = torch.zeros(p.numel())
                m = p._hp_mapping  # None: none of p lies in this rank's partition
                if m is not None:
                    flats = getattr(opt, "single_partition_of_fp32_groups", None) or opt.fp32_groups_flat_partition
                    flat = flats[m.param_group_index]
                    flat = flat if key == "fp32" else opt.optimizer.state[flat][key]
                    lp, hp = m.lp_fragment_address, m.hp_fragment_address
                    buf.narrow(0, lp.start, lp.numel).copy_(flat.narrow(0, hp.start, hp.numel))
                torch.distributed.all_reduce(buf, group=p._dp_group)
                vals[key] = buf.view_as(p)
        out[name] = {k: v.detach().float().clone().numpy() for k, v in vals.items()}
    return out


def param_group_settings(engine) -> list[dict]:
    """Each optimizer param group's hyperparameters (lr, weight_decay, betas, ...), in order."""
    return [{k: v for k, v in g.items() if k != "params"} for g in engine.optimizer.param_groups]


def resize_leg(rank, world, stage, steps, until, load_dir=None, save_dir=None, universal=False,
               with_full=False, extra=()):
    """One leg of a run whose world size changes: the 2-worker recipe of cfg_for(stage, 2,
    steps) re-derived for `world` (for_world), restored from `load_dir`, trained on
    global_batches to step `until`, saved into `save_dir`. `with_full`: first an uninterrupted
    run to `steps` on the same batches. Rank 0 returns curves, LRs and full optimizer states."""
    from vitp.config.validate import for_world
    from vitp.model.vit import build_vit
    from vitp.train import checkpoint as ckpt
    from vitp.train import restore
    from vitp.train.engine import build_engine
    from vitp.train.loop import LoopHooks, build_model_and_engine, run_loop, seed_everything

    cfg = for_world(cfg_for(stage, 2, steps, extra), world)
    out = {"micro_batch": cfg.parallel.micro_batch, "grad_accum": cfg.parallel.grad_accum}
    if with_full:
        engine, _, _ = build_model_and_engine(cfg, world)
        res = run_loop(cfg, engine, global_batches(cfg, rank, world, steps), ckpt.TrainState(),
                       LoopHooks(), rank, world)
        out["full"] = [h["train/loss"] for h in res.history]
        out["full_lr"] = [h["train/lr"] for h in res.history]
    # a leg that restores starts from another init: the restore must overwrite every weight
    seed = 1000 + world if load_dir else cfg.train.seed
    if universal:
        seed_everything(seed)
        engine, _, _ = build_engine(build_vit(cfg.model, cfg.data.image_size), cfg, world, universal=True)
    else:
        seeded = cfg.replace(train=dataclasses.replace(cfg.train, seed=seed))
        engine, _, _ = build_model_and_engine(seeded, world)
    state = ckpt.TrainState()
    if load_dir:
        state = restore.load(engine, load_dir)
        out["restored_step"], out["restored_lr"] = state.step, engine.get_lr()[0]
        out["restored_global_steps"] = engine.global_steps
        out["state_at_load"] = full_optimizer_state(engine)
        out["groups_at_load"] = param_group_settings(engine)

    class Stop(Exception):
        pass

    def on_checkpoint(step, st, metrics):
        if step == until:
            ckpt.save(engine, save_dir, st, cfg.to_dict())
            out["saved_lr"] = engine.get_lr()[0]
            out["state_at_save"] = full_optimizer_state(engine)
            out["groups_at_save"] = param_group_settings(engine)
            out["adam_steps_at_save"] = [float(st["step"]) for st in engine.basic_optimizer.state.values()]
            raise Stop()

    hooks = LoopHooks(on_checkpoint=on_checkpoint if save_dir else None,
                      checkpoint_now=lambda s: s == until)
    curve, lrs = [], []
    hooks.on_log = lambda s, m, due: (curve.append(m["train/loss"]), lrs.append(m["train/lr"]))
    try:
        run_loop(cfg, engine, global_batches(cfg, rank, world, steps, start=state.step), state, hooks,
                 rank, world)
    except Stop:
        pass
    out["curve"], out["lr"], out["end_step"] = curve, lrs, state.step
    return out if rank == 0 else None
