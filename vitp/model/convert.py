"""Weights from elsewhere: official ViT `.npz`, timm and Hugging Face state dicts <-> our naming.

Owns timm's key map, inferring the variant from tensor shapes, and import/export; the .npz re-layouts
are in convert_npz.py, HF's in convert_hf.py, hybrids' in convert_hybrid.py, our format in weights.py.
No Ray or DeepSpeed; never downloads: sources are local files or storage URIs (vitp.storage).
"""
from __future__ import annotations

import dataclasses
import io
import math
import re
from typing import Any, Mapping, Optional

import torch
from safetensors.torch import save

from .. import storage
from ..config import ExperimentConfig
from ..errors import InputError
from .convert_hf import backbone, from_hf
from .convert_hybrid import f32 as _t
from .convert_hybrid import hybrid_layout, hybrid_variant, ours_to_timm, timm_to_ours, vit_rows
from .convert_npz import load_npz, npz_state_dict
from .variants import VARIANTS, decode_variant
from .loading import resample_pos_embed
from .vit import build_vit
from .weights import CONFIG, IMPORT_FORMATS, WEIGHT_FILES, WEIGHTS, read_weights, write_export

StateDict = dict[str, torch.Tensor]


# --------------------------------------------------------------------------------------
# Variant inference from our naming
# --------------------------------------------------------------------------------------


def infer_info(sd: Mapping[str, torch.Tensor], heads: Optional[int] = None) -> dict[str, Any]:
    """Shape facts of a state dict in our naming: depth, width, mlp_dim, heads, patch, grid,
    image_size, head ("pretrain" if pre-logits are present), representation_size, num_classes
    (None when there is no head), and `variant` ("B/16", or a hybrid's "R50+B/16") from
    vitp.model.variants; `stride` is the pixels per token (patch x a hybrid's ResNet stride).

    Heads are not visible in a fused qkv weight, so they come from `heads` (the official
    layout and HF configs carry them) or from the variant table row that matches the shapes.
    """
    for key in ("patch_embed.proj.weight", "cls_token", "pos_embed", "blocks.0.mlp.fc1.weight"):
        if key not in sd:
            raise InputError(f"state dict has no {key!r}: not a ViT in our naming (keys start "
                           f"{sorted(sd)[:5]}); convert it with from_official_npz/from_timm/from_hf")
    width, in_chans, patch, patch_w = sd["patch_embed.proj.weight"].shape  # (D, C, P, P)
    if patch != patch_w:
        raise InputError(f"patch embedding kernel is {patch}x{patch_w}: only square patches are supported")
    hybrid = hybrid_layout(sd)  # (ResNet blocks per stage, root width) or None
    if in_chans != 3 and hybrid is None:
        raise InputError(f"patch embedding takes {in_chans} input channels: our ViT reads RGB (3)")
    depth = len({int(m.group(1)) for k in sd if (m := re.match(r"blocks\.(\d+)\.", k))})
    mlp_dim = sd["blocks.0.mlp.fc1.weight"].shape[0]
    n = sd["pos_embed"].shape[1] - 1  # (1, N+1, D): one class token
    grid = math.isqrt(n)
    if grid * grid != n:
        raise InputError(f"position embedding has {n} patch tokens: not a square grid (needs g*g)")
    matches = vit_rows(depth, width, mlp_dim, heads)
    if not matches:
        raise InputError(
            f"weights have depth {depth}, width {width}, MLP {mlp_dim}, heads {heads or '?'}: no row "
            "of vitp.model.variants.VARIANTS has that shape; add one there (name -> (depth, width, "
            f"mlp_dim, heads)) to import them. Known: {VARIANTS}"
        )
    name = hybrid_variant(matches[0], *hybrid[:1], patch, hybrid[1]) if hybrid else f"{matches[0]}/{patch}"
    stride = decode_variant(name).stride
    has_pre = "pre_logits.0.weight" in sd
    return {
        "variant": name, "depth": depth, "width": width, "mlp_dim": mlp_dim, "heads": VARIANTS[matches[0]][3],
        "patch": patch, "stride": stride, "grid": grid, "image_size": grid * stride,
        "head": "pretrain" if has_pre else "finetune",
        "representation_size": sd["pre_logits.0.weight"].shape[0] if has_pre else None,
        "num_classes": sd["head.weight"].shape[0] if "head.weight" in sd else None,
    }


def from_official_npz(npz: str | Mapping[str, Any]) -> tuple[StateDict, dict[str, Any]]:
    """Official ViT `.npz` (path or {key: array}) -> (state dict in our naming, info): convert_npz.py
    re-lays the tensors out, the variant is inferred from their shapes."""
    sd, layout, heads = npz_state_dict(load_npz(npz))
    info = infer_info(sd, heads=heads)
    info["format"] = f"npz-{layout}"
    return sd, info


# --------------------------------------------------------------------------------------
# timm vision_transformer
# --------------------------------------------------------------------------------------

# timm features our ViT does not have; importing them silently would change the function.
_TIMM_UNSUPPORTED = {
    "fc_norm.": "global-pool models (fc_norm)", "reg_token": "register tokens",
    "norm_pre.": "pre-norm (CLIP-style)", "attn_pool.": "attention-pool heads (MAP)",
    ".ls1.": "LayerScale", ".ls2.": "LayerScale", ".q_norm.": "QK-norm", ".k_norm.": "QK-norm",
    "dist_token": "DeiT distillation token", "head_dist.": "DeiT distillation head",
}


def _strip(sd: Mapping[str, Any], prefixes: tuple[str, ...]) -> dict[str, Any]:
    for prefix in prefixes:
        if sd and all(k.startswith(prefix) for k in sd):
            return {k[len(prefix):]: v for k, v in sd.items()}
    return dict(sd)


def from_timm(sd: Mapping[str, Any]) -> StateDict:
    """timm `VisionTransformer` state dict -> ours. The names are timm's already; old timm's
    `pre_logits.fc` becomes our `pre_logits.0`. Features we do not model raise InputError."""
    sd = _strip(sd, ("module.", "model."))
    bad = sorted({why for k in sd for key, why in _TIMM_UNSUPPORTED.items() if key in k})
    if bad:
        raise InputError(f"timm weights use {', '.join(bad)}, which vitp.model.ViT does not "
                         "implement: import a plain class-token ViT (e.g. vit_base_patch16_224)")
    return {k.replace("pre_logits.fc.", "pre_logits.0."): _t(v) for k, v in timm_to_ours(sd).items()}


def to_timm(sd: Mapping[str, torch.Tensor]) -> StateDict:
    """Ours -> timm naming. Pre-logits (pretrain head) use old timm's `pre_logits.fc` name:
    timm >= 0.6 dropped the representation layer, so only a finetune-head model loads there."""
    return {k.replace("pre_logits.0.", "pre_logits.fc."): _t(v) for k, v in ours_to_timm(sd).items()
            if not k.startswith("mpp.")}  # masked patch prediction's training-only head


# --------------------------------------------------------------------------------------
# Reading files, detecting the format, writing an export dir
# --------------------------------------------------------------------------------------


def _read_any(src: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(tensors, side info) from .npz / .safetensors / .pt / .pth / .bin or a directory holding
    one (an HF save_pretrained dir also yields its config.json as side info)."""
    side: dict[str, Any] = {}
    path = src
    if storage.isdir(src):
        names = (WEIGHTS, "pytorch_model.bin", "model.pt", "model.npz")
        path = next((storage.join(src, n) for n in names if storage.exists(storage.join(src, n))), "")
        if not path:
            raise InputError(f"{src}: no {', '.join(names[:-1])} or {names[-1]} inside; point at "
                             "the weights file itself")
        if storage.exists(storage.join(src, CONFIG)):  # ours, or HF's (heads)
            side["config"] = storage.read_json(storage.join(src, CONFIG))
    if not storage.exists(path):
        raise InputError(f"{path}: no such file")
    if path.endswith(".npz"):
        return load_npz(path), side
    if not path.endswith(WEIGHT_FILES):
        raise InputError(f"{path}: unknown weights format; use .npz (official), .safetensors, "
                         ".pt/.pth or .bin (timm / Hugging Face / ours)")
    return read_weights(path), side


def detect_format(keys) -> str:
    """"npz" (official JAX layout), "hf" or "timm" (timm naming; ours is a subset of it)."""
    keys = list(keys)
    if any(k.endswith("embedding/kernel") for k in keys):
        return "npz"
    if any(k.removeprefix("vit.").startswith(("embeddings.", "encoder.layer.", "layers.")) for k in keys):
        return "hf"
    if any(re.search(r"(^|\.)blocks\.0\.attn\.qkv\.weight$", k) for k in keys):
        return "timm"
    raise InputError(f"cannot tell the layout of a weights file with keys {keys[:6]}...: pass "
                     "fmt='npz', 'timm', 'hf' or 'ours' explicitly, or check it is a ViT checkpoint")


def import_weights(src: str, out_dir: str, fmt: str = "auto", image_size: Optional[int] = None,
                   num_classes: Optional[int] = None) -> str:
    """Convert `src` (official .npz, timm, HF or our weights; an absolute path or URI, recorded as
    the export's source) into an export dir at `out_dir`.

    `fmt` is one of IMPORT_FORMATS: "auto" detects npz / hf / timm from the keys (our naming is
    read as timm's, a superset); "ours" takes the tensors as they are.
    The variant, head type, pre-logits width, classes and resolution are inferred from the
    tensors. `image_size` resamples the position embedding to another resolution; `num_classes`
    (or a source without a head, like HF ViTModel) gives a zero-initialised head of that width.
    config.json holds an ExperimentConfig dict plus `_export` (source, format, what changed).
    """
    if fmt not in IMPORT_FORMATS:
        raise InputError(f"format {fmt!r}: use one of {', '.join(IMPORT_FORMATS)}")
    raw, side = _read_any(src)
    if fmt == "auto":
        fmt = detect_format(raw)
    hf_heads = None
    try:
        if fmt == "npz":
            sd, info = from_official_npz(raw)
        elif fmt == "timm":
            sd = from_timm(raw)
        elif fmt == "hf":
            sd = from_hf(raw)
            hf_heads = (side.get("config") or {}).get("num_attention_heads")
        else:  # "ours"
            sd = {k: _t(v) for k, v in raw.items()}
        if fmt != "npz":
            info = infer_info(sd, heads=hf_heads)
            info["format"] = fmt
    except InputError as e:  # name the file and the way out: the format may simply be wrong
        raise InputError(f"{src} as --format {fmt}: {e} (try --format auto, or the format it was "
                         f"saved in: {', '.join(IMPORT_FORMATS[1:])})") from None
    notes = []
    if any(k.startswith("mpp.") for k in sd):  # a masked-patch-prediction pre-training's export
        sd = {k: v for k, v in sd.items() if not k.startswith("mpp.")}
        notes.append("masked patch prediction's [mask] embedding and colour head left out")

    # A different resolution keeps the patch size, so only the position-embedding grid changes.
    t = info["stride"]  # pixels per token: the patch, or a hybrid's ResNet stride x patch
    if image_size is not None and image_size != info["image_size"]:
        if image_size % t:
            raise InputError(f"image_size={image_size} is not a multiple of the token size {t} of "
                             f"{info['variant']}: use e.g. {max(image_size // t, 1) * t}")
        sd["pos_embed"] = resample_pos_embed(sd["pos_embed"], image_size // t)
        notes.append(f"pos_embed resampled {info['image_size']}px -> {image_size}px")
        info["image_size"], info["grid"] = image_size, image_size // t
    R = info["representation_size"] or info["width"]
    if info["num_classes"] is None or (num_classes is not None and num_classes != info["num_classes"]):
        k = num_classes or 1000
        sd["head.weight"], sd["head.bias"] = torch.zeros(k, R), torch.zeros(k)
        notes.append(f"zero-initialised head with {k} classes (source had "
                     f"{info['num_classes'] or 'none'})")
        info["num_classes"] = k

    base = ExperimentConfig(recipe="import")
    cfg = base.replace(
        model=dataclasses.replace(base.model, variant=info["variant"], num_classes=info["num_classes"],
                                  head=info["head"], representation_size=info["representation_size"],
                                  # a hybrid keeps the standardisation its weights were trained with
                                  resnet_norm=((side.get("config") or {}).get("model") or {}).get(
                                      "resnet_norm", "timm" if fmt == "timm" else "bit")),
        data=dataclasses.replace(base.data, image_size=info["image_size"], num_classes=info["num_classes"],
                                 storage_size=max(info["image_size"], base.data.storage_size)),
    )
    model = build_vit(cfg.model, info["image_size"])
    missing, unexpected = model.load_state_dict(sd, strict=False)
    if missing or unexpected:
        raise InputError(f"{src}: converted weights do not fit {info['variant']} "
                         f"(missing {missing[:6]}, unexpected {unexpected[:6]})")

    return write_export(out_dir, model.state_dict(), cfg.to_dict(),
                        {"source": src, "format": info["format"], "imported": info,
                         "notes": notes})


def export_timm(export_dir: str, out_path: str, headless: bool = False, name: str = "") -> str:
    """Our export dir (or a weights file of ours) -> timm-named weights at `out_path`
    (.safetensors, or torch.save for .pt/.pth/.bin). headless: without the classifier (and the
    pre-logits), for timm's `num_classes=0`. timm's ViT has no pre-logits layer (its loader drops
    one): a pre-training head's classifier would read other features there, so it leaves headless
    only (`name`: what the error names, default export_dir)."""
    if not out_path.endswith(WEIGHT_FILES):
        raise InputError(f"{out_path}: use a .safetensors, .pt, .pth or .bin file name")
    sd = read_weights(export_dir)
    if headless:
        sd = backbone(sd)
    elif "pre_logits.0.weight" in sd:
        raise InputError(f"{name or export_dir}: timm's VisionTransformer has no layer for the pre-training head's "
                         "tanh pre-logits: add --headless to export the backbone (timm num_classes=0), or export a "
                         "fine-tuned model")
    sd = to_timm(sd)
    if out_path.endswith(".safetensors"):
        data = save(sd)
    else:
        buf = io.BytesIO()
        torch.save(sd, buf)
        data = buf.getvalue()
    storage.write_bytes(out_path, data)  # a path or URI; parents made, written whole
    return out_path
