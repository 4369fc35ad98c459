"""The named AugReg settings (Steiner et al. 2021, "How to train your ViT?") and the augmentation a config
asks for: `train.augreg=NAME` gives RandAugment's (layers, magnitude) and Mixup's alpha from the table
below, else the keys as set. Sources and the one inference are in docs/augreg.md. Must not import torch.
"""
from __future__ import annotations

from typing import NamedTuple


class AugRegSetting(NamedTuple):
    randaug_layers: int
    randaug_magnitude: float
    mixup_alpha: float


# big_vision configs/vit_i1k.py (RANDAUG_DEF, MIXUP_DEF; the same in vit_i21k.py). "light0" is the name
# the released checkpoints' index gives the lightest RandAugment setting; big_vision calls it light1.
AUGREG: dict[str, AugRegSetting] = {
    "none": AugRegSetting(0, 0.0, 0.0),
    "light0": AugRegSetting(2, 0.0, 0.0),
    "light1": AugRegSetting(2, 0.0, 0.0),
    "light2": AugRegSetting(2, 10.0, 0.2),
    "medium1": AugRegSetting(2, 15.0, 0.2),
    "medium2": AugRegSetting(2, 15.0, 0.5),
    "strong1": AugRegSetting(2, 20.0, 0.5),
    "strong2": AugRegSetting(2, 20.0, 0.8),
}
# The keys a named setting sets, with the schema's defaults (a named setting with any of them changed
# is refused: which one was meant is not ours to guess).
SET_BY_NAME = {"data.randaug_layers": 0, "data.randaug_magnitude": 10.0, "train.mixup_alpha": 0.0}


def augreg_of(cfg) -> AugRegSetting:
    """What `cfg` trains with: the named setting's values, or the keys as set."""
    if cfg.train.augreg:
        return AUGREG[cfg.train.augreg]
    return AugRegSetting(cfg.data.randaug_layers, cfg.data.randaug_magnitude, cfg.train.mixup_alpha)


def randaug_of(cfg) -> tuple[int, float]:
    a = augreg_of(cfg)
    return a.randaug_layers, a.randaug_magnitude


def augreg_problems(cfg) -> list[str]:
    """A named setting beside a key it sets; augmentation that cannot apply."""
    problems = []
    if cfg.train.augreg and cfg.train.augreg not in AUGREG:
        return [f"train.augreg={cfg.train.augreg!r}: choose one of {', '.join(AUGREG)} (docs/augreg.md), "
                "or '' to set data.randaug_layers/magnitude and train.mixup_alpha yourself"]
    if cfg.train.augreg:
        values = {"data.randaug_layers": cfg.data.randaug_layers, "data.randaug_magnitude": cfg.data.randaug_magnitude,
                  "train.mixup_alpha": cfg.train.mixup_alpha}
        changed = [f"{k}={v}" for k, v in values.items() if v != SET_BY_NAME[k]]
        if changed:
            problems.append(f"train.augreg={cfg.train.augreg} sets {', '.join(SET_BY_NAME)} and {', '.join(changed)} "
                            "is set too: leave those keys out, or set train.augreg='' and set them yourself")
    if cfg.train.fewshot_weights == "ema" and not cfg.train.ema_decay:
        problems.append("train.fewshot_weights=ema needs a weight EMA: set train.ema_decay (e.g. 0.9998)")
    mixes = augreg_of(cfg).mixup_alpha > 0 or cfg.train.cutmix_alpha > 0
    if cfg.train.objective == "mpp" and (mixes or cfg.train.label_smoothing or cfg.train.loss != "softmax"):
        problems.append("train.objective=mpp predicts patch colours, not labels: Mixup, CutMix, label smoothing "
                        "and train.loss=sigmoid do not apply; leave them at their defaults")
    return problems
