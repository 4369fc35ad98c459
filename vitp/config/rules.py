"""The rule each config key's value follows, one table keyed by the dotted key (RULES), and
`rule_problems`, which applies it: a range for every number (NaN and infinity refused, absurd sizes
capped), a choice, a name, a path, a flag or a documented free text for the rest (rulekinds.py). Rules
that tie keys together (the batch product, warm-up within the run, ...) are validate.py's. No torch or ray.
"""
from __future__ import annotations

import typing
from typing import Any

from ..errors import ConfigError
from .overrides import field_type, valid_keys
from .rulekinds import (MAX_PATH_BYTES, Check, Choice, Each, Elsewhere, Flag, Name, NameOrPath, Number, Path, Rule,
                        Text, count, floats, ints, positive)
from .tags import Tags

__all__ = ["RULES", "Rule", "Number", "Each", "Name", "drill_steps", "rule_problems", "unruled_keys", "value_of"]


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


def _drill(key: str, value: Any) -> str | None:
    try:
        drill_steps(value)
    except ValueError as e:
        return str(e)
    return None


def _space_keys(key: str, value: Any) -> str | None:
    """tune.space: a mapping of config keys; its values are parsed and every probe trial validated by the
    sweep (tune/spec.py build_spec), where they are used."""
    if not isinstance(value, dict):
        return f"{key}={value!r}: expected a mapping (JSON object)"
    for k in value:
        try:
            field_type(k)
        except ConfigError:
            return f"tune.space key {k!r} is not a config key: use dotted keys such as 'optim.lr'"
    return None


# Caps on sizes and counts: far beyond any real run (the production ViT-H/14 recipe trains 311,949 steps
# at a batch of 4096 on 32 GPUs), near enough to catch a typo before it allocates or runs forever.
MAX_STEPS = 10_000_000
MAX_CLASSES = 1_000_000
MAX_WORKERS = 65_536
MAX_SEED = 2**32 - 1  # numpy's seed range
# A float's own minimum (rulekinds.Number.least) where a value nearer 0 is a typo that would break
# something: every other float other than 0 must be at least the smallest normal float.
RAY_UNIT, RAY_UNIT_WHY = 1e-4, "(Ray counts resources in units of 0.0001)"
LITERAL = Choice(())  # in the table: the key's Literal choices, read from the schema below

_TABLE: dict[str, Rule] = {
    "recipe": Name(),  # the first part of a derived run name
    "work_dir": Path(required=True, not_root=True),
    # data
    "data.source": LITERAL,
    "data.path": Path(),
    "data.allow_outside_root": Flag(),
    "data.shards": Path(),
    "data.image_size": ints(8, 4096),
    "data.storage_size": ints(8, 8192),
    "data.num_classes": count(MAX_CLASSES, why="(0 = as many as the corpus has)"),
    "data.val_fraction": floats("[0, 1)"),
    "data.train_fraction": floats("(0, 1]"),
    "data.storage_format": LITERAL,
    "data.jpeg_quality": ints(1, 100),
    "data.shard_mb": positive(65_536, least=1e-3, least_why="(a kilobyte: the shard count is the data's size over it)"),
    "data.synth_classes": positive(MAX_CLASSES, integer=True),
    "data.synth_images_per_class": positive(MAX_CLASSES, integer=True),
    "data.synth_seed": ints(0, MAX_SEED),
    "data.augment": LITERAL,
    "data.crop_scale_min": floats("(0, 1]"),
    "data.hflip": Flag(),
    "data.randaug_layers": ints(0, 16, why="(0 = off; AugReg uses 2)"),
    "data.randaug_magnitude": floats("[0, 30]"),
    "data.mean": Each(floats("[0, 1]"), length=3),  # of pixels scaled to [0, 1]
    "data.std": Each(floats("(0, 1]"), length=3),  # divides: 0 would make every pixel inf
    # model
    "model.variant": Elsewhere(what="a ViT variant, `vitp model VARIANT` (validate.py: the variant table is model's)",
                               bad=("Q/16", "B/x", "B/0"), good=("B/16", "R50+B/16")),
    "model.num_classes": positive(MAX_CLASSES, integer=True, say="must be positive"),
    "model.pool": LITERAL,
    "model.head": LITERAL,
    "model.representation_size": Number(0, 65_536, integer=True, optional=True, why="(none or 0 = the model width)"),
    "model.dropout": floats("[0, 1)"),
    "model.attn_dropout": floats("[0, 1)"),
    "model.drop_path": floats("[0, 1)"),
    "model.head_bias": floats("[-100, 100]"),  # -log(classes) is -13.8 for a million classes
    "model.grad_checkpointing": Flag(),
    "model.resnet_norm": LITERAL,
    # optim
    "optim.name": LITERAL,
    "optim.lr": positive(10.0, say="must be positive", least=1e-10,
                         least_why="(smaller steps vanish in float32 weights: 7 significant digits)"),
    "optim.beta1": floats("[0, 1)"),
    "optim.beta2": floats("[0, 1)"),
    "optim.weight_decay": floats("[0, inf)"),
    "optim.momentum": floats("[0, 1)"),
    "optim.grad_clip": floats("[0, inf)", why="(0 disables clipping)"),
    "optim.warmup_steps": count(MAX_STEPS),  # and at most train.steps (validate.py)
    "optim.schedule": LITERAL,
    "optim.min_lr_ratio": floats("[0, 1]"),
    "optim.layer_decay": floats("(0, 1]"),
    "optim.head_lr_mult": positive(1000.0),
    # parallel
    "parallel.num_workers": positive(MAX_WORKERS, integer=True, say="must be positive"),
    "parallel.min_workers": count(MAX_WORKERS, why="(0 = a fixed worker count)"),  # and at most num_workers
    "parallel.use_gpu": Flag(),
    "parallel.cpus_per_worker": positive(1024.0, least=RAY_UNIT, least_why=RAY_UNIT_WHY),
    "parallel.gpus_per_worker": floats("[0, 64]", least=RAY_UNIT,
                                       least_why=RAY_UNIT_WHY),  # > 0 with use_gpu (validate.py)
    "parallel.placement_timeout_s": floats("[0, 604800]", why="(0 = wait forever; at most a week)", least=1e-3,
                                           least_why="(a millisecond)"),
    "parallel.global_batch": positive(2**20, integer=True, say="must be positive"),
    "parallel.micro_batch": positive(65_536, integer=True, say="must be positive"),
    "parallel.grad_accum": positive(65_536, integer=True, say="must be positive"),
    "parallel.zero_stage": ints(0, 3, say="ZeRO stage must be 0, 1, 2 or 3"),
    "parallel.offload_optimizer": Flag(),
    "parallel.offload_params": Flag(),
    "parallel.precision": LITERAL,
    # train
    "train.steps": positive(MAX_STEPS, integer=True, say="must be positive"),
    "train.pause_at": count(MAX_STEPS, why="(0 = no pause)"),  # and at most train.steps
    "train.log_every": count(MAX_STEPS),
    "train.eval_every": count(MAX_STEPS, why="(0 = only at the end)"),
    "train.checkpoint_every": count(MAX_STEPS, why="(0 = at the end only)"),
    "train.keep_checkpoints": count(MAX_STEPS, why="(0 = all)"),
    "train.keep_every": count(MAX_STEPS, why="(0 = none)"),
    "train.seed": ints(0, MAX_SEED),
    "train.max_failures": count(1000),  # Ray reads -1 as "retry forever"
    "train.nonfinite_patience": count(MAX_STEPS, lo=1),
    "train.nan_drill": Check(_drill, "'' or a step or steps, '7' or '7-30'", bad=("x", "0", "9-3"), good=("", "7", "7-30")),
    "train.record_samples": Flag(),
    "train.resume": LITERAL,
    "train.init_from": Path(),  # exists (validate.py, with check_paths)
    "train.device_peak_tflops": positive(1e6, least=1e-3, least_why="(a GFLOP/s: MFU divides by it)"),
    "train.compile": Flag(),
    "train.objective": LITERAL,
    "train.fewshot_every": count(MAX_STEPS, why="(0 = no few-shot probes)"),
    "train.fewshot_datasets": Each(NameOrPath(), indexed=False),
    "train.augreg": Elsewhere(what="a setting of config/augreg.py AUGREG or '' (augreg_problems)",
                              bad=("medium3",), good=("", "light1")),
    "train.mixup_alpha": floats("[0, 10]"),
    "train.cutmix_alpha": floats("[0, 10]"),
    "train.label_smoothing": floats("[0, 1)"),
    "train.loss": LITERAL,
    "train.ema_decay": floats("[0, 1)", why="(0 = off)"),
    "train.fewshot_weights": LITERAL,
    # tune
    "tune.space": Check(_space_keys, "config keys to values or distributions (tune/space.py; each probe trial "
                        "is validated by the sweep)", bad=({"optim.nope": [1]}, [1]), good=({}, {"optim.lr": [0.1]})),
    "tune.search": LITERAL,
    "tune.num_samples": count(100_000, lo=1),
    "tune.seed": ints(0, MAX_SEED),
    "tune.startup_trials": count(100_000),
    "tune.scheduler": LITERAL,
    "tune.perturbation_interval": count(MAX_STEPS, why="(0 = train.eval_every)"),
    "tune.metric": Text(max_bytes=250, nonempty=True),  # an MLflow metric key (250 at most)
    "tune.mode": LITERAL,
    "tune.max_concurrent_trials": count(100_000, why="(0 = derived from the cluster's resources)"),
    "tune.trial_retries": count(100),  # Ray reads -1 as "retry forever"
    # tracking
    "tracking.uri": Text(max_bytes=MAX_PATH_BYTES),  # free: an MLflow URI; "" = the work_dir's store
    "tracking.experiment": Name(),
    "tracking.run_name": Name(empty_ok=True),  # "" = derived
    "tracking.run_prefix": Name(empty_ok=True),  # "" = the recipe
    "tracking.tags": Tags(),
    "tracking.log_timeout_s": positive(3600.0, least=1e-3, least_why="(a millisecond)"),
    "tracking.spool_max_mb": positive(2.0**20, least=1e-3, least_why="(a kilobyte: a few metric lines)"),
    "tracking.system_metrics": Flag(),
}
RULES: dict[str, Rule] = {k: Choice(typing.get_args(field_type(k))) if r is LITERAL else r for k, r in _TABLE.items()}


def value_of(cfg: Any, key: str) -> Any:
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def unruled_keys() -> list[str]:
    """Schema keys with no rule (the tests fail on any)."""
    return [k for k in valid_keys() if k not in RULES]


def rule_problems(cfg: Any) -> dict[str, str]:
    """{key: its refusal} for every key whose value breaks its rule."""
    return {key: p for key, rule in RULES.items() if (p := rule.problem(key, value_of(cfg, key)))}
