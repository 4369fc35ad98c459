"""Fine-tuning set-up: `--from SOURCE` (checkpoint, export, weights file or "scratch", read through
model.weights.source_info) -> the typed config changes and lineage tags of a transfer run: the
source's architecture, a fresh zero-initialised head (the paper's transfer recipe).
Must not validate (the caller does, once), build `--set` strings, or import Ray.
"""
from __future__ import annotations

from typing import Iterable

from ..config import ExperimentConfig, set_values
from ..model.weights import check_source


def finetune_config(cfg: ExperimentConfig, source: str, *,
                    user_keys: Iterable[str] = ()) -> tuple[ExperimentConfig, dict[str, str]]:
    """The fine-tuning config for `source` (NOT validated) and the MLflow tags of its lineage.

    The model shape (variant, pooling) is taken from the source so the weights fit, with a fresh
    `finetune` head and `train.init_from` pointing at the source. A dotted key in `user_keys`
    (what the user `--set`; cfg already holds the value) is left as cfg has it: the user wins.
    An unnamed run is called `<cfg.run_name>-from-<source recipe>` (or `-scratch`).
    """
    info = check_source(source)  # a wrong file fails here, once, not in every worker
    scratch = source == "scratch"
    values = {}
    if info.config:
        model = info.config.get("model", {})
        values.update({"model.variant": model["variant"], "model.pool": model.get("pool", "cls")})
    values.update({"model.head": "finetune", "train.init_from": "" if scratch else info.path})
    skip = set(user_keys)
    cfg = set_values(cfg, {k: v for k, v in values.items() if k not in skip})
    if not cfg.tracking.run_name:
        tail = "scratch" if scratch else "from-" + (info.recipe if info.recipe is not None else "weights")
        cfg = set_values(cfg, {"tracking.run_name": f"{cfg.run_name}-{tail}"})
    tags = {"source": "scratch" if scratch else info.path,
            "source_kind": "scratch" if scratch else "weights"}
    if info.mlflow_run_id:
        tags["source_run_id"] = info.mlflow_run_id
    if info.registered:  # `vitp export --register`: the registered version this run starts from
        tags["source_model"] = f"models:/{info.registered['name']}/{info.registered['version']}"
        tags["source_model_id"] = info.registered["model_id"]
    if info.config:
        tags["source_image_size"] = "" if info.image_size is None else str(info.image_size)
    return cfg, tags
