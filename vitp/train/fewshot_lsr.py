"""Few-shot linear evaluation core (paper; big_vision `fewshot_lsr`): the closed-form L2-regularised
least-squares solver over k shots x seeds, and frozen pre-logit features of a shard split (Ray Data).
Used by `vitp fewshot` (vitp.tune.fewshot) and by the probe during training (fewshot_probe.py).
Must not write MLflow, nor know where the weights came from beyond a model or an export path.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from ..config import ExperimentConfig
from ..data.ingest import build_eval_dataset, normalize
from ..errors import InputError
from ..model.weights import read_config

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


def shot_indices(train_y: np.ndarray, num_classes: int, shots: Sequence[int] = SHOTS,
                 seeds: int = 3) -> dict[tuple[int, int], np.ndarray]:
    """{(seed, shots): training rows}: per seed a per-class permutation drawn with
    np.random.default_rng(seed), its first `shots` rows per class (as big_vision). The rows
    depend on the labels only, so a caller may compute features for their union alone."""
    train_y = np.asarray(train_y)
    out = {}
    for seed in range(seeds):
        rng = np.random.default_rng(seed)
        per_class = [rng.permutation(np.flatnonzero(train_y == c)) for c in range(num_classes)]
        for k in shots:
            out[(seed, k)] = np.concatenate([p[:k] for p in per_class])
    return out


def fewshot_accuracy(train_x: np.ndarray, train_y: np.ndarray, test_x: np.ndarray,
                     test_y: np.ndarray, shots: Sequence[int] = SHOTS, seeds: int = 3,
                     l2: float = L2) -> dict[int, float]:
    """{shots: mean top-1 over `seeds`}: per seed, `shots` random training examples per class.

    A class with fewer than `shots` training examples contributes all it has (as big_vision).
    Only the rows of `shot_indices` are read from train_x.
    """
    train_y, test_y = np.asarray(train_y), np.asarray(test_y)
    if len(train_x) != len(train_y) or len(test_x) != len(test_y):
        raise ValueError(f"features and labels differ in length: train {len(train_x)} vs "
                         f"{len(train_y)}, test {len(test_x)} vs {len(test_y)}")
    num_classes = num_classes_of(train_y, test_y)
    acc: dict[int, list[float]] = {k: [] for k in shots}
    for (_, k), idx in shot_indices(train_y, num_classes, shots, seeds).items():
        acc[k].append(lsr_accuracy(train_x[idx], train_y[idx], test_x, test_y, num_classes, l2))
    return {k: float(np.mean(v)) for k, v in acc.items()}


def num_classes_of(train_y: np.ndarray, test_y: np.ndarray) -> int:
    """Classes the labels span; InputError when one has no training example."""
    num_classes = int(max(np.max(train_y), np.max(test_y))) + 1
    missing = sorted(set(range(num_classes)) - set(np.asarray(train_y).tolist()))
    if missing:
        raise InputError(f"classes {missing[:10]} have no training example: few-shot needs every "
                         "class in the train split (check the shards' split / data.num_classes)")
    return num_classes


# ------------------------------------------------------------------- features with Ray Data


class FeatureExtractor:
    """uint8 image batches -> pre-logit features: a Ray Data map_batches callable (one per
    actor), or called directly on in-memory batches. Holds the model: loaded from an
    export/checkpoint path, received as an object ref, or given."""

    def __init__(self, source: Any, mean: Sequence[float], std: Sequence[float], threads: int = 1):
        import ray  # lazy: ray, torch (the solver above needs neither)
        import torch

        from .export import load_model  # lazy: torch, in the actor only

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
            f = self.model.representation(x)  # (B, R)
        out = {"features": f.float().numpy()}
        if "label" in batch:  # a Ray Data batch: its labels and keys come along
            out.update(label=np.asarray(batch["label"], np.int64), key=np.asarray(batch["key"], dtype=object))
        return out


def model_image_size(export_dir_or_model) -> int:
    if isinstance(export_dir_or_model, str):
        return read_config(export_dir_or_model).data.image_size
    return int(export_dir_or_model.image_size)


def at_size(cfg: ExperimentConfig, image_size: int) -> ExperimentConfig:
    """cfg with its eval rows resized to `image_size` (frozen features: the model's own resolution)."""
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, image_size=image_size))


def sorted_by_key(batches: list[dict], split: str, cfg: ExperimentConfig) -> dict[str, np.ndarray]:
    """Columns of `batches` concatenated and sorted by row key, so a result does not depend on
    Ray's scheduling; InputError when the split has no rows."""
    if not batches:
        raise InputError(f"split {split!r} of {cfg.data.shards or cfg.data.source} shards is empty: "
                         "rerun preprocess or pick another split")
    cols = {c: np.concatenate([b[c] for b in batches]) for c in batches[0]}
    order = np.argsort(cols["key"].astype(str), kind="stable")
    return {c: v[order] for c, v in cols.items()}


def read_split(cfg: ExperimentConfig, split: str, image_size: int) -> dict[str, np.ndarray]:
    """{"image" (n, S, S, 3) uint8, "label" (n,), "key" (n,)} of `split` of cfg's shards at
    `image_size`, sorted by key; read with Ray Data into this process (small few-shot sets)."""
    ds = build_eval_dataset(at_size(cfg, image_size), split)
    return sorted_by_key([{"image": b["image"], "label": np.asarray(b["label"], np.int64),
                           "key": np.asarray(b["key"]).astype(str)}
                          for b in ds.iter_batches(batch_size=None, batch_format="numpy")], split, cfg)


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

    cfg = at_size(cfg, model_image_size(export_dir_or_model))
    source = export_dir_or_model if isinstance(export_dir_or_model, str) else ray.put(export_dir_or_model)
    ds = build_eval_dataset(cfg, split).map_batches(
        FeatureExtractor, fn_constructor_kwargs={"source": source, "mean": cfg.data.mean, "std": cfg.data.std},
        batch_size=batch_size, batch_format="numpy", num_cpus=1,
        compute=ray.data.ActorPoolStrategy(size=concurrency))
    cols = sorted_by_key(list(ds.iter_batches(batch_size=None, batch_format="numpy")), split, cfg)
    out = (cols["features"].astype(np.float32), cols["label"])
    return (*out, cols["key"].astype(str)) if return_keys else out
