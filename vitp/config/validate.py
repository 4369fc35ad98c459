"""Validation at the edge: every check that can run before Ray starts, all problems at once.

Owns `validate` (called once per command, where input enters: CLI, job specs) and `absolute_paths`.
Must not change any value other than making local paths absolute, nor import torch or ray.
"""
from __future__ import annotations

import dataclasses
import math

from ..errors import ConfigError
# The one allowed edge from config into model: the variant table is a torch-free leaf module.
from ..model.variants import decode_variant
from ..names import name_error
from ..storage import abspath, exists, has_credentials, is_uri, isdir
from .augreg import augreg_problems
from .overrides import field_type
from .schema import ExperimentConfig


def validate(cfg: ExperimentConfig, check_paths: bool = True) -> ExperimentConfig:
    """The config with local paths made absolute, or ConfigError listing every problem.

    Each problem names the field and the fix. `check_paths=False` skips the existence checks of
    data.path and train.init_from (cluster recipes whose paths live on the cluster).
    """
    problems = [
        *_finite_problems(cfg), *_range_problems(cfg), *_name_problems(cfg),
        *_shape_problems(cfg), *_parallel_problems(cfg), *_schedule_problems(cfg), *_credential_problems(cfg),
        *augreg_problems(cfg),
        *(_path_problems(cfg) if check_paths else []),
    ]
    if problems:
        raise ConfigError("invalid config:\n  - " + "\n  - ".join(problems))
    return absolute_paths(cfg)


def absolute_paths(cfg: ExperimentConfig) -> ExperimentConfig:
    """Local relative paths made absolute against the current directory (URIs untouched).

    Ray workers run in their own working directories, so the driver resolves paths once.
    `storage.abspath` leaves "" (unset) and "scratch" alone too."""
    return dataclasses.replace(
        cfg, work_dir=abspath(cfg.work_dir),
        data=dataclasses.replace(cfg.data, path=abspath(cfg.data.path), shards=abspath(cfg.data.shards)),
        train=dataclasses.replace(cfg.train, init_from=abspath(cfg.train.init_from)),
    )


def _finite_problems(cfg, prefix: str = "") -> list[str]:
    """NaN and infinity in any float key (every range check below would let NaN through)."""
    problems: list[str] = []
    for f in dataclasses.fields(cfg):
        value, key = getattr(cfg, f.name), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            problems += _finite_problems(value, f"{key}.")
        elif isinstance(value, float) and not math.isfinite(value):
            problems.append(f"{key}={value}: must be a finite number")
    return problems


# float keys whose meaning bounds them: (section, key, low, high, high included); low is included
_RANGES = [("model", "dropout", 0.0, 1.0, False), ("model", "attn_dropout", 0.0, 1.0, False),
           ("model", "drop_path", 0.0, 1.0, False), ("train", "label_smoothing", 0.0, 1.0, False),
           ("optim", "layer_decay", 0.0, 1.0, True), ("data", "randaug_magnitude", 0.0, 30.0, True),
           ("train", "mixup_alpha", 0.0, math.inf, False), ("train", "ema_decay", 0.0, 1.0, False), ("train", "cutmix_alpha", 0.0, math.inf, False),
           ("optim", "beta1", 0.0, 1.0, False), ("optim", "beta2", 0.0, 1.0, False),
           ("optim", "momentum", 0.0, 1.0, False), ("optim", "min_lr_ratio", 0.0, 1.0, True),
           ("optim", "weight_decay", 0.0, math.inf, False)]
# ... and those that must be positive
_POSITIVE = [("data", "shard_mb"), ("parallel", "cpus_per_worker"), ("train", "device_peak_tflops"),
             ("tracking", "spool_max_mb"), ("data", "synth_classes"), ("data", "synth_images_per_class"),
             ("optim", "head_lr_mult"), ("optim", "layer_decay")]


def _range_problems(cfg: ExperimentConfig) -> list[str]:
    """_RANGES and _POSITIVE (non-finite values are _finite_problems')."""
    problems: list[str] = []
    for section, key, lo, hi, hi_in in _RANGES:
        v = getattr(getattr(cfg, section), key)
        if math.isfinite(v) and not (lo <= v and (v <= hi if hi_in else v < hi)):
            problems.append(f"{section}.{key}={v}: must be in [{lo:g}, {hi:g}{']' if hi_in else ')'}")
    for section, key in _POSITIVE:
        v = getattr(getattr(cfg, section), key)
        if math.isfinite(v) and v <= 0:
            problems.append(f"{section}.{key}={v}: must be > 0")
    return problems


def _name_problems(cfg: ExperimentConfig) -> list[str]:
    """Names that become path components (runs/<run_name>, shards/<dataset>, ...): one
    component each (vitp/names.py)."""
    named = [("tracking.experiment", cfg.tracking.experiment)]
    if cfg.tracking.run_name:  # "" = derived from the recipe
        named.append(("tracking.run_name", cfg.tracking.run_name))
    named += [("train.fewshot_datasets", d.strip()) for d in cfg.train.fewshot_datasets
              if d.strip() and "/" not in d]  # with a "/" it is a path or URI, not a name
    return [error for key, value in named if (error := name_error(key, value))]


def _shape_problems(cfg: ExperimentConfig) -> list[str]:
    """The model variant against the image size, and the data section's ranges."""
    d, m = cfg.data, cfg.model
    problems: list[str] = []
    try:
        spec = decode_variant(m.variant)
    except ConfigError as e:
        problems.append(str(e))
        spec = None
    if spec is not None:
        t = spec.stride  # the patch, or a hybrid's ResNet stride times its patch
        if d.image_size % t:
            ok = [s for s in range(max(t, d.image_size - 2 * t), d.image_size + 2 * t + 1) if s % t == 0]
            problems.append(
                f"data.image_size={d.image_size} is not divisible by the {'token' if spec.hybrid else 'patch'} size {t} "
                f"of model.variant={m.variant!r}: use a multiple of {t} (e.g. {', '.join(map(str, ok[:3]))})"
            )
        if spec.width % spec.heads:
            problems.append(
                f"model.variant={m.variant!r}: heads {spec.heads} do not divide width {spec.width}"
            )
    if d.image_size <= 0:
        problems.append(f"data.image_size={d.image_size}: must be positive")
    # data.storage_size < data.image_size is allowed: ingest upscales (e.g. digits 8x8 -> 32).
    if m.num_classes <= 0:
        problems.append(f"model.num_classes={m.num_classes}: must be positive")
    if not 0.0 <= d.val_fraction < 1.0:
        problems.append(f"data.val_fraction={d.val_fraction}: must be in [0, 1)")
    if not 0.0 < d.train_fraction <= 1.0:
        problems.append(f"data.train_fraction={d.train_fraction}: must be in (0, 1]")
    if not 1 <= d.jpeg_quality <= 100:
        problems.append(f"data.jpeg_quality={d.jpeg_quality}: must be in 1..100")
    if not 0.0 < d.crop_scale_min <= 1.0:
        problems.append(f"data.crop_scale_min={d.crop_scale_min}: must be in (0, 1]")
    if not 0 <= d.randaug_layers <= 16:
        problems.append(f"data.randaug_layers={d.randaug_layers}: must be in 0..16 (0 = off; AugReg uses 2)")
    return problems


def _parallel_problems(cfg: ExperimentConfig) -> list[str]:
    """ZeRO stage and offload combinations, the batch arithmetic, and the device."""
    p = cfg.parallel
    problems: list[str] = []
    if p.zero_stage not in (0, 1, 2, 3):
        problems.append(f"parallel.zero_stage={p.zero_stage}: ZeRO stage must be 0, 1, 2 or 3")
    if p.offload_params and p.zero_stage != 3:
        problems.append(
            f"parallel.offload_params=true needs parallel.zero_stage=3 (got {p.zero_stage}): "
            "set parallel.zero_stage=3 or parallel.offload_params=false"
        )
    if p.offload_optimizer and p.zero_stage == 0:
        problems.append(
            "parallel.offload_optimizer=true needs ZeRO stage 1-3: set parallel.zero_stage=1 or higher"
        )
    for name in ("num_workers", "micro_batch", "grad_accum", "global_batch"):
        if getattr(p, name) <= 0:
            problems.append(f"parallel.{name}={getattr(p, name)}: must be positive")
    if min(p.num_workers, p.micro_batch, p.grad_accum) > 0:
        product = p.micro_batch * p.grad_accum * p.num_workers
        if product != p.global_batch:
            split = split_batch(p.global_batch, p.micro_batch, p.num_workers)
            hint = (
                f"set parallel.grad_accum={split[1]}" if split and split[0] == p.micro_batch
                else f"set parallel.micro_batch={split[0]} and parallel.grad_accum={split[1]}" if split
                else f"run a worker count that divides {p.global_batch}, or set parallel.global_batch={product}"
            )
            problems.append(
                f"parallel.global_batch {p.global_batch} != micro {p.micro_batch} x accum "
                f"{p.grad_accum} x world {p.num_workers} = {product}: {hint}"
            )
    if not 0 <= p.min_workers <= p.num_workers:
        problems.append(
            f"parallel.min_workers={p.min_workers} must be in 0..parallel.num_workers={p.num_workers} "
            "(0 = a fixed worker count)"
        )
    elif p.min_workers and p.global_batch > 0 and p.micro_batch > 0 and p.grad_accum > 0:
        for world in range(p.min_workers, p.num_workers):  # an elastic run may run any of them
            try:
                for_world(cfg, world)
            except ConfigError as e:
                problems.append(f"parallel.min_workers={p.min_workers}: {e}")
                break
    if p.use_gpu and p.gpus_per_worker <= 0:
        problems.append("parallel.gpus_per_worker must be > 0 when parallel.use_gpu=true")
    if not p.use_gpu and p.precision == "fp16":
        problems.append(
            "parallel.precision='fp16' needs a GPU: use 'bf16' or 'fp32' with parallel.use_gpu=false"
        )
    return problems


def split_batch(global_batch: int, micro_batch: int, world: int) -> tuple[int, int] | None:
    """(micro, accum) with micro x accum x world = global_batch: the given micro batch if it
    divides, else the largest one below it that does (a micro batch is what fits in memory, so it
    never grows); None when no micro batch of at least 1 does."""
    for micro in range(micro_batch, 0, -1):
        if global_batch % (micro * world) == 0:
            return micro, global_batch // (micro * world)
    return None


def for_world(cfg: ExperimentConfig, world: int) -> ExperimentConfig:
    """`cfg` for `world` running workers with the recipe's global batch kept (split_batch: grad_accum
    re-derived, the micro batch lowered only where it must be); ConfigError when no split exists.
    Unchanged when world = parallel.num_workers (or the product holds)."""
    p = cfg.parallel
    if p.micro_batch * p.grad_accum * world == p.global_batch:
        return cfg
    split = split_batch(p.global_batch, p.micro_batch, world) if world > 0 else None
    if split:
        return cfg.replace(parallel=dataclasses.replace(
            p, num_workers=world, micro_batch=split[0], grad_accum=split[1]))
    raise ConfigError(
        f"the global batch {p.global_batch} cannot be split over {world} workers: run a worker "
        f"count that divides it (parallel.num_workers / parallel.min_workers)")


def derive_grad_accum(cfg: ExperimentConfig, set_keys: set[str]) -> ExperimentConfig:
    """After `--set parallel.num_workers=N` (or micro_batch / global_batch) without grad_accum: the
    accumulation that keeps global = micro x accum x workers, with the recipe's micro batch lowered
    (split_batch) where only that divides; a micro batch or grad_accum the user set is theirs
    (validate says what does not add up), and so is a product that holds already."""
    p = cfg.parallel
    batch_keys = {"parallel.num_workers", "parallel.micro_batch", "parallel.global_batch"}
    if ("parallel.grad_accum" in set_keys or not batch_keys & set_keys or min(p.micro_batch, p.num_workers) <= 0
            or p.micro_batch * p.num_workers * p.grad_accum == p.global_batch):
        return cfg
    split = split_batch(p.global_batch, p.micro_batch, p.num_workers)
    if not split or ("parallel.micro_batch" in set_keys and split[0] != p.micro_batch):
        return cfg
    return cfg.replace(parallel=dataclasses.replace(p, micro_batch=split[0], grad_accum=split[1]))


def drill_steps(spec: str) -> range:
    """train.nan_drill "7" or "7-30" -> the steps (1-based) whose loss the drill makes NaN."""
    if not spec.strip():
        return range(0)
    first, sep, last = spec.strip().partition("-")
    try:
        a, b = int(first), int(last) if sep else int(first)
    except ValueError:
        a = b = 0
    if a < 1 or b < a:
        raise ValueError(f"train.nan_drill={spec!r}: give a step or a range of steps, e.g. '7' or '7-30'")
    return range(a, b + 1)


def _schedule_problems(cfg: ExperimentConfig) -> list[str]:
    """Optimizer, run length and cadence, and the sweep's keys."""
    o, t = cfg.optim, cfg.train
    problems: list[str] = []
    if o.lr <= 0:
        problems.append(f"optim.lr={o.lr}: must be positive")
    if o.warmup_steps < 0 or o.warmup_steps > t.steps:
        problems.append(
            f"optim.warmup_steps={o.warmup_steps} must be in 0..train.steps={t.steps}"
        )
    if o.grad_clip < 0:
        problems.append(f"optim.grad_clip={o.grad_clip}: must be >= 0 (0 disables clipping)")
    if t.steps <= 0:
        problems.append(f"train.steps={t.steps}: must be positive")
    for name in ("log_every", "checkpoint_every", "eval_every", "max_failures", "keep_checkpoints", "keep_every"):
        if getattr(t, name) < 0:
            problems.append(f"train.{name}={getattr(t, name)}: must be >= 0")
    if t.keep_every and not t.checkpoint_every:
        problems.append(f"train.keep_every={t.keep_every} keeps every M-th of the periodic checkpoints, but "
                        "train.checkpoint_every=0 takes none: set train.checkpoint_every")
    if not 0 <= t.pause_at <= t.steps:
        problems.append(f"train.pause_at={t.pause_at} must be in 0..train.steps={t.steps} (0 = no pause)")
    if t.fewshot_every < 0:
        problems.append(f"train.fewshot_every={t.fewshot_every}: must be >= 0 (0 = no few-shot probes)")
    elif t.fewshot_every and not [d for d in t.fewshot_datasets if d.strip()]:
        problems.append(f"train.fewshot_every={t.fewshot_every} but train.fewshot_datasets is empty: "
                        "name preprocessed shards, e.g. --set train.fewshot_datasets=digits")
    if t.nonfinite_patience < 1:
        problems.append(f"train.nonfinite_patience={t.nonfinite_patience}: must be >= 1")
    try:
        drill_steps(t.nan_drill)
    except ValueError as e:
        problems.append(str(e))
    if cfg.tracking.log_timeout_s <= 0:
        problems.append(f"tracking.log_timeout_s={cfg.tracking.log_timeout_s}: must be > 0")
    for key in cfg.tune.space:
        try:
            field_type(key)
        except ConfigError:
            problems.append(
                f"tune.space key {key!r} is not a config key: use dotted keys such as 'optim.lr'"
            )
    return problems


def _credential_problems(cfg: ExperimentConfig) -> list[str]:
    """Storage URIs with credentials in them (s3://KEY:SECRET@bucket/...): a path is printed,
    logged and recorded with every run, so a secret in it would be too. The value is not repeated."""
    paths = {"work_dir": cfg.work_dir, "data.path": cfg.data.path, "data.shards": cfg.data.shards,
             "train.init_from": cfg.train.init_from}
    return [f"{key}: a storage URI with credentials in it (user:password@) is refused: give the bucket "
            "as s3://bucket/path and the credentials through AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY "
            "(or the nodes' own role)"
            for key, value in paths.items() if has_credentials(value)]


def _path_problems(cfg: ExperimentConfig) -> list[str]:
    """Local input paths that do not exist (URIs are not checked: that would need the network).

    An empty data.path is not a problem here: only `vitp preprocess` reads the corpus (and says
    so in one line, data.catalog.plan_source); training reads data.shards."""
    d, t = cfg.data, cfg.train
    problems: list[str] = []
    needs_path = d.source not in ("synthetic", "digits") and bool(d.path)
    if needs_path and not is_uri(d.path) and not exists(d.path):
        problems.append(
            f"data.path={d.path!r} does not exist: point it at the {d.source} dataset "
            "(local path or s3://, gs:// URI)"
        )
    elif d.source == "unlabelled" and not is_uri(d.path) and not isdir(d.path):
        problems.append(
            f"data.path={d.path!r} is a file: data.source='unlabelled' reads a folder of images "
            "(any depth); point data.path at the folder"
        )
    if t.init_from and t.init_from != "scratch" and not is_uri(t.init_from) and not exists(t.init_from):
        problems.append(
            f"train.init_from={t.init_from!r} does not exist: give a checkpoint directory, "
            "an exported .safetensors file, or 'scratch'"
        )
    return problems
