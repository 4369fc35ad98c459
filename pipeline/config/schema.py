"""The typed experiment config: one dataclass per concern, and its plain-dict form.

Owns the schema and `ExperimentConfig.to_dict()` (the single source of truth sent to workers,
MLflow and `config.json`) and the run-name formula. Must not parse `--set` text, validate, or
import torch or ray: the CLI, the job submitter and the tests all read it.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from .coerce import from_mapping

# --------------------------------------------------------------------------------------
# The config sections. Defaults are the paper's where it has one.
# --------------------------------------------------------------------------------------

DataSource = Literal[
    "synthetic", "imagefolder", "unlabelled", "csv", "parquet", "webdataset", "cifar10", "cifar100",
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
    # keep this fraction of the train split in the shards (val untouched); nested by key hash:
    # a smaller fraction's images are all in a larger one's (low-data curves)
    train_fraction: float = 1.0
    storage_format: Literal["uint8", "jpeg"] = "uint8"
    jpeg_quality: int = 95
    shard_mb: float = 256  # target shard size (MB); the shard count is rounded up from it
    synth_classes: int = 1000  # synthetic fractal corpus: classes (one IFS each)
    synth_images_per_class: int = 1000
    synth_seed: int = 0  # which IFS each class is: another seed draws classes never seen
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
    # a hybrid's (R50+B/16, ...) weight standardisation and GroupNorm epsilons: "bit" as the
    # official code, "timm" as timm's hybrids (set by `vitp import` from the weights' source)
    resnet_norm: Literal["bit", "timm"] = "bit"


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

    num_workers: int = 8  # workers to run (the most, with min_workers)
    min_workers: int = 0  # >0: elastic, Train runs with min_workers..num_workers as nodes come and go
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
    pause_at: int = 0  # >0: stop at this step with a checkpoint (continue later); schedule unchanged
    log_every: int = 50
    eval_every: int = 0  # 0 = only at the end
    checkpoint_every: int = 1000
    keep_checkpoints: int = 2
    seed: int = 0
    max_failures: int = 3  # Ray Train worker-group restarts before the run fails (preemptions aside)
    nonfinite_patience: int = 3  # consecutive non-finite steps (skipped) before a rollback
    nan_drill: str = ""  # fault drill: steps whose loss is made NaN, e.g. "7" or "7-30"
    record_samples: bool = False  # each rank's sample keys per step -> <run>/samples/ (audit)
    resume: Literal["auto", "never", "must"] = "auto"
    init_from: str = ""  # fine-tuning source: checkpoint dir, exported weights, or "" = scratch
    device_peak_tflops: float = 989.0  # for MFU: H100/H200 dense bf16 989, A100 312
    compile: bool = False  # torch.compile the model (DeepSpeed's engine.compile, inductor backend)
    # "classify": cross-entropy on the labels; "mpp": masked patch prediction (paper 4.6), no
    # labels used (an unlabelled corpus is a valid source); val/top1 is then per corrupted patch
    objective: Literal["classify", "mpp"] = "classify"
    # >0: every N steps a snapshot of the weights is few-shot evaluated off the training path
    # (train/fewshot_probe.py); metrics fewshot/<dataset>_<k>shot_top1 at the snapshot's step
    fewshot_every: int = 0
    # preprocessed shard dirs (path or URI), or names of <work_dir>/shards/<name> (vitp preprocess)
    fewshot_datasets: tuple[str, ...] = ("digits",)


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
    log_timeout_s: float = 5.0  # longest a training step waits on MLflow; the rest is spooled
    spool_max_mb: float = 512.0  # most unsent metrics a run's spool keeps while MLflow is down
    system_metrics: bool = True  # CPU, memory (GPU when present) of rank 0's node, at each log step


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
        return from_mapping(cls, d)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=False)

    # ---------------------------------------------------------------- derived values
    @property
    def run_name(self) -> str:
        """THE run-name formula (MLflow run, Ray Train run directory): `<recipe>-<variant>-<source>`,
        plus `-mpp` for masked patch prediction (so it never resumes a classification run)."""
        if self.tracking.run_name:
            return self.tracking.run_name
        mpp = "-mpp" if self.train.objective == "mpp" else ""
        return f"{self.recipe}-{self.model.variant.replace('/', '')}-{self.data.source}{mpp}"

    def replace(self, **sections: Any) -> "ExperimentConfig":
        """A copy with whole sections (or `recipe`, `work_dir`) replaced: `cfg.replace(data=...)`."""
        return dataclasses.replace(self, **sections)


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
