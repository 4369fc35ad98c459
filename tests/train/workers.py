"""Module-level functions the engine tests run on spawned gloo processes (no Ray)."""
import os

import torch

from vitp.config import ExperimentConfig, apply_overrides
from vitp.recipes import debug
from vitp.config import Run


def learnable_batches(cfg: ExperimentConfig, rank: int, world: int, steps: int, seed: int = 0):
    """A learnable stream: class k images have a bright k-th horizontal band. Rank r takes
    slice r of every global batch, so every world size sees the same global batches."""
    g = torch.Generator().manual_seed(seed)
    p, S, K = cfg.parallel, cfg.data.image_size, cfg.model.num_classes
    for _ in range(steps * p.grad_accum):
        B = p.micro_batch * world
        y = torch.randint(0, K, (B,), generator=g)
        x = torch.randn(B, 3, S, S, generator=g) * 0.3
        band = S // K if S >= K else 1
        for i, k in enumerate(y.tolist()):
            x[i, :, (k * band) % S:(k * band) % S + band, :] += 2.0
        sl = slice(rank * p.micro_batch, (rank + 1) * p.micro_batch)
        yield x[sl], y[sl]


def cfg_for(stage: int, world: int, steps: int, extra=()) -> ExperimentConfig:
    return apply_overrides(debug(), [
        f"parallel.zero_stage={stage}", f"parallel.num_workers={world}", "parallel.micro_batch=8",
        "parallel.grad_accum=2", f"parallel.global_batch={8 * 2 * world}", f"train.steps={steps}",
        "train.log_every=1", "optim.warmup_steps=2", "optim.lr=0.002", *extra])


def curves_per_stage(rank, world, stages, steps):
    """Loss curve of each ZeRO stage on identical data and seed."""
    from vitp.train import checkpoint as ckpt
    from vitp.train.loop import LoopHooks, build_model_and_engine, run_loop

    out = {}
    for stage in stages:
        cfg = cfg_for(stage, world, steps)
        engine, _, _ = build_model_and_engine(cfg, world)
        res = run_loop(cfg, engine, learnable_batches(cfg, rank, world, steps), ckpt.TrainState(),
                       LoopHooks(), rank, world)
        out[stage] = [h["train/loss"] for h in res.history]
        out[f"{stage}/grad_norm"] = [h["train/grad_norm"] for h in res.history]
    return out


def train_save_export(rank, world, stage, steps, ckpt_dir, export_dir, extra=()):
    """Train, checkpoint at the end, export on rank 0; return the engine's logits on a probe."""
    from vitp.train import checkpoint as ckpt
    from vitp.train.export import export
    from vitp.train.loop import LoopHooks, build_model_and_engine, run_loop

    cfg = cfg_for(stage, world, steps, extra)
    engine, _, _ = build_model_and_engine(cfg, world)

    def on_checkpoint(step, state, metrics):
        ckpt.save(engine, ckpt_dir, state, cfg.to_dict())

    run_loop(cfg, engine, learnable_batches(cfg, rank, world, steps), ckpt.TrainState(),
             LoopHooks(on_checkpoint=on_checkpoint), rank, world)
    torch.distributed.barrier()
    if rank == 0:
        export(ckpt_dir, export_dir)
    probe = torch.Generator().manual_seed(123)
    x = torch.randn(4, 3, cfg.data.image_size, cfg.data.image_size, generator=probe)
    engine.eval()
    with torch.no_grad():
        logits = engine(x)  # ZeRO-3 gathers the partitioned params for the forward
    return logits.numpy()  # tensors would travel as shared memory that dies with the process


def resume_run(rank, world, stage, steps, split_at, ckpt_dir):
    """Uninterrupted curve vs. (train to split_at, checkpoint, fresh engine, load, continue)."""
    from vitp.train import checkpoint as ckpt
    from vitp.train import restore
    from vitp.train.loop import LoopHooks, build_model_and_engine, run_loop

    cfg = cfg_for(stage, world, steps)
    engine, _, _ = build_model_and_engine(cfg, world)
    full = run_loop(cfg, engine, learnable_batches(cfg, rank, world, steps), ckpt.TrainState(),
                    LoopHooks(), rank, world)
    full_curve = [h["train/loss"] for h in full.history]

    # first part: stop at split_at with a checkpoint
    part_cfg = cfg_for(stage, world, steps, extra=[f"train.checkpoint_every={split_at}"])
    engine, _, _ = build_model_and_engine(part_cfg, world)
    saved = {}

    class Stop(Exception):
        pass

    def on_checkpoint(step, state, metrics):
        if step == split_at:
            ckpt.save(engine, ckpt_dir, state, part_cfg.to_dict())
            saved["state"] = state
            raise Stop()

    first = []
    try:
        run_loop(part_cfg, engine, learnable_batches(part_cfg, rank, world, steps), ckpt.TrainState(),
                 LoopHooks(on_log=lambda s, m, checkpoint_due: first.append(m["train/loss"]),
                           on_checkpoint=on_checkpoint),
                 rank, world)
    except Stop:
        pass
    # second part: new engine with different init, restore, skip consumed batches, continue
    torch.manual_seed(999)
    engine, _, _ = build_model_and_engine(part_cfg, world)
    state = restore.load(engine, ckpt_dir)
    restored_step = state.step
    stream = learnable_batches(part_cfg, rank, world, steps)
    for _ in range(state.step * part_cfg.parallel.grad_accum):
        next(stream)
    second = run_loop(part_cfg, engine, stream, state, LoopHooks(), rank, world)
    return {"full": full_curve, "resumed": first + [h["train/loss"] for h in second.history],
            "step": restored_step, "lr_after": engine.get_lr()[0]}


def port_taken_on_first_try(rank, world, marker_dir):
    """First launch: another socket holds the rendezvous port when rank 0 binds its store (a real
    EADDRINUSE from gloo's TCPStore); rank 1 sits that attempt out. Then a real all-reduce."""
    import socket

    import torch.distributed as dist

    marker = os.path.join(marker_dir, f"rank{rank}")
    if not os.path.exists(marker):
        open(marker, "w").close()
        if rank == 1:
            return None
        with socket.socket() as squatter:
            squatter.bind(("127.0.0.1", int(os.environ["MASTER_PORT"])))
            squatter.listen()
            dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world)
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world)
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    dist.destroy_process_group()
    return t.item()


def loss_curve(rank, world, steps, extra=()):
    """Train `steps` on the learnable stream at ZeRO-2; the per-step losses and the train time."""
    import time

    from vitp.train import checkpoint as ckpt
    from vitp.train.loop import LoopHooks, build_model_and_engine, run_loop

    cfg = cfg_for(2, world, steps, extra)
    engine, _, _ = build_model_and_engine(cfg, world)
    t0 = time.perf_counter()
    res = run_loop(cfg, engine, learnable_batches(cfg, rank, world, steps), ckpt.TrainState(), LoopHooks(), rank, world)
    return {"loss": [h["train/loss"] for h in res.history], "seconds": time.perf_counter() - t0,
            "compiled": bool(getattr(engine, "is_compiled", False))}


def launch_context(rank, world, tag):
    """What a launched rank sees: the launcher's environment and cwd at launch time, its stdout."""
    import tempfile

    print(f"rank {rank} of {world} says {tag}", flush=True)
    return {"tag": os.environ.get("VITP_TEST_TAG"), "tmp": tempfile.gettempdir(), "cwd": os.getcwd(),
            "rank": int(os.environ["RANK"]), "world": int(os.environ["WORLD_SIZE"])}


def load_into_engine(rank, world, stage, ckpt_dirs):
    """Build the engine `cfg_for(stage, ...)` describes and restore each of `ckpt_dirs` into it
    in turn, as a resuming Train worker does; for each, the step restored or the error's type
    and message."""
    from vitp.train import restore
    from vitp.train.loop import build_model_and_engine

    engine, _, _ = build_model_and_engine(cfg_for(stage, world, 2), world)
    out = []
    for d in ckpt_dirs:
        try:
            out.append(restore.load(engine, d).step)
        except Exception as e:  # noqa: BLE001 - the test asserts on it
            out.append(f"{type(e).__name__}: {e}")
    return out


def exploit_run(rank, world, stage, work):
    """PBT's exploit on real engines: run a (lr 0.002, wd 0.05) and run b (lr 0.01, wd 0.2, beta2
    0.99) each train 4 steps with checkpoints at 2 and 4; a's checkpoint 2 is adopted into b's run,
    loaded into a fresh engine of b's config and its hyperparameters set by follow_config."""
    from vitp.train import checkpoint as ckpt
    from vitp.train import restore
    from vitp.train.engine import follow_config
    from vitp.train.loop import LoopHooks, build_model_and_engine, run_loop

    def train(name, extra):
        cfg = cfg_for(stage, world, 4, [f"work_dir={work}", f"tracking.run_name={name}", "train.checkpoint_every=2",
                                        *extra])
        engine, _, _ = build_model_and_engine(cfg, world)

        def on_checkpoint(step, state, metrics):
            ckpt.save(engine, os.path.join(Run.of(cfg).dir, ckpt.checkpoint_dir_name(step)), state,
                      cfg.to_dict(), mlflow_run_id=f"mlflow-{name}")

        run_loop(cfg, engine, learnable_batches(cfg, rank, world, 4), ckpt.TrainState(),
                 LoopHooks(on_checkpoint=on_checkpoint), rank, world)
        return cfg

    a = train("a", ["optim.lr=0.002", "optim.weight_decay=0.05"])
    b = train("b", ["optim.lr=0.01", "optim.weight_decay=0.2", "optim.beta2=0.99"])
    torch.distributed.barrier()
    donor = os.path.join(Run.of(a).dir, ckpt.checkpoint_dir_name(2))
    if rank == 0:
        ckpt.adopt(donor, Run.of(b))
    torch.distributed.barrier()
    copy = ckpt.latest_complete_checkpoint(Run.of(b))
    engine, _, _ = build_model_and_engine(b, world)
    state = restore.load(engine, copy)
    restored_step = state.step
    groups = engine.optimizer.param_groups
    loaded = {"lr": [g["lr"] for g in groups], "wd": [g["weight_decay"] for g in groups]}
    follow_config(engine, b)
    followed = {"lr": [g["lr"] for g in groups], "wd": [g["weight_decay"] for g in groups],
                "betas": [list(g["betas"]) for g in groups], "base_lrs": list(engine.lr_scheduler.base_lrs)}
    stream = learnable_batches(b, rank, world, 4)
    for _ in range(state.step * b.parallel.grad_accum):
        next(stream)
    run_loop(b, engine, stream, state, LoopHooks(), rank, world)
    return {"copy": copy, "donor": donor, "step": restored_step, "loaded": loaded, "followed": followed,
            "lr_at_end": engine.get_lr()[0], "left": sorted(os.listdir(Run.of(b).dir))}
