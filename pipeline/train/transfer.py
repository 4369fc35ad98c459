"""Fine-tuning set-up: resolve `--from SOURCE` into the model and tags of a transfer run.

SOURCE is a training checkpoint, an exported or imported weights directory, a weights file, or
"scratch". The architecture comes from the source's stored config; the head is always a fresh
zero-initialised linear layer (the paper's transfer recipe) and position embeddings are
resampled when the fine-tuning resolution differs. No Ray here.
"""
from __future__ import annotations

import json
import os
from typing import Any

from ..config import ExperimentConfig, absolute_paths, apply_overrides, validate


def source_info(source: str) -> dict[str, Any]:
    """What a source says about itself: its config dict (if stored) and MLflow run id."""
    if source == "scratch":
        return {"config": None, "mlflow_run_id": None}
    if not os.path.exists(source):
        raise FileNotFoundError(
            f"--from {source}: no such file or directory; give a checkpoint directory (from "
            "`vitp pretrain`), an export (`vitp export` / `vitp import`), a .safetensors file, or 'scratch'"
        )
    d = source if os.path.isdir(source) else os.path.dirname(source)
    for name in ("config.json", "meta.json"):
        path = os.path.join(d, name)
        if os.path.exists(path):
            with open(path) as f:
                stored = json.load(f)
            if name == "meta.json":
                return {"config": stored.get("config"), "mlflow_run_id": stored.get("mlflow_run_id")}
            extra = stored.pop("_export", {}) or {}
            return {"config": stored, "mlflow_run_id": extra.get("mlflow_run_id")}
    return {"config": None, "mlflow_run_id": None}


def finetune_config(cfg: ExperimentConfig, source: str, overrides: list[str] | tuple[str, ...] = ()) -> tuple[ExperimentConfig, dict[str, str]]:
    """The fine-tuning config for `source` and the MLflow tags that record the lineage.

    The model shape (variant, pooling) is taken from the source so the weights fit; explicit
    `--set model.*` overrides win. Returns (validated config, tags).
    """
    info = source_info(source)
    src_cfg = info["config"]
    sets: list[str] = []
    if src_cfg:
        m = src_cfg.get("model", {})
        sets += [f"model.variant={m['variant']}", f"model.pool={m.get('pool', 'cls')}"]
    sets += ["model.head=finetune", f"train.init_from={'' if source == 'scratch' else os.path.abspath(source)}"]
    cfg = apply_overrides(cfg, sets + list(overrides))  # user overrides last
    src_name = "scratch" if source == "scratch" else os.path.abspath(source)
    if not cfg.tracking.run_name:
        tail = "scratch" if source == "scratch" else "from-" + (src_cfg or {}).get("recipe", "weights")
        cfg = apply_overrides(cfg, [f"tracking.run_name={cfg.recipe}-{cfg.model.variant.replace('/', '')}-{cfg.data.source}-{tail}"])
    tags = {"source": src_name, "source_kind": "scratch" if source == "scratch" else "weights"}
    if info["mlflow_run_id"]:
        tags["source_run_id"] = info["mlflow_run_id"]
    if src_cfg:
        tags["source_image_size"] = str(src_cfg.get("data", {}).get("image_size", ""))
    return absolute_paths(validate(cfg)), tags
