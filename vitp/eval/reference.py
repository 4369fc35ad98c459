"""A reference a reader knows: a linear classifier (scikit-learn's logistic regression) on the raw
pixels of a dataset's shards, scored on the same val split the fine-tuning runs are.

The pixels are read and fitted in one Ray task, never on the driver; the result is an MLflow
run (source "pixels", kind "reference") that `vitp compare` lists beside the fine-tuning runs.
"""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

from ..config import Run
from ..data.ingest import build_eval_dataset
from ..errors import InputError

SOURCE = "pixels"  # the `source` tag of a reference run: what `vitp compare` shows
MAX_ITER = 2000


def _pixels(run: Run, split: str) -> tuple[np.ndarray, np.ndarray]:
    """(n, S*S*3) float32 in [0, 1], (n,) labels of `split`, in row-key order: the images the
    model is evaluated on (resize + centre crop to data.image_size)."""
    xs, ys, keys = [], [], []
    for b in build_eval_dataset(run, split).iter_batches(batch_size=None, batch_format="numpy"):
        xs.append(b["image"].reshape(len(b["image"]), -1).astype(np.float32) / 255.0)
        ys.append(b["label"])
        keys.append(b["key"].astype(str))
    if not xs:
        raise InputError(f"split {split!r} of the {run.dataset} shards is empty: rerun preprocess")
    order = np.argsort(np.concatenate(keys), kind="stable")
    return np.concatenate(xs)[order], np.concatenate(ys)[order]


def linear_on_pixels(run: Run) -> dict[str, Any]:
    """Fit on the run's train split, score on its val split: {"top1", "train_examples", "val_examples"}.
    Standardised pixels, L2-regularised multinomial logistic regression (scikit-learn defaults)."""
    from sklearn.linear_model import LogisticRegression  # lazy: scikit-learn
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    train_x, train_y = _pixels(run, "train")
    val_x, val_y = _pixels(run, "val")
    clf = make_pipeline(StandardScaler(), LogisticRegression(max_iter=MAX_ITER))
    clf.fit(train_x, train_y)
    return {"top1": float(np.mean(clf.predict(val_x) == val_y)), "train_examples": len(train_y),
            "val_examples": len(val_y)}


def run_reference(run: Run, tags: Optional[dict[str, str]] = None,
                  tracking: bool = True) -> dict[str, Any]:
    """linear_on_pixels in a Ray task (the pixels stay off the driver), logged as the MLflow run
    `reference-pixels-<dataset>[-train<fraction>]` with val/top1 at step 0. A finished run of that
    name and `tags` is reused (the same shards give the same fit): {top1, run_id, reused}."""
    import ray  # lazy: ray

    cfg = run.cfg
    name = f"reference-{SOURCE}-{run.shards_name}"
    d = cfg.data
    run_tags = {"kind": "reference", "source": SOURCE, "dataset": run.dataset,
                "train_fraction": f"{d.train_fraction:g}", "recipe": cfg.recipe, **(tags or {})}
    if tracking:
        from ..tracking import RunLogger, find_runs  # lazy: mlflow (only with tracking)
        from ..tracking.lineage import log_shards, shard_manifest
        from ..tracking.values import source_tags
        from ..tracking.store import quote, tag_filters

        uri = run.tracking_uri
        done = find_runs(uri, cfg.tracking.experiment, " and ".join(
            [f"attributes.run_name = {quote(name)}", "attributes.status = 'FINISHED'",
             *tag_filters(None, run_tags)]), max_results=1)
        if done and "val/top1" in done[0]["metrics"]:
            return {"top1": done[0]["metrics"]["val/top1"], "run_id": done[0]["run_id"], "reused": True}

    result = ray.get(ray.remote(num_cpus=1)(linear_on_pixels).remote(run))
    if not tracking:
        return result
    with RunLogger.start(uri, cfg.tracking.experiment, name, resume_by_name=False,
                         tags={**run_tags, **source_tags("vitp demo")}, background=True,
                         timeout_s=cfg.tracking.log_timeout_s) as logger:
        log_shards(logger.client, logger.run_id, run.shards_name, run.shards, shard_manifest(run.shards), "eval")
        logger.log_params({"reference": {"model": "logistic regression on standardised raw pixels",
                                         "image_size": d.image_size, "max_iter": MAX_ITER,
                                         "train_examples": result["train_examples"],
                                         "val_examples": result["val_examples"]},
                           "data.train_fraction": d.train_fraction, "data.source": d.source})
        logger.log_metrics({"val/top1": result["top1"]}, step=0)
        result["run_id"] = logger.run_id
    return {**result, "reused": False}
