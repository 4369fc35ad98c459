"""Module-level functions the AugReg engine tests run on spawned gloo ranks (vitp.train.local.launch)."""
import torch

from vitp.config import apply_overrides
from vitp.recipes import debug


def cfg_for(zero: int, world: int, extra=()):
    return apply_overrides(debug(), [
        "model.variant=mu/4", "data.image_size=16", "model.num_classes=5", f"parallel.zero_stage={zero}",
        "parallel.precision=fp32", f"parallel.num_workers={world}", "parallel.micro_batch=2",
        "parallel.grad_accum=1", f"parallel.global_batch={2 * world}", "optim.warmup_steps=2",
        "train.steps=10", *extra])


def bit16_groups(engine) -> list[list[torch.nn.Parameter]]:
    """The model's parameters in each of the optimizer's groups, whatever DeepSpeed wraps them in."""
    opt = engine.optimizer
    for attr in ("fp16_groups", "bit16_groups"):  # ZeRO-3 / ZeRO-1, 2
        if hasattr(opt, attr):
            return [list(g) for g in getattr(opt, attr)]
    return [list(g["params"]) for g in opt.param_groups]


def group_lrs_after_steps(rank, world, zero, steps, extra=()):
    """Build the engine, take `steps` optimizer steps on random images, and report each parameter's
    learning rate (its group's) by name, with the base LR the schedule gives at that step."""
    from vitp.train.engine import lr_multiplier
    from vitp.train.loop import build_model_and_engine
    from vitp.train.step import train_step

    cfg = cfg_for(zero, world, extra)
    engine, _, _ = build_model_and_engine(cfg, world)
    g = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        x = torch.randn(2, 3, 16, 16, generator=g)
        train_step(engine, [(x, torch.randint(0, 5, (2,), generator=g))])
    names = {id(p): n for n, p in engine.module.named_parameters()}
    lrs = {}
    for params, group in zip(bit16_groups(engine), engine.optimizer.param_groups):
        for p in params:
            lrs[names[id(p)]] = group["lr"]
    return {"lrs": lrs, "base": cfg.optim.lr * lr_multiplier(steps, cfg.optim, cfg.train.steps),
            "reported": engine.get_lr()[0]}


def _full_fp32(engine) -> dict:
    """Every parameter's fp32 master weights, whole (a collective under ZeRO)."""
    from deepspeed.utils import safe_get_full_fp32_param

    opt, out = engine.optimizer, {}
    unfused = {id(p): m for ps, ms in zip(getattr(opt, "fp16_groups", []), getattr(opt, "fp32_groups", []))
               for p, m in zip(ps, ms)}  # 16-bit weights without ZeRO: DeepSpeed's fp32 copies
    for name, p in engine.module.named_parameters():
        mapped = engine.zero_optimization_stage() > 0 or hasattr(p, "_hp_mapping")  # bf16 optimizer too
        full = safe_get_full_fp32_param(p) if mapped else unfused.get(id(p), p).detach()
        out[name] = full.detach().float().reshape(getattr(p, "ds_shape", p.shape)).numpy().copy()
    return out


def ema_run(rank, world, zero, steps, decay, save_dir=None, load_dir=None, precision="fp32", save_ema=True):
    """Train `steps` steps keeping a WeightEMA (resumed from `load_dir` if given, any world size),
    recording the whole fp32 weights after every step; save a checkpoint with the EMA to `save_dir`.
    Rank 0 returns the weights history and the EMA put together from the saved files."""
    import shutil
    import tempfile

    from vitp.train import checkpoint as ckpt
    from vitp.train.ema import WeightEMA, full_ema
    from vitp.train.loop import build_model_and_engine
    from vitp.train.restore import load
    from vitp.train.step import train_step

    cfg = cfg_for(zero, world, [f"parallel.precision={precision}"])
    engine, _, _ = build_model_and_engine(cfg, world)
    ema = WeightEMA(engine, decay)
    state = ckpt.TrainState()
    if load_dir:
        state = load(engine, load_dir)
        assert ema.load(load_dir)
    history = [] if load_dir else [_full_fp32(engine)]
    g = torch.Generator().manual_seed(100 * world + rank + state.step)
    for _ in range(steps):
        x = torch.randn(2, 3, 16, 16, generator=g)
        res = train_step(engine, [(x, torch.randint(0, 5, (2,), generator=g))])
        assert not res.skipped
        ema.update()
        state.step += 1
        history.append(_full_fp32(engine))
    out = save_dir or tempfile.mkdtemp(prefix=f"ema-{rank}-")
    if world > 1 and not save_dir:
        out = _broadcast(out)
    ckpt.save(engine, out, state, cfg.to_dict(), ema=ema if save_ema else None)
    whole = {k: v.numpy().copy() for k, v in full_ema(out).items()} if rank == 0 and save_ema else None
    gathered = ema.whole(everywhere=False)  # what the few-shot probes get (rank 0), a collective
    everywhere = ema.whole()  # what an evaluation builds its model from, on every rank
    same = all(torch.equal(everywhere[k], v) for k, v in (gathered or everywhere).items())
    if not save_dir:  # a directory of our own: gone once every rank is done with it
        if world > 1:
            torch.distributed.barrier()
        if rank == 0:
            shutil.rmtree(out)
    return {"history": history if rank == 0 else None, "ema": whole, "updates": ema.updates,
            "gathered": {k: v.numpy().copy() for k, v in gathered.items()} if rank == 0 else gathered,
            "same": same}


def _broadcast(obj):
    holder = [obj]
    torch.distributed.broadcast_object_list(holder, src=0)
    return holder[0]
