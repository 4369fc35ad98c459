"""Few-shot evaluation's features: frozen pre-logit features of a shard split (Ray Data), for the
solver (solver.py). Used by `vitp fewshot` (fewshot.py) and by the probes during training
(probe.py). Must not write MLflow, nor know where the weights came from beyond a model or an export
path (a checkpoint's is consolidated by vitp.train.export, in the actor: the one import up a layer).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from ..config import ExperimentConfig, Run
from ..data.ingest import build_eval_dataset, normalize
from ..errors import InputError
from ..model.weights import read_config


class FeatureExtractor:
    """uint8 image batches -> pre-logit features: a Ray Data map_batches callable (one per
    actor), or called directly on in-memory batches. Holds the model: loaded from an
    export/checkpoint path, received as an object ref, or given."""

    def __init__(self, source: Any, mean: Sequence[float], std: Sequence[float], threads: int = 1):
        import ray  # lazy: ray, torch (in the actor only)
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
            f = self.model.representation(x)  # (B, R)
        out = {"features": f.float().numpy()}
        if "label" in batch:  # a Ray Data batch: its labels and keys come along
            out.update(label=np.asarray(batch["label"], np.int64), key=np.asarray(batch["key"], dtype=object))
        return out


def model_image_size(export_dir_or_model) -> int:
    if isinstance(export_dir_or_model, str):
        return read_config(export_dir_or_model).data.image_size
    return int(export_dir_or_model.image_size)


def at_size(run: Run, image_size: int) -> Run:
    """`run` with its eval rows resized to `image_size` (frozen features: the model's own resolution)."""
    cfg = run.cfg
    return Run.of(dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, image_size=image_size)))


def sorted_by_key(batches: list[dict], split: str, cfg: ExperimentConfig) -> dict[str, np.ndarray]:
    """Columns of `batches` concatenated and sorted by row key, so a result does not depend on
    Ray's scheduling; InputError when the split has no rows."""
    if not batches:
        raise InputError(f"split {split!r} of {cfg.data.shards or cfg.data.source} shards is empty: "
                         "rerun preprocess or pick another split")
    cols = {c: np.concatenate([b[c] for b in batches]) for c in batches[0]}
    order = np.argsort(cols["key"].astype(str), kind="stable")
    return {c: v[order] for c, v in cols.items()}


def read_split(run: Run, split: str, image_size: int) -> dict[str, np.ndarray]:
    """{"image" (n, S, S, 3) uint8, "label" (n,), "key" (n,)} of `split` of the run's shards at
    `image_size`, sorted by key; read with Ray Data into this process (small few-shot sets)."""
    ds = build_eval_dataset(at_size(run, image_size), split)
    return sorted_by_key([{"image": b["image"], "label": np.asarray(b["label"], np.int64),
                           "key": np.asarray(b["key"]).astype(str)}
                          for b in ds.iter_batches(batch_size=None, batch_format="numpy")], split, run.cfg)


def extract_features(export_dir_or_model, run: Run, split: str = "train", *,
                     concurrency: int = 1, batch_size: int = 64,
                     return_keys: bool = False):
    """(features (n, R) float32, labels (n,) int64[, keys]) of `split` of the run's shards,
    sorted by row key so the result does not depend on Ray's scheduling.

    Images are resized to the model's own resolution (frozen features: no position-embedding
    resampling). Runs `build_eval_dataset` -> map_batches(FeatureExtractor) on an actor pool of
    `concurrency` CPU actors.
    """
    import ray  # lazy: ray (the solver needs none)

    run = at_size(run, model_image_size(export_dir_or_model))
    cfg = run.cfg
    source = export_dir_or_model if isinstance(export_dir_or_model, str) else ray.put(export_dir_or_model)
    ds = build_eval_dataset(run, split).map_batches(
        FeatureExtractor, fn_constructor_kwargs={"source": source, "mean": cfg.data.mean, "std": cfg.data.std},
        batch_size=batch_size, batch_format="numpy", num_cpus=1,
        compute=ray.data.ActorPoolStrategy(size=concurrency))
    cols = sorted_by_key(list(ds.iter_batches(batch_size=None, batch_format="numpy")), split, cfg)
    out = (cols["features"].astype(np.float32), cols["label"])
    return (*out, cols["key"].astype(str)) if return_keys else out
