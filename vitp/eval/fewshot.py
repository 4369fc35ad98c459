"""`vitp fewshot`: few-shot linear evaluation of exported weights as its own MLflow run
`fewshot-<source>-<dataset>`. The solver is solver.py, the features features.py (both shared with
the probes during pre-training). Writes MLflow only through `vitp.tracking`; reads sources only
through `vitp.model.weights` / `vitp.train.export`.
"""
from __future__ import annotations

from typing import Any, Sequence

from .. import storage
from ..config import ExperimentConfig, Run
from ..model.weights import SourceInfo, check_source
from .features import extract_features
from .solver import L2, SHOTS, fewshot_accuracy


# ------------------------------------------------------------------------ the MLflow run


def _source_name(weights: str, info: SourceInfo) -> str:
    """The source's run name when its stored config has a recipe, else its file/dir name."""
    if info.recipe:
        try:
            return ExperimentConfig.from_dict(info.config).run_name
        except ValueError:
            return info.recipe
    return storage.basename(weights.rstrip("/")) or "weights"


def run_fewshot(run: Run, weights: str, tracking: bool = True,
                shots: Sequence[int] = SHOTS, seeds: int = 3, l2: float = L2,
                concurrency: int = 1) -> dict[str, Any]:
    """Few-shot top-1 of `weights` (export dir, checkpoint or weights file: an absolute path or a URI,
    as the feature actors run in other working directories) on `run`'s dataset.

    Features of its train split fit the classifier, its val split scores it. With `tracking`,
    a run `fewshot-<source>-<dataset>` gets params, `fewshot/{k}shot_top1` metrics at the
    source's step, and a `source_run_id` tag when the source's export records one.
    Returns {"fewshot/{k}shot_top1": top-1, ..., "run_id": MLflow run id or None}.
    """
    cfg = run.cfg
    src = check_source(weights)  # a wrong file fails here, not in the feature actors
    train_x, train_y = extract_features(weights, run, "train", concurrency=concurrency)
    test_x, test_y = extract_features(weights, run, "val", concurrency=concurrency)
    acc = fewshot_accuracy(train_x, train_y, test_x, test_y, shots=shots, seeds=seeds, l2=l2)
    metrics = {f"fewshot/{k}shot_top1": v for k, v in acc.items()}
    result: dict[str, Any] = {**metrics, "run_id": None}
    if not tracking:
        return result

    from ..tracking import RunLogger  # lazy: mlflow (only with tracking)
    from ..tracking.lineage import log_shards, shard_manifest
    from ..tracking.values import source_tags

    name = f"fewshot-{_source_name(weights, src)}-{run.dataset}"
    tags = {"kind": "fewshot", "source": weights, "dataset": run.dataset,
            **source_tags(f"vitp fewshot {cfg.recipe}")}
    if src.mlflow_run_id:
        tags["source_run_id"] = src.mlflow_run_id
    with RunLogger.start(run.tracking_uri, cfg.tracking.experiment, name, resume_by_name=False,
                         tags=tags, background=True, timeout_s=cfg.tracking.log_timeout_s) as logger:
        log_shards(logger.client, logger.run_id, run.shards_name, run.shards, shard_manifest(run.shards), "eval")
        logger.log_params({"fewshot": {"shots": list(shots), "seeds": seeds, "l2": l2,
                                       "dataset": run.dataset, "shards": cfg.data.shards,
                                       "source": weights,
                                       "feature_dim": int(train_x.shape[1]),
                                       "train_examples": len(train_y), "test_examples": len(test_y)}})
        logger.log_metrics(metrics, step=src.step)
        result["run_id"] = logger.run_id
    return result
