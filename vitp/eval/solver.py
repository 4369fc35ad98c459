"""Few-shot linear evaluation's solver (paper; big_vision `fewshot_lsr`): closed-form L2-regularised
least squares from frozen features to one-vs-all targets, over k shots per class x seeds. NumPy
only: `vitp fewshot` (fewshot.py) and the probes during pre-training (probe.py) both call it.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ..errors import InputError

SHOTS = (1, 5, 10, 25)
L2 = 2.0**10  # the paper's / big_vision's regulariser
BIAS_FEATURE = 100.0  # a constant column this large makes the bias almost unregularised


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
