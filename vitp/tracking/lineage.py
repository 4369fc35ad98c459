"""What a run was made from, as MLflow records it: the shards it trained on (a dataset input, the
UI's Dataset column), the registered model it started from (a model input), and its config (a
new run like it: runs:/RUN_ID). Registering a model is vitp.train.registry's job.
"""
from __future__ import annotations

import hashlib
import json
import warnings

from mlflow import MlflowClient

from .. import storage
from .redact import redact_text


def log_dataset(client: MlflowClient, run_id: str, name: str, source: str, digest: str,
                context: str = "train") -> None:
    """Record a dataset as an input of `run_id`: `source` a path or URI (shown as MLflow resolves
    it, a password in it masked), `digest` what identifies its content (same shards, same digest)."""
    from mlflow.data.dataset_source_registry import resolve_dataset_source  # lazy: mlflow.data
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.entities import DatasetInput, InputTag

    with warnings.catch_warnings():  # MLflow registers its local source twice and says so
        warnings.simplefilter("ignore", UserWarning)
        resolved = resolve_dataset_source(redact_text(source))
    dataset = MetaDataset(resolved, name=name, digest=digest)
    client.log_inputs(run_id, datasets=[DatasetInput(
        dataset._to_mlflow_entity(), tags=[InputTag("mlflow.data.context", context)])])


def shard_manifest(root: str) -> dict | None:
    """The manifest.json of the shards at `root`; None where there is none."""
    path = storage.join(root, "manifest.json")
    return storage.read_json(path) if storage.exists(path) else None


def log_shards(client: MlflowClient, run_id: str, name: str, root: str, manifest: dict | None,
               context: str = "train") -> None:
    """The Parquet shards at `root` as a dataset input of `run_id`, their digest taken from their
    `manifest`'s shard list (same shards, same digest); nothing when there is no manifest."""
    if manifest is not None:
        shards = manifest.get("shards")
        digest = hashlib.sha1(json.dumps(shards, sort_keys=True).encode()).hexdigest()[:12]
        log_dataset(client, run_id, name, root, digest, context)


def log_model_input(client: MlflowClient, run_id: str, model_id: str) -> None:
    """Record the logged model `model_id` as an input of `run_id` (a fine-tune's starting point)."""
    from mlflow.entities import LoggedModelInput

    client.log_inputs(run_id, models=[LoggedModelInput(model_id)])


def run_as_experiment(uri: str, run_id: str, dest_dir: str) -> str:
    """An experiment file (config/files.py) for a new run like `run_id`: its logged config.json
    (redacted as logged), with the run name `<its run name>-like-<run id[:8]>`: a run of its own,
    and the same command again continues that one. Written under `dest_dir`; returns its path."""
    import os

    from mlflow.exceptions import MlflowException

    from ..errors import InputError
    from .store import get_client

    client = get_client(uri)
    try:
        run = client.get_run(run_id)
    except MlflowException:
        raise InputError(f"runs:/{run_id}: no such run at {redact_text(uri)} (`vitp compare` lists the "
                         "runs there)") from None
    try:
        local = client.download_artifacts(run_id, "config.json", dest_dir)
    except (MlflowException, OSError):
        raise InputError(f"runs:/{run_id}: run {run.info.run_name!r} has no config.json artifact (vitp "
                         "pretrain, finetune and sweep trials log one)") from None
    with open(local) as f:
        config = json.load(f)
    config["set"] = {"tracking.run_name": f"{run.info.run_name}-like-{run_id[:8]}"}
    path = os.path.join(dest_dir, f"like-{run_id[:8]}.json")
    with open(path, "w") as f:
        json.dump(config, f)
    return path
