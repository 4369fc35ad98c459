"""Functions the non-finite and precision/offload tests run on spawned gloo processes (no Ray)."""
import torch

from workers import cfg_for, learnable_batches

# --------------------------------------------------------------------------- non-finite, precision


def weights_and_optimizer(engine) -> dict:
    """Copies of all an update touches: this rank's weights (ZeRO-3: its partition), the client
    optimizer's state keys (the fp32 masters under every DeepSpeed wrapper) and state, and its
    group scalars (DeepSpeedCPUAdam counts steps there)."""
    opt = engine.basic_optimizer
    out = {f"w{i}": getattr(p, "ds_tensor", p).detach().clone() for i, p in enumerate(engine.module.parameters())}
    for i, (master, state) in enumerate(opt.state.items()):
        out[f"m{i}"] = master.detach().clone()
        out.update({f"s{i}.{k}": v.detach().clone() if torch.is_tensor(v) else v for k, v in state.items()})
    for g, group in enumerate(opt.param_groups):
        out.update({f"g{g}.{k}": v for k, v in group.items() if not isinstance(v, (list, tuple))})
    return out


def changed(a: dict, b: dict) -> list[str]:
    """Keys whose values differ (tensors: dtype, shape and every element exactly)."""
    def equal(x, y):
        if torch.is_tensor(x):
            return torch.is_tensor(y) and x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
        return x == y

    return sorted(k for k in a.keys() | b.keys() if k not in a or k not in b or not equal(a[k], b[k]))


def held_bytes(engine) -> int:
    """Bytes of the distinct tensor storages the engine keeps between steps: the module's weights
    and gradients, every tensor the DeepSpeed wrapper holds (flat masters, gradient buffers) and
    the client optimizer's state."""
    storages = {}

    def walk(obj, depth=0):
        if torch.is_tensor(obj):
            if obj.numel():
                storages[obj.untyped_storage().data_ptr()] = obj.untyped_storage().nbytes()
        elif depth < 3 and isinstance(obj, (list, tuple)):
            for x in obj:
                walk(x, depth + 1)
        elif depth < 3 and isinstance(obj, dict):
            for x in obj.values():
                walk(x, depth + 1)

    for p in engine.module.parameters():
        walk([p, p.grad])
    walk(vars(engine.optimizer))
    walk(list(engine.basic_optimizer.state.values()))
    return sum(storages.values())


def train_and_inspect(rank, world, stage, steps, extra=(), snap_at=()):
    """run_loop with `extra` overrides. Returns the history, the LR scheduler's step count at each
    step, what changed from step s-1 to s for s in `snap_at`, and where/how the state is kept."""
    from vitp.train import checkpoint as ckpt
    from vitp.train.loop import LoopHooks, build_model_and_engine, run_loop

    cfg = cfg_for(stage, world, steps, extra)
    engine, _, scheduler = build_model_and_engine(cfg, world)
    snaps, sched = {}, {}

    def on_log(step, metrics, checkpoint_due):
        sched[step] = scheduler.last_epoch
        if step + 1 in snap_at or step in snap_at:
            snaps[step] = weights_and_optimizer(engine)

    res = run_loop(cfg, engine, learnable_batches(cfg, rank, world, steps), ckpt.TrainState(),
                   LoopHooks(on_log=on_log), rank, world)
    opt, state = engine.basic_optimizer, weights_and_optimizer(engine)
    return {"history": res.history, "scheduler_steps": sched, "ds_skipped": engine.skipped_steps,
            "changed": {s: changed(snaps[s - 1], snaps[s]) for s in snap_at},
            "step": res.state.step, "samples_seen": res.state.samples_seen,
            "param_dtypes": sorted({str(p.dtype) for p in engine.module.parameters()}),
            "master_dtypes": sorted({str(v.dtype) for k, v in state.items() if k.startswith("m")}),
            "state_dtypes": sorted({str(v.dtype) for k, v in state.items() if k.startswith("s") and torch.is_tensor(v) and v.dim()}),
            "state_devices": sorted({v.device.type for k, v in state.items() if k[0] in "ms" and torch.is_tensor(v)}),
            "optimizer": type(opt).__name__, "wrapper": type(engine.optimizer).__name__,
            "params": sum(p.numel() for p in engine.module.parameters()), "held_bytes": held_bytes(engine),
            # what the ZeRO wrapper did (ZeRO-1/2: cpu_offload; ZeRO-3: offload_optimizer/param)
            "offload": (bool(getattr(engine.optimizer, "cpu_offload", False)
                             or getattr(engine.optimizer, "offload_optimizer", False)),
                        bool(getattr(engine.optimizer, "offload_param", False)))}


def persistent_nan(rank, world, stage, precision, ckpt_dir):
    """nan_drill from step 4, a checkpoint at step 2, patience 3: one rollback, then a stop. And
    the same with nothing to restore. Returns what each run saw and the error it stopped with."""
    from vitp.train import checkpoint as ckpt
    from vitp.train.loop import LoopHooks, build_model_and_engine, run_loop
    from vitp.train.restore import load as load_checkpoint

    out = {}
    for name in ("with_checkpoint", "nothing_to_restore"):
        cfg = cfg_for(stage, world, 12, [f"parallel.precision={precision}", "train.nan_drill=4-12",
                                         "train.nonfinite_patience=3", "train.checkpoint_every=2"])
        engine, _, _ = build_model_and_engine(cfg, world)
        seen, snaps, state = {"restores": 0, "logged": [], "error": None}, {}, ckpt.TrainState()

        def on_checkpoint(step, state, metrics):
            if step == 2:
                ckpt.save(engine, ckpt_dir, state, cfg.to_dict())
                snaps["checkpoint"] = weights_and_optimizer(engine)

        def restore():
            seen["restores"] += 1
            snaps["before"] = weights_and_optimizer(engine)
            if name == "nothing_to_restore":
                return None
            step = load_checkpoint(engine, ckpt_dir).step
            seen["restored_differs"] = changed(snaps["checkpoint"], weights_and_optimizer(engine))
            seen["moved_since_checkpoint"] = bool(changed(snaps["checkpoint"], snaps["before"]))
            return step

        def on_log(step, m, due):
            seen["logged"].append((step, m["train/skipped_steps"], m["train/rollbacks"]))

        try:
            run_loop(cfg, engine, learnable_batches(cfg, rank, world, 12), state,
                     LoopHooks(on_log=on_log, on_checkpoint=on_checkpoint, restore=restore), rank, world)
        except RuntimeError as e:
            seen["error"] = str(e)
        out[name] = {**seen, "step": state.step}
    return out


def inf_loss_on_one_rank(rank, world, combos):
    """For each (stage, precision, extra overrides): step 2's loss is +inf on the last rank only,
    with finite gradients (its target logit masked to -inf), so DeepSpeed sees nothing wrong and
    only our all-reduced flag can skip the step. Returns per combo what changed and a checksum."""
    import torch.nn.functional as F

    from vitp.train.loop import build_model_and_engine
    from vitp.train.step import group, train_step

    out = {}
    for stage, precision, extra in combos:
        cfg = cfg_for(stage, world, 3, [f"parallel.precision={precision}", *extra])
        engine, _, _ = build_model_and_engine(cfg, world)
        labels, poison = {}, {"on": False}

        def mask_target(module, inputs, logits):  # (B, K): -inf at the target class -> loss +inf
            if not poison["on"]:
                return logits
            return logits.masked_fill(F.one_hot(labels["y"], logits.shape[-1]).bool(), float("-inf"))

        def stream():
            for x, y in learnable_batches(cfg, rank, world, 3):
                labels["y"] = y
                yield x, y

        engine.module.register_forward_hook(mask_target)
        steps = group(stream(), cfg.parallel.grad_accum)
        train_step(engine, next(steps))
        before = weights_and_optimizer(engine)
        poison["on"] = rank == world - 1
        res = train_step(engine, next(steps))
        poison["on"] = False
        after = weights_and_optimizer(engine)
        out[(stage, precision, tuple(extra))] = {
            "skipped": res.skipped, "loss": res.loss, "changed": changed(before, after),
            "checksum": sum(float(v.double().sum()) for k, v in after.items() if k.startswith("w")),
            "next_skipped": train_step(engine, next(steps)).skipped}
    return out


def resume_with(rank, world, stage, steps, split_at, ckpt_dir, extra):
    """resume_run for any overrides (offload): one run saves at split_at and goes on; a fresh
    engine loads that checkpoint and continues on the same data. Both loss curves come back."""
    from vitp.train import checkpoint as ckpt
    from vitp.train.loop import LoopHooks, build_model_and_engine, run_loop
    from vitp.train.restore import load as load_checkpoint

    cfg = cfg_for(stage, world, steps, extra)
    engine, _, _ = build_model_and_engine(cfg, world)

    def on_checkpoint(step, state, metrics):
        if step == split_at:
            ckpt.save(engine, ckpt_dir, state, cfg.to_dict())

    full = run_loop(cfg, engine, learnable_batches(cfg, rank, world, steps), ckpt.TrainState(),
                    LoopHooks(on_checkpoint=on_checkpoint, checkpoint_now=lambda s: s == split_at),
                    rank, world).history
    torch.manual_seed(999)  # a different init: everything must come from the checkpoint
    engine, _, _ = build_model_and_engine(cfg, world)
    state = load_checkpoint(engine, ckpt_dir)
    restored_step, stream = state.step, learnable_batches(cfg, rank, world, steps)
    for _ in range(state.step * cfg.parallel.grad_accum):
        next(stream)
    resumed = run_loop(cfg, engine, stream, state, LoopHooks(), rank, world).history
    return {"full": [h["train/loss"] for h in full], "step": restored_step,
            "resumed": [h["train/loss"] for h in resumed], "optimizer": type(engine.basic_optimizer).__name__}
