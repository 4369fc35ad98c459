"""Our export format, `model.safetensors` (fp32, our naming) + `config.json` (ExperimentConfig dict
plus `_export` facts): its one reader and writer, and what any `--from SOURCE` says about itself
(export dir, weights file, training checkpoint dir via its meta.json, or "scratch").
Files go through vitp.storage. Must not import DeepSpeed, Ray or anything from vitp.train.
"""
from __future__ import annotations

import io
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Optional

from .. import storage
from ..config import ExperimentConfig
from ..errors import InputError, UserError
from ..safe_load import torch_load

if TYPE_CHECKING:
    import torch

WEIGHTS = "model.safetensors"
CONFIG = "config.json"
CHECKPOINT_META = "meta.json"  # written by vitp.train.checkpoint; read here as plain JSON
WEIGHT_FILES = (".safetensors", ".pt", ".pth", ".bin")
# What convert.import_weights accepts (`vitp import --format`): "npz" = official google-research /
# big_vision .npz, "ours" = our naming as is. Kept here, torch-free, so the CLI parser can list them.
IMPORT_FORMATS = ("auto", "npz", "timm", "hf", "ours")

_SOURCES = ("a checkpoint directory (from `vitp pretrain`), an export (`vitp export` / `vitp import`), "
            "a weights file (.safetensors / .pt)")


@dataclass(frozen=True)
class SourceInfo:
    """What a weights source says about itself, from the JSON stored beside its weights.

    kind: "scratch"; "export" (a directory holding model.safetensors); "checkpoint" (a training
    checkpoint directory: meta.json, no model.safetensors); "file" (a weights file); "directory"
    (a directory that is neither). `config` is the stored ExperimentConfig dict without `_export`
    (None if nothing is stored), `step` the training step it records (0 if none).
    """

    path: str  # "scratch", or the source as given (the CLI and a sweep's spec make it absolute)
    kind: str
    config: Optional[dict[str, Any]] = None
    mlflow_run_id: Optional[str] = None
    step: int = 0
    registered: Optional[dict[str, Any]] = None  # {name, version, model_id}: `vitp export --register`
    classes: Optional[list[str]] = None  # class names by label, as the export recorded them (vitp export)

    @property
    def recipe(self) -> Optional[str]:
        return (self.config or {}).get("recipe")

    @property
    def image_size(self) -> Optional[int]:
        return ((self.config or {}).get("data") or {}).get("image_size")


def _read_json(path: str) -> dict[str, Any]:
    try:
        return storage.read_json(path)
    except (OSError, ValueError) as e:
        raise InputError(f"{path}: unreadable ({e}); is it still being written?") from None


def _missing(path: str) -> InputError:
    return InputError(f"{path}: no such file or directory; give {_SOURCES}, or 'scratch'")


def source_info(path: str) -> SourceInfo:
    """Kind, stored config, MLflow run id and step of the source `path`; InputError if it does not exist.

    The JSON beside the weights is read as is: `config.json` (an export's config + `_export`)
    first, else a checkpoint's `meta.json` (`config`, `mlflow_run_id`, `step`); a weights file
    reads the files in its own directory.
    """
    if path == "scratch":
        return SourceInfo(path="scratch", kind="scratch")
    if not storage.exists(path):
        raise _missing(path)
    if storage.isdir(path):
        d = path
        kind = ("export" if storage.exists(storage.join(d, WEIGHTS)) else
                "checkpoint" if storage.exists(storage.join(d, CHECKPOINT_META)) else "directory")
    else:
        d, kind = storage.dirname(path), "file"
    if storage.exists(storage.join(d, CONFIG)):
        config = _read_json(storage.join(d, CONFIG))
        extra = config.pop("_export", None) or {}
    elif storage.exists(storage.join(d, CHECKPOINT_META)):
        extra = _read_json(storage.join(d, CHECKPOINT_META))
        config = extra.get("config")
    else:
        return SourceInfo(path=path, kind=kind)
    return SourceInfo(path=path, kind=kind, config=config, mlflow_run_id=extra.get("mlflow_run_id"),
                      step=int(extra.get("step", 0) or 0), registered=extra.get("registered"),
                      classes=extra.get("classes"))


def check_source(source: str) -> SourceInfo:
    """source_info of a weights source a run will load, refused here (on the driver, before Ray
    starts) when it cannot be one: a directory that is neither an export nor a checkpoint, a file
    that is not a weights file (e.g. an export's config.json)."""
    info = source_info(source)
    if info.kind == "directory":
        raise InputError(f"{source}: neither an export ({WEIGHTS}) nor a training checkpoint "
                         f"({CHECKPOINT_META}); give {_SOURCES}")
    if info.kind == "file" and not info.path.endswith(WEIGHT_FILES):
        raise InputError(f"{source}: not a weights file ({', '.join(WEIGHT_FILES)}); give {_SOURCES}")
    return info


def read_config(path: str) -> ExperimentConfig:
    """The ExperimentConfig stored beside the weights at `path` (export dir, weights file or
    checkpoint dir)."""
    info = source_info(path)
    if info.config is None:
        raise InputError(f"{path}: no {CONFIG} beside the weights and no checkpoint {CHECKPOINT_META}, "
                         "so its model shape is unknown; use `vitp export` / `vitp import` output")
    return ExperimentConfig.from_dict(info.config)


def read_weights(path: str) -> dict[str, "torch.Tensor"]:
    """State dict of an export dir or a .safetensors / .pt / .pth / .bin file.

    .pt-style files may wrap the state dict under "state_dict", "model" or "module" (common
    checkpoint layouts). A training checkpoint dir needs DeepSpeed to consolidate: that is
    vitp.train.export.load_weights.
    """
    if not storage.exists(path):
        raise _missing(path)
    if storage.isdir(path):
        if storage.exists(storage.join(path, WEIGHTS)):
            path = storage.join(path, WEIGHTS)
        elif storage.exists(storage.join(path, CHECKPOINT_META)):
            raise InputError(f"{path} is a training checkpoint, not an export: run `vitp export {path}` "
                             "(or load it with vitp.train.export.load_weights)")
        else:
            raise InputError(f"{path}: neither an export ({WEIGHTS}) nor a training checkpoint "
                             f"({CHECKPOINT_META}); run `vitp export CHECKPOINT` or point at the file itself")
    if not path.endswith(WEIGHT_FILES):
        raise InputError(f"{path}: unknown weights format; use an export directory, .safetensors, "
                         ".pt, .pth or .bin")
    try:
        if path.endswith(".safetensors"):
            from safetensors.torch import load, load_file  # lazy: torch (as above)

            return dict(load_file(path) if not storage.is_uri(path) else load(storage.read_bytes(path)))
        obj = torch_load(io.BytesIO(storage.read_bytes(path)) if storage.is_uri(path) else path, what=path)
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - whatever safetensors or torch says of a damaged file
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise InputError(f"{path}: not a readable weights file ({reason}); is the download complete?") from None
    for key in ("state_dict", "model", "module"):  # common checkpoint wrappers
        if isinstance(obj, dict) and isinstance(obj.get(key), dict):
            obj = obj[key]
    if not isinstance(obj, dict):
        raise InputError(f"{path}: holds a {type(obj).__name__}, not a state dict")
    return obj


def mark_registered(export_dir: str, registered: dict[str, Any]) -> None:
    """Record in an export's config.json the registered model version it became (`vitp export
    --register`), so fine-tunes from it can name that version."""
    path = storage.join(export_dir, CONFIG)
    config = _read_json(path)
    config.setdefault("_export", {})["registered"] = registered
    storage.write_bytes(path, json.dumps(config, indent=2).encode())


def write_export(out_dir: str, state_dict: Mapping[str, "torch.Tensor"], cfg_dict: dict[str, Any],
                 export_meta: dict[str, Any]) -> str:
    """Write `out_dir/model.safetensors` and `out_dir/config.json` ({**cfg_dict, "_export":
    export_meta}); returns out_dir. The scalar entries of export_meta (step, source, format,
    MLflow run id) also go into the safetensors header."""
    from safetensors.torch import save_file  # lazy: torch (source_info / read_config need none)

    tensors = {k: v.contiguous() for k, v in state_dict.items()}
    header = {k: str(v) for k, v in export_meta.items()
              if isinstance(v, (str, int, float)) and not isinstance(v, bool)}
    from ..tracking.redact import redact  # lazy: the tracking package imports mlflow

    # redacted: an export travels (registries, other teams); only the model shape is read back
    text = json.dumps({**redact(cfg_dict), "_export": export_meta}, indent=2)
    if not storage.is_uri(out_dir):
        os.makedirs(out_dir, exist_ok=True)
        save_file(tensors, os.path.join(out_dir, WEIGHTS), metadata=header)
        with open(os.path.join(out_dir, CONFIG), "w") as f:
            f.write(text)
        return out_dir
    # Object storage: the weights go through a local temporary file and are streamed up (a
    # ViT-H state in memory twice would not fit small drivers); config.json goes last, so a
    # reader never finds a config without its weights.
    with tempfile.TemporaryDirectory(prefix="vitp-export-") as tmp:
        local = os.path.join(tmp, WEIGHTS)
        save_file(tensors, local, metadata=header)
        with open(local, "rb") as src, storage.open_output(storage.join(out_dir, WEIGHTS)) as dst:
            shutil.copyfileobj(src, dst, 16 << 20)
    storage.write_bytes(storage.join(out_dir, CONFIG), text.encode())
    return out_dir
