"""Consolidate a (sharded) DeepSpeed checkpoint into our export format (vitp.model.weights).

The export is what leaves the training world: `load_model` builds a plain `vitp.model` ViT
from it with no DeepSpeed and no Ray, and fine-tuning starts from any source (`load_weights`).
Must not write the export format itself: weights.write_export / read_weights own it.
"""
from __future__ import annotations

import contextlib
import glob
import os
import tempfile
from typing import Iterator

import torch

from .. import storage
from ..console import name_cpu_accelerator, quiet_output
from ..errors import InputError
from ..model import weights
from ..model.vit import ViT, build_vit
from ..safe_load import torch_load, weights_only
from . import checkpoint as ckpt
from .ema import full_ema


WEIGHTS = ("model", "ema")  # `vitp export --weights`: the trained weights, or their EMA (train.ema_decay)


def consolidate(checkpoint_dir: str, weights_of: str = "model") -> dict[str, torch.Tensor]:
    """fp32 state dict of the model in a checkpoint written by `checkpoint.save` (any ZeRO stage), or
    (`weights_of="ema"`) of the weight EMA saved with it."""
    if not storage.exists(checkpoint_dir):
        raise InputError(f"{checkpoint_dir}: no such checkpoint directory; give one written by "
                         "`vitp pretrain` (it prints the path at the end)")
    if not storage.isdir(checkpoint_dir):
        raise InputError(f"{checkpoint_dir}: a file, not a checkpoint directory; give the checkpoint_NNNNNNNN "
                         "directory `vitp pretrain` printed")
    ok, reason = ckpt.verify(checkpoint_dir)
    if not ok:
        raise InputError(f"cannot export an incomplete checkpoint: {reason}")
    meta = ckpt.read_meta(checkpoint_dir)
    if weights_of == "ema":
        sd = full_ema(checkpoint_dir)
        if sd is None:
            raise InputError(f"{checkpoint_dir}: no weight EMA in this checkpoint; train with --set "
                             "train.ema_decay=0.9998 (for example) to keep one, or export --weights model")
        return sd
    with _local_checkpoint(checkpoint_dir, meta["tag"]) as local:
        if meta["zero_stage"] == 0:
            # Without ZeRO the full module state sits in rank 0's model-states file (fp32 master
            # weights for fp32 runs; bf16 runs keep their fp32 copy in the optimizer file).
            files = glob.glob(os.path.join(local, meta["tag"], "*optim_states.pt"))
            bf16_master = [f for f in files if os.path.basename(f).startswith("bf16_")]
            if not bf16_master:
                states = torch_load(os.path.join(local, meta["tag"], "mp_rank_00_model_states.pt"),
                                    what=checkpoint_dir)  # data only, whoever wrote the file
                return {k: v.float().contiguous() for k, v in states["module"].items()}
        # ZeRO 1-3 (and bf16 stage 0): rebuild fp32 weights from the per-rank optimizer partitions.
        name_cpu_accelerator(torch.cuda.is_available())
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint  # lazy: deepspeed

        # its per-file progress lines and bar held; its torch.loads data only (a refusal is one
        # line, raised inside quiet_output so the held chatter is not replayed)
        with quiet_output(), weights_only(checkpoint_dir):
            sd = get_fp32_state_dict_from_zero_checkpoint(local, tag=meta["tag"])
        return {k: v.float().contiguous() for k, v in sd.items()}


@contextlib.contextmanager
def _local_checkpoint(checkpoint_dir: str, tag: str) -> Iterator[str]:
    """A local directory holding `checkpoint_dir/<tag>` (DeepSpeed's files, which torch.load and
    DeepSpeed read only from disk): the directory itself when local, else a temporary copy of
    only that part (not the RNG states or markers), deleted on exit."""
    if not storage.is_uri(checkpoint_dir):
        yield checkpoint_dir
        return
    with storage.local_copy(storage.join(checkpoint_dir, tag)) as state, \
            tempfile.TemporaryDirectory(prefix="vitp-export-") as tmp:
        os.symlink(state, os.path.join(tmp, tag))  # DeepSpeed looks for <dir>/<tag>/...
        yield tmp


def class_names(cfg_dict: dict | None) -> list[str] | None:
    """The class names, by label, of the shards a run with this config trained on (their
    classes.json), when that file is still readable and matches the head; else None."""
    from ..config import ExperimentConfig, Run

    try:
        run = Run.of(ExperimentConfig.from_dict(cfg_dict or {}))
        cfg = run.cfg
        index = storage.read_json(storage.join(run.shards, "classes.json"))
    except (OSError, ValueError, TypeError):  # gone, unreachable, not a config of ours, or not resolved
        return None
    names = sorted(index, key=index.get) if isinstance(index, dict) else []
    ok = [index[n] for n in names] == list(range(cfg.model.num_classes))
    return names if ok else None


def export(checkpoint_dir: str, out_dir: str, weights_of: str = "model") -> str:
    """Write `out_dir/model.safetensors` and `out_dir/config.json` (with the class names, when the
    training shards still say them, and `checkpoint_dir` as its source: an absolute path or URI, as
    the CLI resolves it); returns out_dir. `weights_of`: "model" or its "ema"."""
    sd = consolidate(checkpoint_dir, weights_of)
    meta = ckpt.read_meta(checkpoint_dir)
    facts = {"step": meta["step"], "source": checkpoint_dir,
             "mlflow_run_id": meta.get("mlflow_run_id"), **({"weights": "ema"} if weights_of == "ema" else {})}
    classes = class_names(meta.get("config"))
    if classes:
        facts["classes"] = classes
    return weights.write_export(out_dir, sd, meta.get("config") or {}, facts)


FORMATS = ("ours", "timm", "hf")  # `vitp export --format`


def export_as(source: str, out: str, fmt: str = "ours", weights_of: str = "model", headless: bool = False) -> str:
    """A checkpoint dir (consolidated first; its EMA with weights_of="ema") or an export dir -> `fmt`: our
    export dir, timm-named weights (a .safetensors file) or a Hugging Face directory; `headless`
    (timm, hf): the backbone without its classifier. Returns `out`."""
    from ..model.convert import export_timm  # lazy: the converters
    from ..model.convert_hf import export_hf

    if weights_of == "ema" and weights.source_info(source).kind != "checkpoint":
        raise InputError(f"{source}: --weights ema reads a training checkpoint's EMA; this is an export")
    if headless and fmt == "ours":
        raise InputError("--headless is for --format timm or hf: our own export keeps the whole model "
                         "(fine-tunes replace its head)")
    if fmt == "ours":
        return export(source, out, weights_of)
    with contextlib.ExitStack() as stack:
        ours = source
        if weights.source_info(source).kind == "checkpoint":
            ours = export(source, stack.enter_context(tempfile.TemporaryDirectory(prefix="vitp-export-")),
                          weights_of)
        if fmt == "timm":
            return export_timm(ours, out, headless, name=source)
        return export_hf(ours, out, name=source, headless=headless)


def load_weights(path: str) -> dict[str, torch.Tensor]:
    """State dict from any source: an export dir, a .safetensors / .pt file, or a training
    checkpoint dir (consolidated here, with DeepSpeed for ZeRO checkpoints)."""
    if weights.source_info(path).kind == "checkpoint":
        return consolidate(path)
    return weights.read_weights(path)


def load_model(path: str) -> ViT:
    """A `vitp.model.vit.ViT` with the weights of `path`, built from its stored config: no DeepSpeed
    (unless `path` is a ZeRO checkpoint dir, which is consolidated first)."""
    cfg = weights.read_config(path)
    sd = load_weights(path)
    # a masked-patch-prediction pre-training keeps its [mask] embedding and colour head
    model = build_vit(cfg.model, cfg.data.image_size, mpp=any(k.startswith("mpp.") for k in sd))
    model.load_state_dict(sd)
    return model.eval()
