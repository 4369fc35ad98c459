"""Hugging Face `ViTModel` / `ViTForImageClassification` state dicts <-> our naming.

In: the hub naming (`encoder.layer.{i}...`) and transformers >= 5's module naming (`layers.{i}...`).
Out: a fine-tuning-head ViT as `ViTForImageClassification` (hub naming), or any plain ViT headless as
`ViTModel` (its pooler: our pre-logits), with their config.json and preprocessor_config.json.
"""
from __future__ import annotations

import re
from typing import Any, Mapping

import torch
from safetensors.torch import save

from .. import storage
from ..errors import InputError
from .convert_hybrid import f32 as _t
from .variants import decode_variant
from .weights import CONFIG, WEIGHTS, read_config, read_weights, source_info

StateDict = dict[str, torch.Tensor]


# Per-layer names: hub checkpoints (and save_pretrained) use the first spelling; transformers >= 5
# renamed the in-memory modules (`layers.{i}.attention.q_proj`, `.mlp.fc1`) and maps on load/save.
_HF_LAYER = {
    "layernorm_before": "norm1", "layernorm_after": "norm2",
    "attention.output.dense": "attn.proj", "intermediate.dense": "mlp.fc1", "output.dense": "mlp.fc2",
    "attention.o_proj": "attn.proj", "mlp.fc1": "mlp.fc1", "mlp.fc2": "mlp.fc2",
}
_HF_QKV = re.compile(r"attention\.(?:attention\.(query|key|value)|(q|k|v)_proj)$")
_HF_TOP = {
    "embeddings.patch_embeddings.projection": "patch_embed.proj",
    "layernorm": "norm", "pooler.dense": "pre_logits.0", "classifier": "head",
}


def from_hf(sd: Mapping[str, Any]) -> StateDict:
    """HF `ViTModel` (its tanh pooler = our pre-logits) or `ViTForImageClassification`
    (`classifier` = our head) state dict, with or without the `vit.` prefix, in the hub naming
    (`encoder.layer.{i}...`) or the transformers >= 5 module naming (`layers.{i}...`) -> ours.

    HF keeps q, k, v as three (D, D) Linears; we fuse them into one (3D, D) in q, k, v order.
    """
    src = {k.removeprefix("vit."): v for k, v in sd.items()}
    src.pop("embeddings.mask_token", None)  # only for masked-image-modelling inputs
    out: StateDict = {}
    qkv: dict[int, dict[str, Any]] = {}
    unknown = []
    for k, v in src.items():
        if k == "embeddings.cls_token":
            out["cls_token"] = _t(v)
        elif k == "embeddings.position_embeddings":
            out["pos_embed"] = _t(v)
        elif m := re.match(r"(?:encoder\.layer|layers)\.(\d+)\.(.+)\.(weight|bias)$", k):
            i, mod, kind = int(m.group(1)), m.group(2), m.group(3)
            if am := _HF_QKV.match(mod):
                name = am.group(1) or {"q": "query", "k": "key", "v": "value"}[am.group(2)]
                qkv.setdefault(i, {})[f"{name}.{kind}"] = v
            elif mod in _HF_LAYER:
                out[f"blocks.{i}.{_HF_LAYER[mod]}.{kind}"] = _t(v)
            else:
                unknown.append(k)
        elif (m := re.match(r"(.+)\.(weight|bias)$", k)) and m.group(1) in _HF_TOP:
            out[f"{_HF_TOP[m.group(1)]}.{m.group(2)}"] = _t(v)
        else:
            unknown.append(k)
    if unknown:
        raise InputError(f"HF ViT keys with no counterpart in our ViT: {unknown[:8]}: only "
                         "ViTModel / ViTForImageClassification state dicts are supported")
    for i, parts in qkv.items():
        for kind in ("weight", "bias"):
            try:
                out[f"blocks.{i}.attn.qkv.{kind}"] = torch.cat(
                    [_t(parts[f"{n}.{kind}"]) for n in ("query", "key", "value")])
            except KeyError as e:
                raise InputError(f"encoder.layer.{i}: attention {e.args[0]} missing (HF ViT with "
                               "qkv_bias=False is not supported)") from None
    return out


def backbone(sd: Mapping[str, torch.Tensor]) -> StateDict:
    """Our state dict without the classifier and the pre-logits before it (a headless export)."""
    return {k: v for k, v in sd.items() if not k.startswith(("head.", "pre_logits."))}


def to_hf(sd: Mapping[str, torch.Tensor], headless: bool = False) -> StateDict:
    """Ours -> HF `ViTForImageClassification` (hub naming, `vit.` prefix; q, k, v split back into
    three Linears). The inverse of from_hf for a fine-tuning-head ViT. headless: a `ViTModel` (no
    prefix), the classifier dropped and the pooler our features before it: the tanh pre-logits of a
    pre-training head, else an identity (hf_config's pooler_act "linear"), so `pooler_output` is
    always what our `forward_head(pre_logits=True)` gives."""
    if headless:
        out = {k.removeprefix("vit."): v for k, v in to_hf(backbone(sd)).items()}
        w = sd.get("pre_logits.0.weight")
        width = int(sd["cls_token"].shape[-1])
        out["pooler.dense.weight"] = _t(w) if w is not None else torch.eye(width)
        out["pooler.dense.bias"] = _t(sd["pre_logits.0.bias"]) if w is not None else torch.zeros(width)
        return out
    out: StateDict = {}
    top = {v: k for k, v in _HF_TOP.items() if k not in ("pooler.dense", "classifier")}
    layer = {"norm1": "layernorm_before", "norm2": "layernorm_after", "attn.proj": "attention.output.dense",
             "mlp.fc1": "intermediate.dense", "mlp.fc2": "output.dense"}
    for k, v in sd.items():
        if k.startswith("mpp."):  # masked patch prediction's training-only head
            continue
        if k in ("cls_token", "pos_embed"):
            out[f"vit.embeddings.{'cls_token' if k == 'cls_token' else 'position_embeddings'}"] = _t(v)
        elif m := re.match(r"blocks\.(\d+)\.(.+)\.(weight|bias)$", k):
            i, mod, kind = m.groups()
            if mod == "attn.qkv":
                for name, part in zip(("query", "key", "value"), _t(v).chunk(3)):
                    out[f"vit.encoder.layer.{i}.attention.attention.{name}.{kind}"] = part.clone()
            else:
                out[f"vit.encoder.layer.{i}.{layer[mod]}.{kind}"] = _t(v)
        elif k.startswith("head."):
            out[f"classifier.{k.split('.', 1)[1]}"] = _t(v)
        else:
            mod, _, kind = k.rpartition(".")
            out[f"vit.{top[mod]}.{kind}"] = _t(v)
    return out


def hf_config(spec, num_classes: int, image_size: int, classes: list[str] | None = None,
              pooler: int | None = None) -> dict[str, Any]:
    """The `ViTConfig` (as its config.json) of a plain ViT `spec` (variants.ViTSpec); `classes`:
    the label names (else HF's LABEL_i). pooler: a headless `ViTModel`'s, to_hf(headless=True)'s:
    the pre-logits' width (tanh), or 0 for the identity."""
    shape = {"model_type": "vit", "hidden_size": spec.width, "num_hidden_layers": spec.depth,
             "num_attention_heads": spec.heads, "intermediate_size": spec.mlp_dim, "hidden_act": "gelu",
             "layer_norm_eps": 1e-6, "image_size": image_size, "patch_size": spec.patch, "num_channels": 3,
             "qkv_bias": True, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
    if pooler is not None:
        return {"architectures": ["ViTModel"], **shape, "pooler_output_size": pooler or spec.width,
                "pooler_act": "tanh" if pooler else "linear"}
    names = classes if classes and len(classes) == num_classes else [f"LABEL_{i}" for i in range(num_classes)]
    return {"architectures": ["ViTForImageClassification"], **shape,
            "id2label": {str(i): name for i, name in enumerate(names)},
            "label2id": {name: i for i, name in enumerate(names)}}


def hf_preprocessor(image_size: int, mean, std) -> dict[str, Any]:
    """preprocessor_config.json: an image as `vitp predict` and evaluation take it (data/decode.py
    resize_center_crop: the shorter side to `image_size`, bicubic, the centre square; then /255 and
    the run's mean and std), in the image processor that does that in that order (BiT's: ViT's own
    resizes to a square, stretching the image)."""
    return {"image_processor_type": "BitImageProcessor", "do_convert_rgb": True,
            "do_resize": True, "size": {"shortest_edge": image_size}, "resample": 3,  # PIL bicubic
            "do_center_crop": True, "crop_size": {"height": image_size, "width": image_size},
            "do_rescale": True, "rescale_factor": 1 / 255,
            "do_normalize": True, "image_mean": list(mean), "image_std": list(std)}


def export_hf(export_dir: str, out_dir: str, name: str = "", headless: bool = False) -> str:
    """Our export dir -> a Hugging Face directory: model.safetensors, config.json (what
    `from_pretrained` reads) and preprocessor_config.json (what `pipeline` takes an image file with).
    A `ViTForImageClassification`, which classifies the class token with one linear layer, or with
    `headless` a `ViTModel` whose pooler gives our features before the classifier (a pre-training
    head's tanh pre-logits leave this way only). Global-average pooling and hybrids have no
    counterpart there and are refused (`name`: what the error names, default export_dir)."""
    cfg = read_config(export_dir)
    spec = decode_variant(cfg.model.variant)
    unsupported = [why for why, bad in (
        (f"a hybrid ({cfg.model.variant})", spec.resnet is not None),
        ("the pre-training head (tanh pre-logits): add --headless for a ViTModel whose pooler is the pre-logits, "
         "or export a fine-tuned model", cfg.model.head != "finetune" and not headless),
        ("global-average pooling (model.pool=gap)", cfg.model.pool != "cls")) if bad]
    if unsupported:
        raise InputError(f"{name or export_dir}: Hugging Face's ViT has no counterpart for {unsupported[0]}")
    sd = read_weights(export_dir)
    storage.write_bytes(storage.join(out_dir, WEIGHTS), save(to_hf(sd, headless), metadata={"format": "pt"}))
    pooler = int(sd["pre_logits.0.weight"].shape[0]) if "pre_logits.0.weight" in sd else 0
    config = hf_config(spec, cfg.model.num_classes, cfg.data.image_size, source_info(export_dir).classes,
                       pooler if headless else None)
    storage.write_json(storage.join(out_dir, CONFIG), config)
    storage.write_json(storage.join(out_dir, "preprocessor_config.json"),
                       hf_preprocessor(cfg.data.image_size, cfg.data.mean, cfg.data.std))
    return out_dir
