"""Hugging Face `ViTModel` / `ViTForImageClassification` state dicts <-> our naming.

In: the hub naming (`encoder.layer.{i}...`) and transformers >= 5's module naming (`layers.{i}...`).
Out: a fine-tuning-head ViT as `ViTForImageClassification` (hub naming) and its config.json.
"""
from __future__ import annotations

import re
from typing import Any, Mapping

import torch

from ..errors import InputError
from .convert_hybrid import f32 as _t

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


def to_hf(sd: Mapping[str, torch.Tensor]) -> StateDict:
    """Ours -> HF `ViTForImageClassification` (hub naming, `vit.` prefix; q, k, v split back into
    three Linears). The inverse of from_hf for a fine-tuning-head ViT."""
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


def hf_config(spec, num_classes: int, image_size: int, classes: list[str] | None = None) -> dict[str, Any]:
    """The `ViTConfig` (as its config.json) of a plain ViT `spec` (variants.ViTSpec); `classes`:
    the label names (else HF's LABEL_i)."""
    names = classes if classes and len(classes) == num_classes else [f"LABEL_{i}" for i in range(num_classes)]
    return {"architectures": ["ViTForImageClassification"], "model_type": "vit",
            "hidden_size": spec.width, "num_hidden_layers": spec.depth, "num_attention_heads": spec.heads,
            "intermediate_size": spec.mlp_dim, "hidden_act": "gelu", "layer_norm_eps": 1e-6,
            "image_size": image_size, "patch_size": spec.patch, "num_channels": 3, "qkv_bias": True,
            "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0,
            "id2label": {str(i): name for i, name in enumerate(names)},
            "label2id": {name: i for i, name in enumerate(names)}}
