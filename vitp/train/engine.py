"""DeepSpeed engine built from our config: the one place the DeepSpeed config dict is made.

Owns optimizer parameter groups (weight decay, layer-wise LR decay), the LR schedule, the ZeRO / precision / offload settings and
process-group set-up. Plain torch + DeepSpeed, no Ray: a GPU benchmark or a debug run builds the
same engine as a Ray Train worker does.
"""
from __future__ import annotations

import contextlib
import ctypes
import math
import os
import sys
from typing import Any, Callable, Iterator

import torch

from ..config import ExperimentConfig, OptimConfig
from ..console import name_cpu_accelerator
from ..model import memory
from ..model.vit import full_shape
from ..net import free_port

# DeepSpeed JIT-builds its CPU ops (Adam for offload, shared-memory collectives) where torch keeps
# extensions. `make install` builds them into the venv (.venv/torch-extensions): every process of
# that venv (CLI, Ray workers, tests) uses them from there unless TORCH_EXTENSIONS_DIR says otherwise.
_VENV_EXTENSIONS = os.path.join(sys.prefix, "torch-extensions")
if os.path.isdir(_VENV_EXTENSIONS):
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", _VENV_EXTENSIONS)
# ... by the venv's ninja (pip's, which torch runs as plain `ninja` from PATH), whatever PATH this
# process got: a system ninja of another version hashes the build commands differently, so each
# would rebuild what the other built (about a minute of both cores per flip).
_VENV_BIN = os.path.join(sys.prefix, "bin")
if os.path.isfile(os.path.join(_VENV_BIN, "ninja")) and os.environ.get("PATH", "").split(os.pathsep)[0] != _VENV_BIN:
    os.environ["PATH"] = os.pathsep.join([_VENV_BIN, os.environ.get("PATH", "")])


def import_deepspeed():
    """`import deepspeed`, without the MLflow import DeepSpeed's autotuner makes for its own
    (unused here) logging: every Train rank paid 1-5 CPU-s for it at start-up, and only rank 0
    logs (vitp.tracking imports MLflow there itself). The autotuner catches the ImportError that a
    None in sys.modules gives; the entry is gone again once DeepSpeed is imported."""
    block = "deepspeed" not in sys.modules and "mlflow" not in sys.modules
    if block:
        sys.modules["mlflow"] = None  # type: ignore[assignment]
    try:
        import deepspeed  # lazy: deepspeed (slow import; build_ds_config needs none)
    finally:
        if block:
            del sys.modules["mlflow"]
    return deepspeed


# --------------------------------------------------------------------------- DeepSpeed config


def build_ds_config(cfg: ExperimentConfig, world_size: int | None = None,
                    universal: bool = False) -> dict[str, Any]:
    """The DeepSpeed config for `cfg`; the batch triangle is checked against the real world size.

    `universal`: `load_checkpoint` reads DeepSpeed's universal layout (restore.to_universal);
    saving and training are unchanged."""
    p = cfg.parallel
    world = world_size if world_size is not None else p.num_workers
    if p.micro_batch * p.grad_accum * world != p.global_batch:
        raise ValueError(
            f"global batch {p.global_batch} != micro {p.micro_batch} x accum {p.grad_accum} x "
            f"world {world} = {p.micro_batch * p.grad_accum * world}: set parallel.num_workers={world} "
            "to match the running world, or adjust parallel.grad_accum / parallel.global_batch"
        )
    zero: dict[str, Any] = {"stage": p.zero_stage}
    if p.zero_stage >= 1:
        # Overlap the reduce with backward where DeepSpeed can; bucket sizes suit ViT layers.
        zero.update(reduce_bucket_size=memory.REDUCE_BUCKET, allgather_bucket_size=memory.ALLGATHER_BUCKET,
                    overlap_comm=p.use_gpu, contiguous_gradients=True)
    if p.zero_stage == 3:
        # sub_group_size bounds the fp32 gradients and Adam temporaries of the step (DeepSpeed's
        # default, 1e9, makes them as large as a rank's whole partition below 1e9 parameters)
        zero.update(stage3_param_persistence_threshold=memory.PERSISTENCE_THRESHOLD,
                    stage3_prefetch_bucket_size=memory.PREFETCH_BUCKET, sub_group_size=memory.SUB_GROUP,
                    stage3_max_live_parameters=memory.MAX_LIVE, stage3_max_reuse_distance=memory.MAX_REUSE)
    if p.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": p.use_gpu}
    if p.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": p.use_gpu}
    config = {
        "train_batch_size": p.global_batch,
        "train_micro_batch_size_per_gpu": p.micro_batch,
        "gradient_accumulation_steps": p.grad_accum,
        "gradient_clipping": cfg.optim.grad_clip,
        "zero_optimization": zero,
        "bf16": {"enabled": p.precision == "bf16"},
        "fp16": {"enabled": p.precision == "fp16", "loss_scale": 0, "initial_scale_power": 16},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,  # our own progress line replaces DeepSpeed's
        "wall_clock_breakdown": False,
        "seed": cfg.train.seed,
        "checkpoint": {"load_universal": universal},
    }
    if memory.flat_bf16_optimizer(p.precision, p.zero_stage, p.offload_optimizer):
        # fp32 gradient accumulation selects DeepSpeed's BF16 optimizer (flat fp32 buffers): on
        # one H200 it trained ViT-H/14 1.7x faster than the general ZeRO-1 optimizer
        # (benchmarks/RESULTS.md, "Training step (GPU)"); it also accumulates micro-batches in fp32.
        config["data_types"] = {"grad_accum_dtype": "fp32"}
    return config


# --------------------------------------------------------------------------- optimizer + LR


def param_groups(model: torch.nn.Module, weight_decay: float, lr: float = 0.0, layer_decay: float = 1.0,
                 head_lr_mult: float = 1.0) -> list[dict[str, Any]]:
    """Decay matrices only: biases, norms, position embedding and class token get no decay. With
    layer-wise LR decay or a head multiplier, one group per (LR scale, decay) pair, its "lr" lr x scale
    (lr_scales); the first group is the one at scale 1, whose LR the progress line reports."""
    skip = model.no_weight_decay() if hasattr(model, "no_weight_decay") else set()
    scales = lr_scales(model, layer_decay, head_lr_mult) if (layer_decay != 1 or head_lr_mult != 1) else {}
    groups: dict[tuple[float, bool], list[torch.nn.Parameter]] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        decays = not (name in skip or len(full_shape(p)) <= 1)  # the full shape: ZeRO-3 flattens partitions
        groups.setdefault((scales.get(name, 1.0), decays), []).append(p)
    if not scales:
        return [{"params": groups.get((1.0, True), []), "weight_decay": weight_decay},
                {"params": groups.get((1.0, False), []), "weight_decay": 0.0}]
    order = sorted(groups, key=lambda k: (k[0] != 1.0, -k[0], not k[1]))  # scale 1 first, then by scale
    return [{"params": groups[k], "weight_decay": weight_decay if k[1] else 0.0, "lr": lr * k[0], "lr_scale": k[0]}
            for k in order]


def lr_scales(model: torch.nn.Module, layer_decay: float, head_lr_mult: float = 1.0) -> dict[str, float]:
    """Each parameter's LR scale: layer_decay^(L + 1 - layer) with the embedding (patch embedding, class
    token, position embedding) layer 0, block i layer i + 1, everything after the blocks layer L + 1
    (BEiT's and MAE's rule); the head and pre-logits times head_lr_mult."""
    depth = len(model.blocks)
    out = {}
    for name, _ in model.named_parameters():
        if name.startswith(("patch_embed.", "cls_token", "pos_embed", "mpp.mask_token")):
            layer = 0
        elif name.startswith("blocks."):
            layer = int(name.split(".")[1]) + 1
        else:
            layer = depth + 1
        mult = head_lr_mult if name.startswith(("head.", "pre_logits.")) else 1.0
        out[name] = layer_decay ** (depth + 1 - layer) * mult
    return out


def build_optimizer(model: torch.nn.Module, cfg: ExperimentConfig) -> torch.optim.Optimizer:
    o, p = cfg.optim, cfg.parallel
    groups = param_groups(model, o.weight_decay, o.lr, o.layer_decay, o.head_lr_mult)
    if o.name == "sgd":
        return torch.optim.SGD(groups, lr=o.lr, momentum=o.momentum)
    if p.offload_optimizer:
        # ZeRO-Offload steps the optimizer on the CPU with DeepSpeed's vectorised Adam.
        from deepspeed.ops.adam import DeepSpeedCPUAdam  # lazy: deepspeed (slow import)

        load_ops("CPUAdamBuilder")

        return DeepSpeedCPUAdam(groups, lr=o.lr, betas=(o.beta1, o.beta2), adamw_mode=True)
    # fused: one kernel per tensor, no full-size temporaries (on a ZeRO partition they are the
    # size of the partition); CUDA and CPU both have it
    return torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=1e-8, fused=True)


def lr_multiplier(step: int, o: OptimConfig, total_steps: int) -> float:
    """LR / peak LR after `step` optimizer steps: linear warm-up, then linear/cosine decay."""
    if o.warmup_steps and step < o.warmup_steps:
        return (step + 1) / o.warmup_steps
    if o.schedule == "constant":
        return 1.0
    span = max(1, total_steps - o.warmup_steps)
    frac = min(1.0, (step - o.warmup_steps) / span)
    if o.schedule == "linear":
        decay = 1.0 - frac
    else:  # cosine
        decay = 0.5 * (1.0 + math.cos(math.pi * frac))
    return o.min_lr_ratio + (1.0 - o.min_lr_ratio) * decay


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: ExperimentConfig) -> torch.optim.lr_scheduler.LambdaLR:
    o, total = cfg.optim, cfg.train.steps
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_multiplier(s, o, total))


def follow_config(engine, cfg: ExperimentConfig) -> None:
    """After a checkpoint load, the optimizer's hyperparameters are the config's, not the saved
    ones (a population-based search goes on from another trial's state with its own values): each
    group's peak LR (lr x its scale) and weight decay (the no-decay group's stays 0), betas or
    momentum, and the schedule's base LRs, at the schedule's restored step."""
    o, groups, scheduler = cfg.optim, engine.optimizer.param_groups, engine.lr_scheduler
    fresh = param_groups(engine.module, o.weight_decay, o.lr, o.layer_decay, o.head_lr_mult)
    if len(fresh) != len(groups):
        raise RuntimeError(f"the checkpoint's optimizer has {len(groups)} param groups, this config "
                           f"{len(fresh)}: optim.layer_decay and optim.head_lr_mult cannot change on resume")
    at = lr_multiplier(scheduler.last_epoch, o, cfg.train.steps) if scheduler is not None else 1.0
    for group, new in zip(groups, fresh):
        peak = o.lr * new.get("lr_scale", 1.0)
        group.update(initial_lr=peak, lr=peak * at, weight_decay=new["weight_decay"])
        if "betas" in group:
            group["betas"] = (o.beta1, o.beta2)
        if "momentum" in group:
            group["momentum"] = o.momentum
    if scheduler is not None:
        scheduler.base_lrs = [group["initial_lr"] for group in groups]


# --------------------------------------------------------------------------- process group


def return_freed_host_memory() -> None:
    """glibc keeps freed blocks under its mmap threshold in the heap, and raises that threshold
    (up to 32 MB) as large blocks are freed: a model built and partitioned layer by layer, and
    each step's gathered layers, then stay resident, fragmented (ViT-H/14, ZeRO-3, 2 CPU ranks:
    12.4 GB a rank instead of 9.9). A fixed 4 MB threshold gives blocks above it their own
    mappings, returned to the OS when freed. No-op off glibc."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 4 << 20)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


@contextlib.contextmanager
def _extensions_lock() -> Iterator[None]:
    """torch's JIT loader guards an extension's build folder with a `lock` file that a process
    killed inside it (a worker killed or preempted while starting) leaves behind, and every later
    load waits for it forever. Our loads take an flock first, which dies with its holder: holding
    it, a `lock` file there can only be a dead loader's, and is removed."""
    import fcntl

    root = os.environ.get("TORCH_EXTENSIONS_DIR", "")
    if not os.path.isdir(root):
        yield
        return
    with open(os.path.join(root, ".vitp-load-lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        for name in os.listdir(root):
            with contextlib.suppress(OSError):
                os.remove(os.path.join(root, name, "lock"))
        yield


def load_ops(*builders: str) -> None:
    """Load DeepSpeed's JIT-built CPU ops (e.g. ShareMemCommBuilder, CPUAdamBuilder) under
    `_extensions_lock`; DeepSpeed keeps them per process, so its own later loads take no lock."""
    import_deepspeed()
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    with _extensions_lock():
        for name in builders:
            builder = get_accelerator().create_op_builder(name)
            if builder is not None and deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
                builder.load(verbose=False)


def init_distributed(use_gpu: bool) -> None:
    """Join (or create) the process group DeepSpeed uses.

    Under Ray Train the group already exists (gloo on CPU, NCCL on GPU). Run alone — the GPU
    benchmark, a debug session — we make a world of one on 127.0.0.1.
    """
    deepspeed = import_deepspeed()
    load_ops("ShareMemCommBuilder")  # DeepSpeed's comm layer loads it, outside any lock of ours
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        # DeepSpeed's own comm layer wraps the existing group (deepspeed.initialize would do the
        # same; zero.Init, which runs before it, needs it to see the real world size)
        deepspeed.init_distributed(dist_backend=torch.distributed.get_backend(), verbose=False)
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    deepspeed.init_distributed(dist_backend="nccl" if use_gpu else "gloo", verbose=False)


def device_for(cfg: ExperimentConfig) -> torch.device:
    name_cpu_accelerator(cfg.parallel.use_gpu)  # before DeepSpeed's first import here
    if cfg.parallel.use_gpu:
        if not torch.cuda.is_available():
            raise RuntimeError(
                "parallel.use_gpu=true but no CUDA device is visible to this worker: "
                "set --set parallel.use_gpu=false (and precision fp32/bf16) to train on CPU"
            )
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    return torch.device("cpu")


def build_engine(model: torch.nn.Module, cfg: ExperimentConfig, world_size: int | None = None,
                 universal: bool = False):
    """Wrap `model` in a DeepSpeed engine; returns (engine, optimizer, scheduler).

    `universal` only changes loading (see build_ds_config); checkpoint.load switches it on for
    its one load when a checkpoint needs it, so an engine built without it can resume resized."""
    deepspeed = import_deepspeed()
    init_distributed(cfg.parallel.use_gpu)
    world = torch.distributed.get_world_size()
    if world_size is not None and world_size != world:
        raise ValueError(f"world size {world_size} requested but the process group has {world}")
    ds_config = build_ds_config(cfg, world, universal)
    optimizer = build_optimizer(model, cfg)
    scheduler = build_scheduler(optimizer, cfg)
    engine, optimizer, _, scheduler = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config,
    )
    if cfg.train.compile:
        engine.compile()  # in place: parameter names and checkpoints are unchanged
    return engine, optimizer, scheduler


@contextlib.contextmanager
def partitioned_construction(cfg: ExperimentConfig, world_size: int | None = None) -> Iterator[Callable]:
    """ZeRO-3: modules built inside are partitioned as each is constructed
    (`deepspeed.zero.Init`); yields `gather(params)`, DeepSpeed's GatheredParameters with rank 0
    as the writer, for initialising or loading one group of parameters at a time."""
    deepspeed = import_deepspeed()
    init_distributed(cfg.parallel.use_gpu)
    ds_config = build_ds_config(cfg, world_size or torch.distributed.get_world_size())
    # no dtype=: DeepSpeed 0.19 then takes it from the config's bf16/fp16 flags; an explicit one
    # is ignored on accelerators without fp16 (CPU) and becomes bf16 (operator precedence)
    with deepspeed.zero.Init(config_dict_or_path=ds_config,
                             remote_device="cpu" if cfg.parallel.offload_params else None):
        yield lambda params: deepspeed.zero.GatheredParameters(list(params), modifier_rank=0)


def model_dtype(cfg: ExperimentConfig) -> torch.dtype:
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[cfg.parallel.precision]
