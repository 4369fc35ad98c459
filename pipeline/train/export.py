"""Consolidate a (sharded) DeepSpeed checkpoint into one fp32 safetensors file + config.json.

The export is what leaves the training world: `pipeline.model` loads it with no DeepSpeed and
no Ray (`load_model`), and fine-tuning starts from it (`load_weights`).
"""
from __future__ import annotations

import glob
import json
import os
from typing import Any

import torch

from ..config import ExperimentConfig
from . import checkpoint as ckpt

WEIGHTS = "model.safetensors"
CONFIG = "config.json"


def consolidate(checkpoint_dir: str) -> dict[str, torch.Tensor]:
    """fp32 state dict of the model in a checkpoint written by `checkpoint.save` (any ZeRO stage)."""
    ok, reason = ckpt.verify(checkpoint_dir)
    if not ok:
        raise RuntimeError(f"cannot export an incomplete checkpoint: {reason}")
    meta = ckpt.read_meta(checkpoint_dir)
    if meta["zero_stage"] == 0:
        # Without ZeRO the full module state sits in rank 0's model-states file (fp32 master
        # weights for fp32 runs; bf16 runs keep their fp32 copy in the optimizer file).
        files = glob.glob(os.path.join(checkpoint_dir, meta["tag"], "*optim_states.pt"))
        bf16_master = [f for f in files if os.path.basename(f).startswith("bf16_")]
        if not bf16_master:
            states = torch.load(os.path.join(checkpoint_dir, meta["tag"], "mp_rank_00_model_states.pt"),
                                map_location="cpu", weights_only=False)
            return {k: v.float().contiguous() for k, v in states["module"].items()}
    # ZeRO 1-3 (and bf16 stage 0): rebuild fp32 weights from the per-rank optimizer partitions.
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    sd = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag=meta["tag"])
    return {k: v.float().contiguous() for k, v in sd.items()}


def export(checkpoint_dir: str, out_dir: str) -> str:
    """Write `out_dir/model.safetensors` and `out_dir/config.json`; returns out_dir."""
    from safetensors.torch import save_file

    sd = consolidate(checkpoint_dir)
    meta = ckpt.read_meta(checkpoint_dir)
    os.makedirs(out_dir, exist_ok=True)
    save_file(sd, os.path.join(out_dir, WEIGHTS), metadata={"step": str(meta["step"])})
    with open(os.path.join(out_dir, CONFIG), "w") as f:
        json.dump({**(meta.get("config") or {}),
                   "_export": {"step": meta["step"], "source": os.path.abspath(checkpoint_dir),
                               "mlflow_run_id": meta.get("mlflow_run_id")}}, f, indent=2)
    return out_dir


def load_weights(path: str) -> dict[str, torch.Tensor]:
    """State dict from an export dir, a .safetensors / .pt file, or a training checkpoint dir."""
    from safetensors.torch import load_file

    if os.path.isdir(path):
        if os.path.exists(os.path.join(path, WEIGHTS)):
            return load_file(os.path.join(path, WEIGHTS))
        if os.path.exists(os.path.join(path, "meta.json")):
            return consolidate(path)
        raise FileNotFoundError(
            f"{path}: neither an export ({WEIGHTS}) nor a training checkpoint (meta.json); "
            "run `vitp export CHECKPOINT` or point at the file itself"
        )
    if path.endswith(".safetensors"):
        return load_file(path)
    if path.endswith((".pt", ".pth", ".bin")):
        sd = torch.load(path, map_location="cpu", weights_only=True)
        return sd.get("state_dict", sd) if isinstance(sd, dict) else sd
    raise ValueError(f"{path}: unknown weights format (expected a directory, .safetensors or .pt)")


def load_config(path: str) -> ExperimentConfig:
    """The resolved config stored beside exported weights (or in a checkpoint's meta.json)."""
    cfg_path = os.path.join(path, CONFIG) if os.path.isdir(path) else os.path.join(os.path.dirname(path), CONFIG)
    if os.path.exists(cfg_path):
        with open(cfg_path) as f:
            d: dict[str, Any] = json.load(f)
    else:
        d = ckpt.read_meta(path)["config"]
    d.pop("_export", None)
    return ExperimentConfig.from_dict(d)


def load_model(path: str):
    """A `pipeline.model.ViT` with exported weights, built from the stored config: no DeepSpeed."""
    from ..model import build_vit

    cfg = load_config(path)
    model = build_vit(cfg.model, cfg.data.image_size)
    model.load_state_dict(load_weights(path))
    return model.eval()
