"""The typed experiment config: one dataclass per concern, and its plain-dict form.

Owns the schema (each field's comment is its meaning: `vitp config --keys`), `to_dict()` (sent to
workers, MLflow and `config.json`) and the run-name formula. Must not parse `--set` text,
validate, or import torch or ray: the CLI, the job submitter and the tests all read it.
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

    source: DataSource = "synthetic"  # corpus format; "synthetic" renders fractals, "digits" is bundled
    path: str = ""  # input corpus (path or s3://, gs:// URI); unused for synthetic / digits
    allow_outside_root: bool = False  # read files that symlinks or a labels list lead to outside data.path (else quarantined)
    shards: str = ""  # Parquet shard directory; "" = <work_dir>/shards/<source>
    image_size: int = 224  # training resolution fed to the model
    storage_size: int = 256  # shorter side stored in shards (resize + centre crop)
    num_classes: int = 1000  # labels in the corpus; preprocess quarantines images labelled beyond it
    val_fraction: float = 0.02  # split by hash of the file identity, so it is stable
    # keep this fraction of the train split in the shards (val untouched); nested by key hash:
    # a smaller fraction's images are all in a larger one's (low-data curves)
    train_fraction: float = 1.0
    storage_format: Literal["uint8", "jpeg"] = "uint8"  # pixels in shards: raw, or JPEG decoded at ingest
    jpeg_quality: int = 95  # when storage_format="jpeg"
    shard_mb: float = 256  # target shard size (MB); the shard count is rounded up from it
    synth_classes: int = 1000  # synthetic fractal corpus: classes (one IFS each)
    synth_images_per_class: int = 1000  # synthetic fractal corpus: images per class
    synth_seed: int = 0  # which IFS each class is: another seed draws classes never seen
    augment: Literal["inception_crop", "random_crop", "none"] = "inception_crop"  # training crop
    crop_scale_min: float = 0.08  # inception crop area range lower bound
    hflip: bool = True  # random horizontal flip in training
    randaug_layers: int = 0  # RandAugment ops per training image, after crop and flip; 0 = off (AugReg: 2)
    randaug_magnitude: float = 10.0  # RandAugment magnitude on its 0..10 scale; AugReg goes to 20 (docs/augreg.md)
    # The official code normalises to [-1, 1]: (x/255 - 0.5) / 0.5 on the device.
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)  # per channel, with mean above


@dataclass
class ModelConfig:
    """The ViT: a variant string plus the head and regularisation choices."""

    variant: str = "B/16"  # Ti|S|B|L|H/<patch>, hybrids (R50+B/16), pico/8; `vitp model VARIANT`
    num_classes: int = 1000  # classifier outputs
    pool: Literal["cls", "gap"] = "cls"  # image representation: class token, or global average pool
    # "pretrain": tanh pre-logits (width D) + linear; "finetune": zero-init linear only.
    head: Literal["pretrain", "finetune"] = "pretrain"
    representation_size: Optional[int] = None  # pre-logits width; None = model width D
    dropout: float = 0.0  # after the embedding and in the MLPs
    attn_dropout: float = 0.0  # on the attention weights
    # stochastic depth: the last block's rate of dropping a residual branch per sample in training,
    # linear from 0 at the first block (the `sd_` of AugReg's checkpoint names)
    drop_path: float = 0.0
    head_bias: float = 0.0  # a new head's initial bias; sigmoid loss from scratch: about -log(classes)
    grad_checkpointing: bool = False  # recompute each block in backward (activation memory)
    # a hybrid's (R50+B/16, ...) weight standardisation and GroupNorm epsilons: "bit" as the
    # official code, "timm" as timm's hybrids (set by `vitp import` from the weights' source)
    resnet_norm: Literal["bit", "timm"] = "bit"


@dataclass
class OptimConfig:
    """Optimizer and LR schedule. Defaults: the paper's pre-training Adam recipe."""

    name: Literal["adamw", "sgd"] = "adamw"  # optimizer (sgd: momentum, the paper's fine-tuning)
    lr: float = 1e-3  # peak learning rate, reached after warmup_steps
    beta1: float = 0.9  # Adam first-moment decay
    beta2: float = 0.999  # Adam second-moment decay
    weight_decay: float = 0.03  # decoupled; not on biases, norms, pos-embed, class token
    momentum: float = 0.9  # sgd only
    grad_clip: float = 1.0  # global-norm clip; 0 disables
    warmup_steps: int = 10_000  # linear warm-up from 0 to lr
    schedule: Literal["linear", "cosine", "constant"] = "linear"  # decay after warm-up
    min_lr_ratio: float = 0.0  # decay ends at lr * min_lr_ratio
    # layer-wise LR decay (fine-tuning): block i of L gets lr x layer_decay^(L - i), the embedding
    # lr x layer_decay^(L + 1), the final norm and head lr; 1 = off (BEiT/MAE use 0.65-0.75)
    layer_decay: float = 1.0
    head_lr_mult: float = 1.0  # the head's LR (and its pre-logits') is lr x this


@dataclass
class ParallelConfig:
    """Data parallelism across Ray Train workers and the DeepSpeed ZeRO settings."""

    num_workers: int = 8  # workers to run (the most, with min_workers)
    min_workers: int = 0  # >0: elastic, Train runs with min_workers..num_workers as nodes come and go
    use_gpu: bool = True  # false: CPU workers (gloo), as in the tests and debug recipes
    cpus_per_worker: float = 8.0  # Ray resources each Train worker reserves
    gpus_per_worker: float = 1.0  # GPUs each Train worker reserves (with use_gpu)
    # seconds a run waits for the cluster to place its workers (num_workers bundles of cpus_per_worker,
    # gpus_per_worker) before it fails naming what is missing; room for an autoscaler; 0 = wait forever
    placement_timeout_s: float = 1800.0
    global_batch: int = 4096  # images per optimizer step, over all workers
    micro_batch: int = 64  # per worker per forward/backward
    grad_accum: int = 8  # global_batch = micro_batch * grad_accum * num_workers
    zero_stage: int = 1  # DeepSpeed ZeRO: 0 off, 1 optimizer, 2 + gradients, 3 + parameters partitioned
    offload_optimizer: bool = False  # ZeRO optimizer state (and step) on the CPU
    offload_params: bool = False  # ZeRO-3 only
    precision: Literal["bf16", "fp16", "fp32"] = "bf16"  # compute dtype; master weights stay fp32


@dataclass
class TrainConfig:
    """Length, cadence, checkpoints and fault tolerance of a training run."""

    steps: int = 90_000  # optimizer steps
    pause_at: int = 0  # >0: stop at this step with a checkpoint (continue later); schedule unchanged
    log_every: int = 50  # steps between progress lines and MLflow metrics
    eval_every: int = 0  # 0 = only at the end
    checkpoint_every: int = 1000  # steps between checkpoints; 0 = at the end only
    keep_checkpoints: int = 2  # newest complete checkpoints kept in storage; 0 = all
    keep_every: int = 0  # also keep every M-th checkpoint (step a multiple of M x checkpoint_every); 0 = none
    seed: int = 0  # model init, data order and augmentation
    max_failures: int = 3  # Ray Train worker-group restarts before the run fails (preemptions aside)
    nonfinite_patience: int = 3  # consecutive non-finite steps (skipped) before a rollback
    nan_drill: str = ""  # fault drill: steps whose loss is made NaN, e.g. "7" or "7-30"
    record_samples: bool = False  # each rank's sample keys per step -> <run>/samples/ (audit)
    resume: Literal["auto", "never", "must"] = "auto"  # same run name: continue from its newest checkpoint?
    init_from: str = ""  # fine-tuning source: checkpoint dir, exported weights, or "" = scratch
    device_peak_tflops: float = 989.0  # for MFU: H100/H200 dense bf16 989, A100 312
    compile: bool = False  # torch.compile the model (DeepSpeed's engine.compile, inductor backend)
    # "classify": cross-entropy on the labels; "mpp": masked patch prediction (paper 4.6), no
    # labels used (an unlabelled corpus is a valid source); val/top1 is then per corrupted patch
    objective: Literal["classify", "mpp"] = "classify"
    # >0: every N steps a snapshot of the weights is few-shot evaluated off the training path
    # (eval/probe.py); metrics fewshot/<dataset>_<k>shot_top1 at the snapshot's step
    fewshot_every: int = 0
    # preprocessed shard dirs (path or URI), or names of <work_dir>/shards/<name> (vitp preprocess)
    fewshot_datasets: tuple[str, ...] = ("digits",)
    # a named AugReg setting (none, light0-2, medium1-2, strong1-2): sets data.randaug_layers/magnitude
    # and train.mixup_alpha from its table (docs/augreg.md); "" = those keys as they are set
    augreg: str = ""
    mixup_alpha: float = 0.0  # Mixup: each micro-batch mixed with itself rolled by one, lambda ~ Beta(a, a); 0 = off
    cutmix_alpha: float = 0.0  # CutMix: a box of the rolled micro-batch pasted in; with Mixup, one of the two per micro-batch
    label_smoothing: float = 0.0  # this much target mass spread evenly over the classes (before mixing)
    # "softmax": cross-entropy; "sigmoid": a binary cross-entropy per class, summed (big_vision's ImageNet-21k loss)
    loss: Literal["softmax", "sigmoid"] = "softmax"
    # weight EMA: each rank averages its own fp32 master fragments after every step (ema.py), saved with
    # the checkpoint; `vitp export --weights ema` exports it. 0 = off (timm 0.9998, DeiT 0.99996)
    ema_decay: float = 0.0
    fewshot_weights: Literal["model", "ema"] = "model"  # what the few-shot probes score (ema: needs ema_decay)


@dataclass
class TuneConfig:
    """Ray Tune sweep over dotted config keys."""

    # per key a list ({"optim.lr": [0.001, 0.003]}) or a distribution ("loguniform(1e-4, 1e-1)"): vitp/tune/space.py
    space: dict[str, Any] = field(default_factory=dict)
    search: Literal["grid", "random", "optuna"] = "grid"  # grid, random or Optuna TPE (model-based)
    num_samples: int = 1  # random/optuna: trials; grid: samples of the distributions per grid point
    seed: int = 0  # the searcher's seed: the same seed draws the same trials
    startup_trials: int = 5  # optuna: random trials before its model proposes
    # asha: stop poor trials early, at evaluations; hyperband: the same in brackets, pausing trials
    # and resuming them from checkpoints; pbt: population-based training, perturbing the space's
    # numeric keys of vitp/tune/population.py MUTABLE
    scheduler: Literal["none", "asha", "hyperband", "pbt"] = "none"
    perturbation_interval: int = 0  # pbt: steps between exploits (a multiple of train.eval_every); 0 = eval_every
    metric: str = "val/top1"  # what the search optimises and the best trial is chosen by
    mode: Literal["max", "min"] = "max"  # whether a higher or a lower metric is better
    max_concurrent_trials: int = 0  # 0 = derived from cluster resources
    trial_retries: int = 1  # retries of a trial that failed (never for a user error)


@dataclass
class TrackingConfig:
    """MLflow: where runs go and how they are named."""

    uri: str = ""  # "" = sqlite:///<work_dir>/mlflow.db
    experiment: str = "vit-pipeline"  # MLflow experiment the runs go to
    run_name: str = ""  # "" = <run_prefix>-<variant>-<dataset>, or that with a settings hash (train/rerun.py)
    run_prefix: str = ""  # first part of a derived run name; "" = the recipe (an experiment file: its stem)
    tags: dict[str, str] = field(default_factory=dict)  # extra MLflow run tags
    log_timeout_s: float = 5.0  # longest a training step waits on MLflow; the rest is spooled
    spool_max_mb: float = 512.0  # most unsent metrics a run's spool keeps while MLflow is down
    system_metrics: bool = True  # CPU, memory (GPU when present) of rank 0's node, at each log step


@dataclass
class ExperimentConfig:
    """Everything one command needs. `recipe` names the function in vitp/recipes/ it came from."""

    recipe: str = "custom"  # set by the recipe; part of the run name
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
        """THE run-name formula (MLflow run, Ray Train run directory): `<recipe>-<variant>-<source>`
        (`tracking.run_prefix` in place of the recipe when set), plus `-mpp` for masked patch
        prediction (so it never resumes a classification run)."""
        if self.tracking.run_name:
            return self.tracking.run_name
        mpp = "-mpp" if self.train.objective == "mpp" else ""
        prefix = self.tracking.run_prefix or self.recipe
        return f"{prefix}-{self.model.variant.replace('/', '')}-{self.data.source}{mpp}"

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
