"""Validation at the edge: every check that can run before Ray starts, all problems at once.

Owns `validate` (called once per command, where input enters: CLI, job specs): each key against its
rule (rules.py), then the rules that tie keys together; and `absolute_paths`. Must not change any value
other than making local paths absolute, nor import torch or ray.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping

from ..errors import ConfigError
# The one allowed edge from config into model: the variant table is a torch-free leaf module.
from ..model.variants import decode_variant
from ..names import name_error
from ..storage import abspath, exists, is_uri, isdir
from .augreg import augreg_problems
from .rules import drill_steps, rule_problems  # noqa: F401 (drill_steps: re-exported, vitp.config)
from .schema import ExperimentConfig


def validate(cfg: ExperimentConfig, check_paths: bool = True) -> ExperimentConfig:
    """The config with local paths made absolute, or ConfigError listing every problem.

    Each problem names the field and the fix: first each key against its rule (rules.py RULES), then
    the rules that tie keys together, for keys that passed their own. `check_paths=False` skips the
    existence checks of data.path and train.init_from (cluster recipes whose paths live on the cluster).
    """
    bad = {**rule_problems(cfg), **_variant_problem(cfg)}
    problems = [
        *bad.values(), *_name_problems(cfg, bad), *_shape_problems(cfg, bad), *_parallel_problems(cfg, bad),
        *_schedule_problems(cfg, bad), *augreg_problems(cfg),
        *(_path_problems(cfg, bad) if check_paths else []),
    ]
    if problems:
        raise ConfigError("invalid config:\n  - " + "\n  - ".join(problems))
    return absolute_paths(cfg)


def absolute_paths(cfg: ExperimentConfig) -> ExperimentConfig:
    """Local relative paths made absolute against the current directory (URIs untouched).

    Ray workers run in their own working directories, so the driver resolves paths once.
    `storage.abspath` leaves "" (unset) and "scratch" alone too; a few-shot dataset given by
    name (no "/") stays a name under <work_dir>/shards."""
    t = cfg.train
    return dataclasses.replace(
        cfg, work_dir=abspath(cfg.work_dir),
        data=dataclasses.replace(cfg.data, path=abspath(cfg.data.path), shards=abspath(cfg.data.shards)),
        train=dataclasses.replace(t, init_from=abspath(t.init_from), fewshot_datasets=tuple(
            abspath(e.strip()) if "/" in e else e for e in t.fewshot_datasets)),
    )


def _name_problems(cfg: ExperimentConfig, bad: Mapping[str, str]) -> list[str]:
    """A derived run name (tracking.run_name ""), whose parts passed their rules, is a name too (it may
    still be too long: runs/<name> is one path component)."""
    parts = ("tracking.run_name", "tracking.run_prefix", "recipe", "model.variant")
    if cfg.tracking.run_name or any(k in bad for k in parts):
        return []
    error = name_error("the derived run name", cfg.run_name)
    return [f"{error}: set tracking.run_name, or a shorter tracking.run_prefix"] if error else []


def _variant_problem(cfg: ExperimentConfig) -> dict[str, str]:
    """model.variant's rule (rules.py leaves it here, where the variant table may be imported)."""
    try:
        spec = decode_variant(cfg.model.variant)
    except ConfigError as e:
        return {"model.variant": str(e)}
    if spec.width % spec.heads:
        return {"model.variant": f"model.variant={cfg.model.variant!r}: heads {spec.heads} do not divide width {spec.width}"}
    return {}


def _shape_problems(cfg: ExperimentConfig, bad: Mapping[str, str]) -> list[str]:
    """The image size against the variant's patch (or a hybrid's token) size."""
    d, m = cfg.data, cfg.model
    if "model.variant" in bad or "data.image_size" in bad:
        return []
    spec = decode_variant(m.variant)
    t = spec.stride  # the patch, or a hybrid's ResNet stride times its patch
    if d.image_size % t:
        ok = [s for s in range(max(t, d.image_size - 2 * t), d.image_size + 2 * t + 1) if s % t == 0]
        return [f"data.image_size={d.image_size} is not divisible by the {'token' if spec.hybrid else 'patch'} size {t} "
                f"of model.variant={m.variant!r}: use a multiple of {t} (e.g. {', '.join(map(str, ok[:3]))})"]
    # data.storage_size < data.image_size is allowed: ingest upscales (e.g. digits 8x8 -> 32).
    return []


def _parallel_problems(cfg: ExperimentConfig, bad: Mapping[str, str]) -> list[str]:
    """ZeRO stage and offload combinations, the batch arithmetic, and the device."""
    p = cfg.parallel
    problems: list[str] = []
    if p.offload_params and p.zero_stage != 3:
        problems.append(
            f"parallel.offload_params=true needs parallel.zero_stage=3 (got {p.zero_stage}): "
            "set parallel.zero_stage=3 or parallel.offload_params=false"
        )
    if p.offload_optimizer and p.zero_stage == 0:
        problems.append(
            "parallel.offload_optimizer=true needs ZeRO stage 1-3: set parallel.zero_stage=1 or higher"
        )
    batch = ("parallel.num_workers", "parallel.micro_batch", "parallel.grad_accum", "parallel.global_batch")
    if not any(k in bad for k in batch):  # else each said what is wrong with it; the arithmetic needs them all
        problems += _batch_problems(cfg, "parallel.min_workers" in bad)
    if "parallel.use_gpu" in bad:
        pass
    elif p.use_gpu and p.gpus_per_worker == 0:
        problems.append("parallel.gpus_per_worker must be > 0 when parallel.use_gpu=true")
    elif not p.use_gpu and p.precision == "fp16":
        problems.append(
            "parallel.precision='fp16' needs a GPU: use 'bf16' or 'fp32' with parallel.use_gpu=false"
        )
    return problems


def _batch_problems(cfg: ExperimentConfig, min_workers_bad: bool) -> list[str]:
    """global = micro x accum x workers, for every worker count an elastic run may have."""
    p = cfg.parallel
    problems: list[str] = []
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
    if min_workers_bad:
        pass
    elif p.min_workers > p.num_workers:
        problems.append(
            f"parallel.min_workers={p.min_workers} must be in 0..parallel.num_workers={p.num_workers} "
            "(0 = a fixed worker count)"
        )
    elif p.min_workers:
        for world in range(p.min_workers, p.num_workers):  # an elastic run may run any of them
            try:
                for_world(cfg, world)
            except ConfigError as e:
                problems.append(f"parallel.min_workers={p.min_workers}: {e}")
                break
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


def _schedule_problems(cfg: ExperimentConfig, bad: Mapping[str, str]) -> list[str]:
    """Warm-up and pause within the run, and the cadences that need another key."""
    o, t = cfg.optim, cfg.train
    problems: list[str] = []
    if "train.steps" not in bad:
        if "optim.warmup_steps" not in bad and o.warmup_steps > t.steps:
            problems.append(f"optim.warmup_steps={o.warmup_steps} must be in 0..train.steps={t.steps}")
        if "train.pause_at" not in bad and t.pause_at > t.steps:
            problems.append(f"train.pause_at={t.pause_at} must be in 0..train.steps={t.steps} (0 = no pause)")
    if t.keep_every and not t.checkpoint_every and not {"train.keep_every", "train.checkpoint_every"} & set(bad):
        problems.append(f"train.keep_every={t.keep_every} keeps every M-th of the periodic checkpoints, but "
                        "train.checkpoint_every=0 takes none: set train.checkpoint_every")
    if t.fewshot_every and "train.fewshot_every" not in bad and not [d for d in t.fewshot_datasets if d.strip()]:
        problems.append(f"train.fewshot_every={t.fewshot_every} but train.fewshot_datasets is empty: "
                        "name preprocessed shards, e.g. --set train.fewshot_datasets=digits")
    return problems


def _path_problems(cfg: ExperimentConfig, bad: Mapping[str, str]) -> list[str]:
    """Local input paths that do not exist (URIs are not checked: that would need the network).

    An empty data.path is not a problem here: only `vitp preprocess` reads the corpus (and says
    so in one line, data.catalog.plan_source); training reads data.shards."""
    d, t = cfg.data, cfg.train
    problems: list[str] = []
    needs_path = d.source not in ("synthetic", "digits") and bool(d.path) and "data.path" not in bad
    if needs_path and not is_uri(d.path) and not exists(d.path):
        problems.append(
            f"data.path={d.path!r} does not exist: point it at the {d.source} dataset "
            "(local path or s3://, gs:// URI)"
        )
    elif d.source == "unlabelled" and "data.path" not in bad and not is_uri(d.path) and not isdir(d.path):
        problems.append(
            f"data.path={d.path!r} is a file: data.source='unlabelled' reads a folder of images "
            "(any depth); point data.path at the folder"
        )
    if t.init_from and t.init_from != "scratch" and "train.init_from" not in bad and not is_uri(t.init_from) and not exists(t.init_from):
        problems.append(
            f"train.init_from={t.init_from!r} does not exist: give a checkpoint directory, "
            "an exported .safetensors file, or 'scratch'"
        )
    return problems
