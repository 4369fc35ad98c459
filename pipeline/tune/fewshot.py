"""Few-shot linear evaluation (paper; big_vision `fewshot_lsr`): frozen pre-logit features, one-vs-all
{-1, 1} targets, closed-form L2-regularised least squares, k shots per class, averaged over seeds.
Owns the solver, feature extraction with Ray Data (an actor pool holding the model, CPU) and the
`fewshot-<source>-<dataset>` MLflow run. Writes MLflow only through `pipeline.tracking`; reads
sources only through `pipeline.model.weights` / `pipeline.train.export`.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from ..errors import InputError
from .. import storage
from ..config import ExperimentConfig
from ..data.ingest import build_eval_dataset, dataset_name, normalize, shards_dir, shards_name
from ..model.weights import SourceInfo, read_config, source_info

SHOTS = (1, 5, 10, 25)
L2 = 2.0**10  # the paper's / big_vision's regulariser
BIAS_FEATURE = 100.0  # a constant column this large makes the bias almost unregularised


# ------------------------------------------------------------------------------- solver


def lsr_accuracy(train_x: np.ndarray, train_y: np.ndarray, test_x: np.ndarray, test_y: np.ndarray,
                 num_classes: int, l2: float = L2) -> float:
    """Top-1 of L2-regularised least squares from (n, D) features to one-vs-all {-1, 1} targets.

    Features are standardised with the training set's mean/std, a constant bias column is
    appended, and W solves min |XW - Y|^2 + l2 |W|^2 through the smaller system: primal
    (X^T X + l2 I) W = X^T Y when n >= D+1, dual W = X^T (X X^T + l2 I)^-1 Y otherwise.
    """
    x = np.asarray(train_x, dtype=np.float64)
    t = np.asarray(test_x, dtype=np.float64)
    mean, std = x.mean(axis=0, keepdims=True), x.std(axis=0, keepdims=True) + 1e-5
    x = np.pad((x - mean) / std, ((0, 0), (0, 1)), constant_values=BIAS_FEATURE)  # (n, D+1)
    t = np.pad((t - mean) / std, ((0, 0), (0, 1)), constant_values=BIAS_FEATURE)  # (m, D+1)
    y = 2.0 * np.eye(num_classes)[np.asarray(train_y)] - 1.0  # (n, K) in {-1, 1}
    n, d = x.shape
    if n >= d:
        w = np.linalg.solve(x.T @ x + l2 * np.eye(d), x.T @ y)  # (D+1, K)
    else:
        w = x.T @ np.linalg.solve(x @ x.T + l2 * np.eye(n), y)  # (D+1, K)
    return float(np.mean(np.argmax(t @ w, axis=1) == np.asarray(test_y)))


def fewshot_accuracy(train_x: np.ndarray, train_y: np.ndarray, test_x: np.ndarray,
                     test_y: np.ndarray, shots: Sequence[int] = SHOTS, seeds: int = 3,
                     l2: float = L2) -> dict[int, float]:
    """{shots: mean top-1 over `seeds`}: per seed, `shots` random training examples per class.

    A class with fewer than `shots` training examples contributes all it has (as big_vision).
    """
    train_y, test_y = np.asarray(train_y), np.asarray(test_y)
    if len(train_x) != len(train_y) or len(test_x) != len(test_y):
        raise ValueError(f"features and labels differ in length: train {len(train_x)} vs "
                         f"{len(train_y)}, test {len(test_x)} vs {len(test_y)}")
    num_classes = int(max(train_y.max(), test_y.max())) + 1
    missing = sorted(set(range(num_classes)) - set(train_y.tolist()))
    if missing:
        raise InputError(f"classes {missing[:10]} have no training example: few-shot needs every "
                         "class in the train split (check the shards' split / data.num_classes)")
    acc: dict[int, list[float]] = {k: [] for k in shots}
    for seed in range(seeds):
        rng = np.random.default_rng(seed)
        per_class = [rng.permutation(np.flatnonzero(train_y == c)) for c in range(num_classes)]
        for k in shots:
            idx = np.concatenate([p[:k] for p in per_class])
            acc[k].append(lsr_accuracy(train_x[idx], train_y[idx], test_x, test_y, num_classes, l2))
    return {k: float(np.mean(v)) for k, v in acc.items()}


# ------------------------------------------------------------------- features with Ray Data


class FeatureExtractor:
    """Ray Data map_batches callable (one per actor): uint8 image batches -> pre-logit features.

    Holds the model: loaded from an export/checkpoint path, or received as an object ref.
    """

    def __init__(self, source: Any, mean: Sequence[float], std: Sequence[float], threads: int = 1):
        import ray  # lazy: ray, torch (the solver above needs neither)
        import torch

        from ..train.export import load_model  # lazy: torch, in the actor only

        torch.set_num_threads(threads)  # one actor per CPU: no oversubscription
        if isinstance(source, str):
            self.model = load_model(source)
        else:
            self.model = ray.get(source) if isinstance(source, ray.ObjectRef) else source
        self.model.eval()
        self.mean, self.std = tuple(mean), tuple(std)

    def __call__(self, batch: dict) -> dict:
        import torch  # lazy: torch (in the actor only)

        imgs = torch.from_numpy(np.ascontiguousarray(batch["image"]))  # (B, S, S, 3) uint8
        with torch.no_grad():
            x = normalize(imgs, self.mean, self.std)  # (B, 3, S, S) float32
            f = self.model.forward_head(self.model.forward_features(x), pre_logits=True)  # (B, R)
        return {"features": f.float().numpy(), "label": np.asarray(batch["label"], np.int64),
                "key": np.asarray(batch["key"], dtype=object)}


def _model_image_size(export_dir_or_model) -> int:
    if isinstance(export_dir_or_model, str):
        return read_config(export_dir_or_model).data.image_size
    return int(export_dir_or_model.image_size)


def extract_features(export_dir_or_model, cfg: ExperimentConfig, split: str = "train", *,
                     concurrency: int = 1, batch_size: int = 64,
                     return_keys: bool = False):
    """(features (n, R) float32, labels (n,) int64[, keys]) of `split` of cfg's shards, sorted
    by row key so the result does not depend on Ray's scheduling.

    Images are resized to the model's own resolution (frozen features: no position-embedding
    resampling). Runs `build_eval_dataset` -> map_batches(FeatureExtractor) on an actor pool of
    `concurrency` CPU actors.
    """
    import ray  # lazy: ray (the solver needs none)

    cfg = dataclasses.replace(cfg, data=dataclasses.replace(
        cfg.data, image_size=_model_image_size(export_dir_or_model)))
    source = export_dir_or_model if isinstance(export_dir_or_model, str) else ray.put(export_dir_or_model)
    ds = build_eval_dataset(cfg, split).map_batches(
        FeatureExtractor, fn_constructor_kwargs={"source": source, "mean": cfg.data.mean, "std": cfg.data.std},
        batch_size=batch_size, batch_format="numpy", num_cpus=1,
        compute=ray.data.ActorPoolStrategy(size=concurrency))
    feats, labels, keys = [], [], []
    for b in ds.iter_batches(batch_size=None, batch_format="numpy"):
        feats.append(b["features"])
        labels.append(b["label"])
        keys.append(b["key"])
    if not feats:
        raise InputError(f"split {split!r} of {cfg.data.source} shards is empty: rerun preprocess "
                         "or pick another split")
    keys_all = np.concatenate(keys).astype(str)
    order = np.argsort(keys_all, kind="stable")
    out = (np.concatenate(feats)[order].astype(np.float32), np.concatenate(labels)[order])
    return (*out, keys_all[order]) if return_keys else out


# ------------------------------------------------------------------------ the MLflow run


def _source_name(weights: str, info: SourceInfo) -> str:
    """The source's run name when its stored config has a recipe, else its file/dir name."""
    if info.recipe:
        try:
            return ExperimentConfig.from_dict(info.config).run_name
        except ValueError:
            return info.recipe
    return storage.basename(storage.abspath(weights)) or "weights"


def run_fewshot(cfg: ExperimentConfig, weights: str, tracking: bool = True,
                shots: Sequence[int] = SHOTS, seeds: int = 3, l2: float = L2,
                concurrency: int = 1) -> dict[str, Any]:
    """Few-shot top-1 of `weights` (export dir, checkpoint or weights file) on cfg's dataset.

    Features of cfg's train split fit the classifier, its val split scores it. With `tracking`,
    a run `fewshot-<source>-<dataset>` gets params, `fewshot/{k}shot_top1` metrics at the
    source's step, and a `source_run_id` tag when the source's export records one.
    Returns {"fewshot/{k}shot_top1": top-1, ..., "run_id": MLflow run id or None}.
    """
    weights = storage.abspath(weights)  # the feature actors run in other working directories
    src = source_info(weights)
    train_x, train_y = extract_features(weights, cfg, "train", concurrency=concurrency)
    test_x, test_y = extract_features(weights, cfg, "val", concurrency=concurrency)
    acc = fewshot_accuracy(train_x, train_y, test_x, test_y, shots=shots, seeds=seeds, l2=l2)
    metrics = {f"fewshot/{k}shot_top1": v for k, v in acc.items()}
    result: dict[str, Any] = {**metrics, "run_id": None}
    if not tracking:
        return result

    from ..tracking import RunLogger, resolve_tracking_uri  # lazy: mlflow (only with tracking)
    from ..tracking.lineage import log_shards
    from ..tracking.runs import source_tags

    name = f"fewshot-{_source_name(weights, src)}-{dataset_name(cfg)}"
    tags = {"kind": "fewshot", "source": weights, "dataset": dataset_name(cfg),
            **source_tags(f"vitp fewshot {cfg.recipe}")}
    if src.mlflow_run_id:
        tags["source_run_id"] = src.mlflow_run_id
    with RunLogger.start(resolve_tracking_uri(cfg), cfg.tracking.experiment, name,
                         resume_by_name=False, tags=tags) as logger:
        log_shards(logger.client, logger.run_id, shards_name(cfg), shards_dir(cfg), context="eval")
        logger.log_params({"fewshot": {"shots": list(shots), "seeds": seeds, "l2": l2,
                                       "dataset": dataset_name(cfg), "shards": cfg.data.shards,
                                       "source": weights,
                                       "feature_dim": int(train_x.shape[1]),
                                       "train_examples": len(train_y), "test_examples": len(test_y)}})
        logger.log_metrics(metrics, step=src.step)
        result["run_id"] = logger.run_id
    return result
