"""Named recipes: Python functions returning an ExperimentConfig, each docstring giving the command
that runs it, the hardware, and what to expect (numbers from the paper / official code, see
docs/paper.md; where we chose, the docstring says so). Production recipes are written out in full;
debug and demo recipes shrink one, never the other way round. Must not import torch or ray.
"""
from __future__ import annotations

import math
import re
from dataclasses import replace
from typing import Callable, Sequence

from .config import (ConfigError, DataConfig, ExperimentConfig, ModelConfig, OptimConfig,
                     ParallelConfig, TrackingConfig, TrainConfig, TuneConfig, apply_overrides,
                     derive_grad_accum, set_values, validate)
from .config.files import is_experiment_file, parse_experiment

# Dataset facts used by the presets: (classes, training images).
IMAGENET21K = (21_843, 14_197_122)
DOWNSTREAM = {
    "cifar10": (10, 50_000),
    "cifar100": (100, 50_000),
    "pets": (37, 3_680),
    "flowers": (102, 2_040),
    "imagenet": (1000, 1_281_167),
    "digits": (10, 1_797),
}


def _epochs_to_steps(epochs: float, images: int, batch: int) -> int:
    return int(math.ceil(epochs * images / batch))


# ------------------------------------------------------------------------- pre-training


def _pretrain_i21k(variant: str, recipe: str, workers: int, micro: int, zero: int,
                   lr: float) -> ExperimentConfig:
    """ImageNet-21k pre-training, 90 epochs at 224 (paper Table 3 / official code)."""
    classes, images = IMAGENET21K
    batch = 4096
    return ExperimentConfig(
        recipe=recipe,
        work_dir=f"work/{recipe}",
        data=DataConfig(source="parquet", path="", image_size=224, storage_size=256,
                        num_classes=classes, val_fraction=0.02, shard_mb=256,
                        augment="inception_crop", crop_scale_min=0.08),
        model=ModelConfig(variant=variant, num_classes=classes, head="pretrain", dropout=0.1),
        optim=OptimConfig(name="adamw", lr=lr, beta1=0.9, beta2=0.999, weight_decay=0.03,
                          grad_clip=1.0, warmup_steps=10_000, schedule="linear"),
        parallel=ParallelConfig(num_workers=workers, use_gpu=True, cpus_per_worker=8.0,
                                gpus_per_worker=1.0, global_batch=batch, micro_batch=micro,
                                grad_accum=batch // (micro * workers), zero_stage=zero,
                                precision="bf16"),
        train=TrainConfig(steps=_epochs_to_steps(90, images, batch), log_every=50, eval_every=5000,
                          checkpoint_every=2000, keep_checkpoints=3, max_failures=3,
                          device_peak_tflops=989.0),
        tracking=TrackingConfig(experiment="vit-pipeline"),
    )


def b16_i21k() -> ExperimentConfig:
    """ViT-B/16 on ImageNet-21k, 90 epochs (paper Table 3: Adam, lr 1e-3, wd 0.03, batch 4096).

    Run:      vitp pretrain b16_i21k --set data.shards=s3://BUCKET/imagenet21k-shards
    Hardware: 8 x H100/H200 (one node), micro-batch 128 x accum 4, ZeRO-1, bf16.
    Expect:   ~312k steps; fine-tuned at 384 the paper reports ImageNet 84.0 top-1 for this
              pre-training (B/16 is ~35 GFLOPs/img at 224, so 3 x 35.2 x 4096 x 312k = 135 EFLOPs).
    """
    return _pretrain_i21k("B/16", "b16_i21k", workers=8, micro=128, zero=1, lr=1e-3)


def l16_i21k() -> ExperimentConfig:
    """ViT-L/16 on ImageNet-21k, 90 epochs (paper Table 3: Adam, lr 1e-3, wd 0.03, batch 4096).

    Run:      vitp pretrain l16_i21k --set data.shards=s3://BUCKET/imagenet21k-shards
    Hardware: 16 x H100/H200 (two nodes), micro-batch 64 x accum 4, ZeRO-1, bf16.
    Expect:   paper Table 2 (0.23k TPUv3-core-days): ImageNet 85.30, CIFAR-10 99.15,
              CIFAR-100 93.25, Pets 94.67, Flowers 99.61 after fine-tuning at 384.
    """
    return _pretrain_i21k("L/16", "l16_i21k", workers=16, micro=64, zero=1, lr=1e-3)


def h14_i21k() -> ExperimentConfig:
    """ViT-H/14 on ImageNet-21k, 90 epochs (Adam, wd 0.03, batch 4096).

    Run:      vitp pretrain h14_i21k --set data.shards=s3://BUCKET/imagenet21k-shards
    Hardware: 32 x H100/H200 (four nodes), micro-batch 64 x accum 2, ZeRO-2, bf16
              (model states 2P + 14P/N = 1.5 GB/GPU; ~358 MB activations per image).
    Expect:   the paper pre-trains H/14 on JFT only; we use its JFT learning rate for H (3e-4,
              our choice) with the ImageNet-21k weight decay. Forward 334.8 GFLOPs/img at 224.
    """
    return _pretrain_i21k("H/14", "h14_i21k", workers=32, micro=64, zero=2, lr=3e-4)


# -------------------------------------------------------------------------- fine-tuning


def _finetune(dataset: str, recipe: str, steps: int, warmup: int) -> ExperimentConfig:
    """Fine-tuning of a B/16 at 384 (official code: SGD momentum 0.9, no weight decay, cosine,
    global-norm clip 1, batch 512), sweeping the learning rate over the paper's grid."""
    classes, _ = DOWNSTREAM.get(dataset, (1000, 0))  # imagefolder: the user sets num_classes
    return ExperimentConfig(
        recipe=recipe,
        work_dir=f"work/{recipe}",
        data=DataConfig(source=dataset, path="", image_size=384, storage_size=416,
                        num_classes=classes, val_fraction=0.02, shard_mb=256,
                        augment="inception_crop", crop_scale_min=0.08),
        model=ModelConfig(variant="B/16", num_classes=classes, head="finetune", dropout=0.0),
        optim=OptimConfig(name="sgd", lr=0.003, momentum=0.9, weight_decay=0.0, grad_clip=1.0,
                          warmup_steps=warmup, schedule="cosine"),
        parallel=ParallelConfig(num_workers=8, use_gpu=True, cpus_per_worker=8.0,
                                gpus_per_worker=1.0, global_batch=512, micro_batch=64,
                                grad_accum=1, zero_stage=1, precision="bf16"),
        train=TrainConfig(steps=steps, log_every=50, eval_every=max(steps // 10, 50),
                          checkpoint_every=max(steps // 5, 100), keep_checkpoints=1,
                          max_failures=3, device_peak_tflops=989.0),
        tune=TuneConfig(space={"optim.lr": [0.001, 0.003, 0.01, 0.03]}, search="grid"),
        tracking=TrackingConfig(experiment="vit-pipeline"),
    )


def finetune_cifar10() -> ExperimentConfig:
    """Fine-tune on CIFAR-10 (python batches) at 384: SGD 0.9, cosine, warm-up 500, 10k steps.

    Run:      vitp finetune finetune_cifar10 --from CKPT --set data.path=/data/cifar-10-batches-py
    Hardware: 8 x H100/H200; global batch 512.
    Expect:   paper Table 2: 99.15 (L/16 from ImageNet-21k), 99.42 (L/16 JFT), 99.50 (H/14 JFT).
    """
    return _finetune("cifar10", "finetune_cifar10", steps=10_000, warmup=500)


def finetune_cifar100() -> ExperimentConfig:
    """Fine-tune on CIFAR-100 at 384: SGD 0.9, cosine, warm-up 500, 10k steps, batch 512.

    Run:      vitp finetune finetune_cifar100 --from CKPT --set data.path=/data/cifar-100-python
    Hardware: 8 x H100/H200.
    Expect:   paper Table 2: 93.25 (L/16 ImageNet-21k), 93.90 (L/16 JFT), 94.55 (H/14 JFT).
    """
    return _finetune("cifar100", "finetune_cifar100", steps=10_000, warmup=500)


def finetune_pets() -> ExperimentConfig:
    """Fine-tune on Oxford-IIIT Pets at 384: SGD 0.9, cosine, warm-up 100, 500 steps.

    Run:      vitp finetune finetune_pets --from CKPT --set data.path=/data/oxford-iiit-pet
    Hardware: 8 x H100/H200 (a single GPU also works: --set parallel.num_workers=1
              --set parallel.grad_accum=8).
    Expect:   paper Table 2: 94.67 (L/16 ImageNet-21k), 97.32 (L/16 JFT), 97.56 (H/14 JFT).
    """
    return _finetune("pets", "finetune_pets", steps=500, warmup=100)


def finetune_flowers() -> ExperimentConfig:
    """Fine-tune on Oxford Flowers-102 at 384: SGD 0.9, cosine, warm-up 100, 500 steps.

    Run:      vitp finetune finetune_flowers --from CKPT --set data.path=/data/flowers102
    Hardware: 8 x H100/H200.
    Expect:   paper Table 2: 99.61 (L/16 ImageNet-21k), 99.74 (L/16 JFT), 99.68 (H/14 JFT).
    """
    return _finetune("flowers", "finetune_flowers", steps=500, warmup=100)


def finetune_imagenet() -> ExperimentConfig:
    """Fine-tune on ImageNet-1k (ImageFolder train/ val/) at 384: warm-up 500, 20k steps.

    Run:      vitp finetune finetune_imagenet --from CKPT --set data.path=/data/imagenet
    Hardware: 8 x H100/H200.
    Expect:   paper Table 2: 85.30 (L/16 ImageNet-21k), 87.76 (L/16 JFT), 88.55 (H/14 JFT).
    """
    return _finetune("imagenet", "finetune_imagenet", steps=20_000, warmup=500)


def finetune_imagefolder() -> ExperimentConfig:
    """Fine-tune on any ImageFolder tree (root/<class>/<image>) at 384, VTAB-style 2.5k steps.

    Run:      vitp finetune finetune_imagefolder --from CKPT --set data.path=/data/mine
              --set data.num_classes=K --set model.num_classes=K
    Hardware: 8 x H100/H200.
    Expect:   depends on the data; the paper's VTAB protocol uses 2.5k steps.
    """
    return _finetune("imagefolder", "finetune_imagefolder", steps=2_500, warmup=200)


# ------------------------------------------------------------------------- debug, demo


def _shrink(cfg: ExperimentConfig, recipe: str) -> ExperimentConfig:
    """A production recipe cut down to run in about a minute on 2 CPU cores: a 2-layer ViT
    ("pico/8") on 10 classes at 32 px, 2 Ray Train workers (gloo, fp32), 60 steps with 5 of
    warm-up, small shards. The data source and the rest of the optimizer stay the production
    recipe's."""
    return replace(
        cfg,
        recipe=recipe,
        work_dir="work/debug",
        data=replace(cfg.data, path="", image_size=32, storage_size=40, num_classes=10,
                     val_fraction=0.1, shard_mb=4, crop_scale_min=0.35,
                     synth_classes=10, synth_images_per_class=64),
        model=replace(cfg.model, variant="pico/8", num_classes=10, dropout=0.0),
        optim=replace(cfg.optim, warmup_steps=5),
        parallel=replace(cfg.parallel, num_workers=2, use_gpu=False, cpus_per_worker=1.0,
                         gpus_per_worker=0.0, global_batch=32, micro_batch=16, grad_accum=1,
                         precision="fp32"),
        train=replace(cfg.train, steps=60, log_every=5, eval_every=20, checkpoint_every=20,
                      keep_checkpoints=2, max_failures=1, device_peak_tflops=1.0),
        tracking=replace(cfg.tracking, experiment="vit-pipeline-debug"),
    )


def debug() -> ExperimentConfig:
    """Tiny end-to-end pre-training: every code path in seconds (b16_i21k, shrunk).

    Run:      vitp pretrain debug
    Hardware: 2 CPU cores, no GPU (2 Ray Train workers, gloo, DeepSpeed ZeRO-2, fp32).
    Expect:   a 2-layer width-64 ViT ("pico/8", 32x32 px) on a 10-class synthetic fractal corpus;
              loss falls from ln(10) = 2.30 within 60 steps; ~1 min including Ray start-up.
    """
    cfg = _shrink(b16_i21k(), "debug")
    return replace(
        cfg,
        data=replace(cfg.data, source="synthetic"),
        optim=replace(cfg.optim, weight_decay=0.1),
        parallel=replace(cfg.parallel, zero_stage=2),
    )


def debug_finetune() -> ExperimentConfig:
    """Tiny fine-tuning on scikit-learn's bundled digits at 48 px (finetune_cifar10, shrunk).

    Run:      vitp finetune debug_finetune --from work/debug/export   (or --from scratch)
    Hardware: 2 CPU cores, no GPU.
    Expect:   digits (8x8 greyscale, upscaled) at 48 px, position embedding resampled from
              the 32 px pre-training grid (4x4 -> 6x6); logits exactly 0 at step 0; top-1 ~0.8-0.9
              after 200 steps (chance 0.1), ~1 min including Ray start-up.
    """
    cfg = _shrink(finetune_cifar10(), "debug_finetune")
    return replace(
        cfg,
        data=replace(cfg.data, source="digits", image_size=48, storage_size=48, val_fraction=0.2,
                     augment="random_crop"),
        optim=replace(cfg.optim, lr=0.1, warmup_steps=10),
        parallel=replace(cfg.parallel, zero_stage=0),
        train=replace(cfg.train, steps=200, log_every=20, eval_every=100, checkpoint_every=0),
        tune=replace(cfg.tune, space={"optim.lr": [0.03, 0.1]}),
    )


def demo() -> ExperimentConfig:
    """The `make demo` pre-training: a pico/8 ViT on 100 fractal classes with ZeRO-2.

    Run:      vitp demo   (or: vitp pretrain demo)
    Hardware: 2 CPU cores, no GPU (2 Ray Train workers, gloo, DeepSpeed ZeRO-2, fp32).
    Expect:   100 classes x 100 fractals at 32 px, each drawn at a random pose, 600 steps of
              batch 256 (~15 epochs): loss from ln(100) = 4.6 to ~3.4; under 1.5 minutes on 2 cores.
              Our choice (docs/demo.md): batch 256 trained at 1.5-3x batch 64's images/s here
              (DeepSpeed's per-step overhead dominates a model this small).
    """
    cfg = debug()
    return replace(
        cfg,
        recipe="demo",
        work_dir="work/demo",
        data=replace(cfg.data, synth_classes=100, synth_images_per_class=100, num_classes=100,
                     val_fraction=0.05),
        model=replace(cfg.model, num_classes=100),
        optim=replace(cfg.optim, lr=4e-3, warmup_steps=20),
        parallel=replace(cfg.parallel, global_batch=256, micro_batch=128),
        train=replace(cfg.train, steps=600, log_every=50, eval_every=300, checkpoint_every=300),
        tracking=replace(cfg.tracking, experiment="vit-pipeline-demo"),
    )


def demo_finetune() -> ExperimentConfig:
    """The `make demo` transfer to another domain: digits at 32 px, pre-trained or from scratch.

    Run:      vitp demo   (or: vitp sweep demo_finetune --from work/demo/export --from scratch)
    Hardware: 2 CPU cores, no GPU.
    Expect:   the paper's SGD transfer recipe (lr 0.03) for 200 steps of batch 32. The demo runs
              only its reference and few-shot rows: a linear classifier on the raw pixels gets 0.970
              on these 8x8 images, a 25-shot probe of the fractal features about 0.3 (features of
              another domain; docs/demo.md, docs/results/).
    """
    cfg = debug_finetune()
    return replace(cfg, recipe="demo_finetune", work_dir="work/demo",
                   data=replace(cfg.data, image_size=32, storage_size=36, hflip=False),
                   optim=replace(cfg.optim, lr=0.03),
                   train=replace(cfg.train, eval_every=100),
                   parallel=replace(cfg.parallel, num_workers=1, micro_batch=32),
                   tune=replace(cfg.tune, space={}),
                   tracking=replace(cfg.tracking, experiment="vit-pipeline-demo"))


def demo_fractals() -> ExperimentConfig:
    """The `make demo` transfer within the domain: 10 fractal classes never seen in pre-training.

    Run:      vitp demo   (or: vitp sweep demo_fractals --from work/demo/export --from scratch)
    Hardware: 2 CPU cores, no GPU.
    Expect:   10 classes drawn with another corpus seed (synth_seed 1), 100 images each, half
              held out; with 20% of the train split (~10 images a class) top-1 about 0.4 from the
              demo pre-training vs 0.25 from scratch (docs/demo.md, measured in docs/results/).
    """
    cfg = demo_finetune()
    return replace(cfg, recipe="demo_fractals",
                   data=replace(cfg.data, source="synthetic", synth_seed=1, synth_classes=10,
                                synth_images_per_class=100, num_classes=10, val_fraction=0.5,
                                hflip=True))


RECIPES: dict[str, Callable[[], ExperimentConfig]] = {
    f.__name__: f
    for f in (
        debug, debug_finetune, demo, demo_finetune, demo_fractals, b16_i21k, l16_i21k, h14_i21k, finetune_cifar10, finetune_cifar100,
        finetune_pets, finetune_flowers, finetune_imagenet, finetune_imagefolder,
    )
}


def get_recipe(name: str) -> ExperimentConfig:
    """The named recipe's config; ConfigError listing the names if it does not exist."""
    if is_experiment_file(name):
        return with_overrides(name)
    if name not in RECIPES:
        raise ConfigError(f"unknown recipe {name!r}; recipes: {', '.join(RECIPES)}")
    return RECIPES[name]()


# `--set RECIPE:KEY=VALUE`: an override for one recipe of a command that runs several (a sweep's
# --datasets, a job spec's chain). KEY=VALUE alone goes to all of them. A value may hold ':'
# (s3://...): the prefix is a bare name before the first ':', with no '=' or '.' in it.
_SCOPED = re.compile(r"^([A-Za-z0-9_]+):([^=]+=.*)$")


def scoped(item: str) -> tuple[str | None, str]:
    """(recipe, "KEY=VALUE") of a `--set` item; recipe None when it names none."""
    m = _SCOPED.match(item)
    return (m.group(1), m.group(2)) if m else (None, item)


def overrides_for(recipe: str, overrides: list[str] | tuple[str, ...]) -> list[str]:
    """The `--set` items that apply to `recipe`: the unscoped ones and its own `recipe:KEY=VALUE`."""
    return [kv for r, kv in map(scoped, overrides) if r in (None, recipe)]


# Keys every trial of a sweep shares: one value for the whole sweep, never per recipe.
SWEEP_WIDE = ("tune.", "tracking.", "work_dir")


def check_scoped(overrides: Sequence[str], recipes: Sequence[str]) -> None:
    """ConfigError for a `--set RECIPE:KEY=VALUE` whose recipe the sweep does not run, or whose
    key is one the whole sweep shares."""
    from .tracking.redact import redact_text  # lazy: mlflow

    for item in overrides:
        recipe, kv = scoped(item)
        if recipe is None:
            continue
        if recipe not in recipes:
            raise ConfigError(f"--set {redact_text(item)}: the sweep runs no recipe {recipe!r}; its recipes: "
                              f"{', '.join(recipes)}")
        if kv.partition("=")[0].strip().startswith(SWEEP_WIDE):
            raise ConfigError(f"--set {redact_text(item)}: {kv.partition('=')[0].strip()} is the same for every "
                              f"trial of a sweep: give it without '{recipe}:'")


def with_overrides(name: str, overrides: list[str] | tuple[str, ...] = ()) -> ExperimentConfig:
    """Recipe (or an experiment file: config/files.py) + `--set` overrides, NOT validated (for
    callers that change it further first); a worker count or micro-batch set without grad_accum
    gets the accumulation that keeps the batch."""
    if is_experiment_file(name):
        from . import storage  # lazy: pyarrow, for a file on object storage

        base, changes = parse_experiment(storage.read_bytes(name).decode("utf-8", "replace"), name)
        cfg, changed = set_values(get_recipe(base), changes), set(changes)
    else:
        cfg, changed = get_recipe(name), set()
    cfg = apply_overrides(cfg, list(overrides))
    return derive_grad_accum(cfg, changed | {o.split("=", 1)[0].strip() for o in overrides})


def resolve(name: str, overrides: list[str] | tuple[str, ...] = (), check_paths: bool = True) -> ExperimentConfig:
    """Recipe + `--set` overrides, validated, local paths absolute: what every command starts from."""
    return validate(with_overrides(name, overrides), check_paths=check_paths)
