"""Typed experiment configuration: one dataclass per concern, validation, `--set` overrides.

Owns the resolved config (`ExperimentConfig.to_dict()` is the single source of truth sent to
workers, MLflow and `config.json`) and the ViT variant table (a string like "B/16" is data).
Must not import torch or ray: it is read by the CLI, the job submitter and the tests alike.
"""
from __future__ import annotations

import dataclasses
import json
import re
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Optional


class ConfigError(ValueError):
    """A config value is wrong; the message names the field and how to fix it."""


# --------------------------------------------------------------------------------------
# ViT variants (paper Table 1 plus big_vision's small sizes). "B/16" = Base, 16x16 patches.
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ViTSpec:
    """Shape of a ViT: the numbers of paper Table 1 plus the patch size."""

    name: str
    patch: int
    depth: int
    width: int
    mlp_dim: int
    heads: int


# name -> (depth, width, mlp_dim, heads). "mu" and "pico" are for tests and the debug recipe.
VARIANTS: dict[str, tuple[int, int, int, int]] = {
    "mu": (1, 32, 128, 2),
    "pico": (2, 64, 128, 4),
    "Ti": (12, 192, 768, 3),
    "S": (12, 384, 1536, 6),
    "M": (12, 512, 2048, 8),
    "B": (12, 768, 3072, 12),
    "L": (24, 1024, 4096, 16),
    "H": (32, 1280, 5120, 16),
}

# The variants the paper and PAPER.md name; tests iterate over these.
PAPER_VARIANTS = ("Ti/16", "S/16", "B/16", "L/16", "H/14", "B/32", "L/32", "B/8")

_VARIANT_RE = re.compile(r"^([A-Za-z]+)/(\d+)$")


def decode_variant(variant: str) -> ViTSpec:
    """Decode "B/16" into a ViTSpec; raise ConfigError naming the valid names otherwise."""
    m = _VARIANT_RE.match(variant.strip())
    if not m or m.group(1) not in VARIANTS:
        valid = ", ".join(f"{n}/<patch>" for n in VARIANTS)
        raise ConfigError(
            f"model.variant={variant!r} is not a ViT variant: use NAME/PATCH with NAME one of "
            f"{valid} (e.g. 'B/16', 'H/14')"
        )
    name, patch = m.group(1), int(m.group(2))
    if patch <= 0:
        raise ConfigError(f"model.variant={variant!r}: patch size must be positive")
    depth, width, mlp_dim, heads = VARIANTS[name]
    return ViTSpec(name=name, patch=patch, depth=depth, width=width, mlp_dim=mlp_dim, heads=heads)


# --------------------------------------------------------------------------------------
# The config sections. Defaults are the paper's where it has one.
# --------------------------------------------------------------------------------------

DataSource = Literal[
    "synthetic", "imagefolder", "csv", "parquet", "webdataset", "cifar10", "cifar100",
    "digits", "pets", "flowers", "imagenet",
]


@dataclass
class DataConfig:
    """Where images come from, how they are stored in shards, and how ingest augments them."""

    source: DataSource = "synthetic"
    path: str = ""  # input corpus (path or s3://, gs:// URI); unused for synthetic / digits
    shards: str = ""  # Parquet shard directory; "" = <work_dir>/shards/<source>
    image_size: int = 224  # training resolution fed to the model
    storage_size: int = 256  # shorter side stored in shards (resize + centre crop)
    num_classes: int = 1000
    val_fraction: float = 0.02  # split by hash of the file identity, so it is stable
    storage_format: Literal["uint8", "jpeg"] = "uint8"
    jpeg_quality: int = 95
    shard_mb: int = 256  # target shard size
    synth_classes: int = 1000  # synthetic fractal corpus: classes (one IFS each)
    synth_images_per_class: int = 1000
    augment: Literal["inception_crop", "random_crop", "none"] = "inception_crop"
    crop_scale_min: float = 0.08  # inception crop area range lower bound
    hflip: bool = True
    # The official code normalises to [-1, 1]: (x/255 - 0.5) / 0.5 on the device.
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)


@dataclass
class ModelConfig:
    """The ViT: a variant string plus the head and regularisation choices."""

    variant: str = "B/16"
    num_classes: int = 1000
    pool: Literal["cls", "gap"] = "cls"
    # "pretrain": tanh pre-logits (width D) + linear; "finetune": zero-init linear only.
    head: Literal["pretrain", "finetune"] = "pretrain"
    representation_size: Optional[int] = None  # pre-logits width; None = model width D
    dropout: float = 0.0
    attn_dropout: float = 0.0
    grad_checkpointing: bool = False  # recompute each block in backward (activation memory)


@dataclass
class OptimConfig:
    """Optimizer and LR schedule. Defaults: the paper's pre-training Adam recipe."""

    name: Literal["adamw", "sgd"] = "adamw"
    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    weight_decay: float = 0.03
    momentum: float = 0.9  # sgd only
    grad_clip: float = 1.0  # global-norm clip; 0 disables
    warmup_steps: int = 10_000
    schedule: Literal["linear", "cosine", "constant"] = "linear"
    min_lr_ratio: float = 0.0  # decay ends at lr * min_lr_ratio


@dataclass
class ParallelConfig:
    """Data parallelism across Ray Train workers and the DeepSpeed ZeRO settings."""

    num_workers: int = 8
    use_gpu: bool = True
    cpus_per_worker: float = 8.0
    gpus_per_worker: float = 1.0
    global_batch: int = 4096
    micro_batch: int = 64  # per worker per forward/backward
    grad_accum: int = 8  # global_batch = micro_batch * grad_accum * num_workers
    zero_stage: int = 1
    offload_optimizer: bool = False
    offload_params: bool = False  # ZeRO-3 only
    precision: Literal["bf16", "fp16", "fp32"] = "bf16"


@dataclass
class TrainConfig:
    """Length, cadence, checkpoints and fault tolerance of a training run."""

    steps: int = 90_000  # optimizer steps
    log_every: int = 50
    eval_every: int = 0  # 0 = only at the end
    checkpoint_every: int = 1000
    keep_checkpoints: int = 2
    seed: int = 0
    max_failures: int = 3  # Ray Train worker-group restarts before the run fails
    resume: Literal["auto", "never", "must"] = "auto"
    init_from: str = ""  # fine-tuning source: checkpoint dir, exported weights, or "" = scratch
    device_peak_tflops: float = 989.0  # for MFU: H100/H200 dense bf16 989, A100 312


@dataclass
class TuneConfig:
    """Ray Tune sweep over dotted config keys."""

    space: dict[str, list] = field(default_factory=dict)  # e.g. {"optim.lr": [0.001, 0.003]}
    search: Literal["grid", "random"] = "grid"
    num_samples: int = 1  # random search draws; grid repeats
    scheduler: Literal["none", "asha"] = "none"
    metric: str = "val/top1"
    mode: Literal["max", "min"] = "max"
    max_concurrent_trials: int = 0  # 0 = derived from cluster resources
    trial_retries: int = 1


@dataclass
class TrackingConfig:
    """MLflow: where runs go and how they are named."""

    uri: str = ""  # "" = sqlite:///<work_dir>/mlflow.db
    experiment: str = "vit-pipeline"
    run_name: str = ""  # "" = <recipe>-<variant>-<dataset>
    tags: dict[str, str] = field(default_factory=dict)


@dataclass
class ExperimentConfig:
    """Everything one command needs. `recipe` names the function in recipes.py it came from."""

    recipe: str = "custom"
    work_dir: str = "work"  # local path or URI; shards, checkpoints, MLflow store live here
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    tune: TuneConfig = field(default_factory=TuneConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    # ---------------------------------------------------------------- serialisation
    def to_dict(self) -> dict[str, Any]:
        """The resolved config as plain JSON types (tuples become lists)."""
        return json.loads(json.dumps(dataclasses.asdict(self)))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ExperimentConfig":
        """Inverse of to_dict; unknown keys raise ConfigError listing the valid ones."""
        return _from_dict(cls, d, prefix="")

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=False)

    # ---------------------------------------------------------------- derived values
    @property
    def spec(self) -> ViTSpec:
        return decode_variant(self.model.variant)

    @property
    def run_name(self) -> str:
        if self.tracking.run_name:
            return self.tracking.run_name
        return f"{self.recipe}-{self.model.variant.replace('/', '')}-{self.data.source}"

    def replace(self, **sections: Any) -> "ExperimentConfig":
        return dataclasses.replace(self, **sections)


# --------------------------------------------------------------------------------------
# Dict <-> dataclass, dotted keys, and typed parsing of override strings.
# --------------------------------------------------------------------------------------


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _from_dict(cls: type, d: dict[str, Any], prefix: str) -> Any:
    if not isinstance(d, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping, got {type(d).__name__}")
    hints = _hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(d) - set(names))
    if unknown:
        raise ConfigError(
            f"unknown config key(s) {', '.join(prefix + k for k in unknown)}; "
            f"valid keys here: {', '.join(prefix + n for n in names)}"
        )
    kwargs = {}
    for name in names:
        if name not in d:
            continue
        tp = hints[name]
        if dataclasses.is_dataclass(tp):
            kwargs[name] = _from_dict(tp, d[name], prefix=f"{prefix}{name}.")
        else:
            kwargs[name] = _coerce(d[name], tp, f"{prefix}{name}")
    return cls(**kwargs)


def valid_keys(cfg: ExperimentConfig | None = None) -> list[str]:
    """Every dotted key `--set` accepts, e.g. 'optim.lr'."""
    out: list[str] = []

    def walk(cls: type, prefix: str) -> None:
        hints = _hints(cls)
        for f in dataclasses.fields(cls):
            tp = hints[f.name]
            if dataclasses.is_dataclass(tp):
                walk(tp, f"{prefix}{f.name}.")
            else:
                out.append(prefix + f.name)

    walk(ExperimentConfig, "")
    return out


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin is typing.Union:
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "none"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check/convert an already-parsed value (from JSON or a dict) to the field's type."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Union:  # Optional[X]
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{key}: bad value {value!r}")
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{key}={value!r} is not allowed: use {_type_name(tp)}")
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}={value!r}: expected true or false")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise ConfigError(f"{key}={value!r}: expected an integer")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}={value!r}: expected a number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}={value!r}: expected a string")
        return value
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}={value!r}: expected a list of {len(args)} values")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(v, args[0], key) for v in value)
        if len(value) != len(args):
            raise ConfigError(f"{key}={value!r}: expected exactly {len(args)} values")
        return tuple(_coerce(v, a, key) for v, a in zip(value, args))
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}={value!r}: expected a mapping (JSON object)")
        vt = args[1] if args else Any
        if vt is Any or typing.get_origin(vt) is list or vt is list:
            return {str(k): (list(v) if isinstance(v, (list, tuple)) else v) for k, v in value.items()}
        return {str(k): _coerce(v, vt, f"{key}.{k}") for k, v in value.items()}
    if origin is list or tp is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}={value!r}: expected a list")
        return list(value)
    return value


def _parse_text(text: str, tp: Any, key: str) -> Any:
    """Turn the right-hand side of `--set key=text` into a value of the field's type."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    low = text.strip().lower()
    if origin is typing.Union and type(None) in args:
        if low in ("none", "null", ""):
            return None
        inner = [a for a in args if a is not type(None)][0]
        return _parse_text(text, inner, key)
    if tp is bool:
        if low in ("true", "1", "yes", "on"):
            return True
        if low in ("false", "0", "no", "off"):
            return False
        raise ConfigError(f"--set {key}={text}: expected true or false")
    if tp is int:
        try:
            return int(text.replace("_", ""))
        except ValueError:
            try:
                f = float(text)
            except ValueError:
                f = None
            if f is not None and f.is_integer():
                return int(f)
            raise ConfigError(f"--set {key}={text}: expected an integer") from None
    if tp is float:
        try:
            return float(text)
        except ValueError:
            raise ConfigError(f"--set {key}={text}: expected a number") from None
    if tp is str or origin is Literal:
        return _coerce(text, tp, key)
    if origin in (tuple, list, dict) or tp in (list, dict):
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            if origin is tuple or origin is list or tp is list:  # also accept "a,b,c"
                parts = [p.strip() for p in text.split(",") if p.strip()]
                inner = args[0] if args else str
                value = [_parse_text(p, inner, key) for p in parts]
            else:
                raise ConfigError(f"--set {key}={text}: expected a JSON object") from None
        return _coerce(value, tp, key)
    raise ConfigError(f"--set {key}: unsupported field type {tp}")


def field_type(key: str) -> Any:
    """The declared type of a dotted key; ConfigError with the valid keys if unknown."""
    parts = key.split(".")
    cls: Any = ExperimentConfig
    for i, part in enumerate(parts):
        hints = _hints(cls) if dataclasses.is_dataclass(cls) else {}
        if part not in hints:
            raise ConfigError(
                f"unknown config key {key!r}; valid keys: {', '.join(valid_keys())}"
            )
        cls = hints[part]
        if i < len(parts) - 1 and not dataclasses.is_dataclass(cls):
            raise ConfigError(f"unknown config key {key!r}; valid keys: {', '.join(valid_keys())}")
    if dataclasses.is_dataclass(cls):
        raise ConfigError(f"{key!r} is a section; set one of its fields, e.g. {key}.{dataclasses.fields(cls)[0].name}=...")
    return cls


def set_value(cfg: ExperimentConfig, key: str, value: Any) -> ExperimentConfig:
    """A copy of cfg with dotted `key` set to an already-typed value (checked)."""
    tp = field_type(key)
    value = _coerce(value, tp, key)
    d = cfg.to_dict()
    node = d
    parts = key.split(".")
    for part in parts[:-1]:
        node = node[part]
    node[parts[-1]] = json.loads(json.dumps(value))
    return ExperimentConfig.from_dict(d)


def apply_overrides(cfg: ExperimentConfig, overrides: list[str] | tuple[str, ...]) -> ExperimentConfig:
    """Apply `a.b=v` strings, type-checked against the dataclasses; returns a new config."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. --set optim.lr=0.003")
        key, text = item.split("=", 1)
        key = key.strip()
        tp = field_type(key)
        cfg = set_value(cfg, key, _parse_text(text, tp, key))
    return cfg


# --------------------------------------------------------------------------------------
# Validation: everything that can be checked before Ray starts.
# --------------------------------------------------------------------------------------


def _is_uri(path: str) -> bool:
    return "://" in path


def validate(cfg: ExperimentConfig, check_paths: bool = True) -> ExperimentConfig:
    """Raise ConfigError listing every problem (each names the field and the fix)."""
    problems: list[str] = []
    try:
        spec = cfg.spec
    except ConfigError as e:
        problems.append(str(e))
        spec = None
    d, m, o, p, t = cfg.data, cfg.model, cfg.optim, cfg.parallel, cfg.train

    if spec is not None:
        if d.image_size % spec.patch:
            ok = [s for s in range(max(spec.patch, d.image_size - 2 * spec.patch), d.image_size + 2 * spec.patch + 1) if s % spec.patch == 0]
            problems.append(
                f"data.image_size={d.image_size} is not divisible by the patch size {spec.patch} "
                f"of model.variant={m.variant!r}: use a multiple of {spec.patch} (e.g. {', '.join(map(str, ok[:3]))})"
            )
        if spec.width % spec.heads:
            problems.append(
                f"model.variant={m.variant!r}: heads {spec.heads} do not divide width {spec.width}"
            )
    if d.image_size <= 0:
        problems.append(f"data.image_size={d.image_size}: must be positive")
    if d.storage_size < d.image_size and d.source != "synthetic":
        pass  # upscaling at ingest is allowed (e.g. digits 8x8 -> 32), only noted in logs
    if m.num_classes <= 0:
        problems.append(f"model.num_classes={m.num_classes}: must be positive")
    if not 0.0 <= d.val_fraction < 1.0:
        problems.append(f"data.val_fraction={d.val_fraction}: must be in [0, 1)")
    if not 1 <= d.jpeg_quality <= 100:
        problems.append(f"data.jpeg_quality={d.jpeg_quality}: must be in 1..100")
    if not 0.0 < d.crop_scale_min <= 1.0:
        problems.append(f"data.crop_scale_min={d.crop_scale_min}: must be in (0, 1]")

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
            fix_accum = p.global_batch / (p.micro_batch * p.num_workers)
            hint = (
                f"set parallel.grad_accum={int(fix_accum)}" if fix_accum.is_integer() and fix_accum >= 1
                else f"set parallel.global_batch={product}"
            )
            problems.append(
                f"parallel.global_batch {p.global_batch} != micro {p.micro_batch} x accum "
                f"{p.grad_accum} x world {p.num_workers} = {product}: {hint}"
            )
    if p.use_gpu and p.gpus_per_worker <= 0:
        problems.append("parallel.gpus_per_worker must be > 0 when parallel.use_gpu=true")
    if not p.use_gpu and p.precision == "fp16":
        problems.append(
            "parallel.precision='fp16' needs a GPU: use 'bf16' or 'fp32' with parallel.use_gpu=false"
        )

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
    for name in ("log_every", "checkpoint_every", "eval_every", "max_failures"):
        if getattr(t, name) < 0:
            problems.append(f"train.{name}={getattr(t, name)}: must be >= 0")
    for key in cfg.tune.space:
        try:
            field_type(key)
        except ConfigError:
            problems.append(
                f"tune.space key {key!r} is not a config key: use dotted keys such as 'optim.lr'"
            )

    if check_paths:
        needs_path = d.source not in ("synthetic", "digits")
        if needs_path and not d.path:
            problems.append(
                f"data.path is empty but data.source={d.source!r} reads files: "
                f"set --set data.path=/path/to/{d.source}"
            )
        elif needs_path and not _is_uri(d.path):
            import os

            if not os.path.exists(d.path):
                problems.append(
                    f"data.path={d.path!r} does not exist: point it at the {d.source} dataset "
                    "(local path or s3://, gs:// URI)"
                )
        if t.init_from and t.init_from != "scratch" and not _is_uri(t.init_from):
            import os

            if not os.path.exists(t.init_from):
                problems.append(
                    f"train.init_from={t.init_from!r} does not exist: give a checkpoint directory, "
                    "an exported .safetensors file, or 'scratch'"
                )
    if problems:
        raise ConfigError("invalid config:\n  - " + "\n  - ".join(problems))
    return cfg


def absolute_paths(cfg: ExperimentConfig) -> ExperimentConfig:
    """Local relative paths made absolute against the current directory (URIs untouched).

    Ray workers run in their own working directories, so the driver resolves paths once."""
    import os

    def fix(p: str) -> str:
        return p if (not p or _is_uri(p) or p == "scratch") else os.path.abspath(p)

    return dataclasses.replace(
        cfg, work_dir=fix(cfg.work_dir),
        data=dataclasses.replace(cfg.data, path=fix(cfg.data.path), shards=fix(cfg.data.shards)),
        train=dataclasses.replace(cfg.train, init_from=fix(cfg.train.init_from)),
    )


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{'a': {'b': 1}} -> {'a.b': 1}: the MLflow params view of the resolved config."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v and all(isinstance(x, str) for x in v) and k not in ("space", "tags"):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out
