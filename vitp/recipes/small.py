"""The debug and demo recipes: production recipes shrunk to run in a minute (debug) or a few (the demo)
on 2 CPU cores, never the other way round. Must not import torch or ray.
"""
from __future__ import annotations

from dataclasses import replace

from ..config import ExperimentConfig
from .production import b16_i21k, finetune_cifar10


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
