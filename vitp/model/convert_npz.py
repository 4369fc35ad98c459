"""Official google-research/vision_transformer (and big_vision) `.npz` checkpoints -> our naming.

Reads the arrays without unpickling anything, finds the layout (the original, optionally under
`opt/target/`, its hybrids, big_vision's unscanned one) and re-lays the tensors out; convert.py infers
the variant from the result and writes the export.
"""
from __future__ import annotations

import math
import re
from typing import Any, Mapping

import numpy as np
import torch

from .. import storage
from ..errors import InputError
from .convert_hybrid import f32 as _t
from .convert_hybrid import resnet_from_npz

# The two JAX layouts name the sub-modules of an encoder block differently.
_JAX_BLOCK_NAMES = {
    "official": {"ln1": "LayerNorm_0", "mha": "MultiHeadDotProductAttention_1",
                 "ln2": "LayerNorm_2", "mlp": "MlpBlock_3"},
    "big_vision": {"ln1": "LayerNorm_0", "mha": "MultiHeadDotProductAttention_0",
                   "ln2": "LayerNorm_1", "mlp": "MlpBlock_0"},
}


# What an .npz may declare, checked from its zip directory and each .npy header before any array is
# read: the largest importable ViT (H/14, 632M parameters) is 2.5 GB of float32, its largest array (an
# ImageNet-21k head, 21843 x 1280) 112 MB. Room for a checkpoint that also holds optimizer state
# (`opt/`), none for a zip bomb (a few KB that inflate, or claim to, to terabytes).
NPZ_MEMBER_BYTES = 2 << 30
NPZ_TOTAL_BYTES = 16 << 30


def _npy_bytes(member) -> int:
    """Bytes the .npy header of the open zip member `member` declares: itself and its array's data
    (shape x item size); ValueError for a header numpy cannot parse."""
    version = np.lib.format.read_magic(member)
    read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
    shape, _, dtype = read(member)  # 2.0 and 3.0 share the layout (3.0: UTF-8 field names)
    if dtype.hasobject:  # a pickle, not item-sized data: np.load (allow_pickle=False) refuses it
        return member.tell()
    return member.tell() + math.prod(shape) * dtype.itemsize  # header + data


def check_npz_sizes(src: str, local: str) -> None:
    """InputError (one line naming `src`) unless every member of the .npz at `local` declares at most
    NPZ_MEMBER_BYTES uncompressed (zipfile stops reading a member there), NPZ_TOTAL_BYTES in all, and
    each .npy header an array that fits in the bytes its member declares; reads only headers."""
    import zipfile

    with zipfile.ZipFile(local) as zf:
        infos = zf.infolist()
        for info in infos:
            if info.file_size > NPZ_MEMBER_BYTES:
                raise InputError(f"{src}: its member {info.filename!r} declares {info.file_size} bytes "
                                 f"uncompressed, more than the {NPZ_MEMBER_BYTES} any array of an importable ViT "
                                 "takes (a zip bomb, or not a ViT checkpoint); no array was read")
        total = sum(i.file_size for i in infos)
        if total > NPZ_TOTAL_BYTES:
            raise InputError(f"{src}: its members declare {total} bytes uncompressed in all, more than the "
                             f"{NPZ_TOTAL_BYTES} an importable ViT's arrays take; no array was read")
        for info in infos:
            if not info.filename.endswith(".npy"):
                continue
            with zf.open(info) as member:
                declared = _npy_bytes(member)
            if declared > info.file_size:
                raise InputError(f"{src}: its member {info.filename!r} has an .npy header declaring {declared} "
                                 f"bytes, more than the {info.file_size} the member holds (damaged or crafted); "
                                 "no array was read")


def load_npz(src: str | Mapping[str, Any]) -> dict[str, np.ndarray]:
    """The arrays of an .npz (a path or URI, or {key: array} as is); never unpickles, and reads no
    member before every member's declared size is within bounds (check_npz_sizes)."""
    if isinstance(src, Mapping):
        return {k: np.asarray(v) for k, v in src.items()}
    import zipfile

    with storage.local_copy(src) as local:
        with open(local, "rb") as f:
            if f.read(6)[:2] != b"PK":  # an .npz is a zip archive of .npy files
                raise InputError(f"{src}: not an .npz file (no zip header); is it the right file, "
                                 "and is the download complete?")
        try:
            check_npz_sizes(src, local)
            with np.load(local, allow_pickle=False) as z:
                return {k: z[k] for k in z.files}
        except InputError:  # check_npz_sizes's own line (an InputError is a ValueError too)
            raise
        except ValueError as e:
            if "pickle" not in str(e):
                raise InputError(f"{src}: not a readable .npz ({e})") from None
            raise InputError(f"{src}: holds pickled Python objects, which are never loaded (loading "
                             "them could run code): an official ViT .npz holds arrays only") from None
        except (OSError, EOFError, zipfile.BadZipFile, NotImplementedError, RuntimeError) as e:
            # NotImplementedError: a compression zipfile lacks; RuntimeError: an encrypted member
            raise InputError(f"{src}: not a readable .npz ({e}); is the download complete?") from None


def npz_state_dict(w: Mapping[str, np.ndarray]) -> tuple[dict[str, torch.Tensor], str, int | None]:
    """An official ViT `.npz`'s arrays -> (state dict in our naming, its layout, heads).

    Accepts the vision_transformer layout (optionally under `opt/target/`), its hybrids (ResNet
    `conv_root`, `block{s}/unit{u}/...`) and big_vision's unscanned one (`params/`,
    `pos_embedding` at the top). Re-layouts: conv kernel HWIO (P,P,C,D)
    -> OIHW (D,C,P,P); per-head q/k/v kernels (D,H,d) -> one fused (3D, D) qkv weight; out kernel
    (H,d,D) -> (D, H*d); Dense kernels (in, out) -> Linear weights (out, in).
    """
    roots = [k[: -len("embedding/kernel")] for k in w if k.endswith("embedding/kernel")]
    if not roots:
        raise InputError("no 'embedding/kernel' in the .npz: not an official ViT checkpoint "
                       f"(first keys: {sorted(w)[:5]})")
    p = min(roots, key=len)  # "" | "opt/target/" | "params/" | "params/img/"
    layout = "big_vision" if f"{p}pos_embedding" in w else "official"
    pos_key = f"{p}pos_embedding" if layout == "big_vision" else f"{p}Transformer/posembed_input/pos_embedding"
    if f"{p}Transformer/encoderblock/LayerNorm_0/scale" in w:
        raise InputError("this .npz stores scanned (stacked) encoder blocks: re-save it unscanned "
                         "(Transformer/encoderblock_{i}/...) before importing")
    if f"{p}cls" not in w:
        raise InputError("the .npz has no class token ('cls'): only classifier='token' ViTs are "
                         "supported (global-average-pool checkpoints are not)")
    names = _JAX_BLOCK_NAMES[layout]

    def get(key: str) -> np.ndarray:
        try:
            return w[p + key]
        except KeyError:
            raise InputError(f"{p + key!r} missing from the .npz ({layout} layout): the checkpoint "
                           "is incomplete or not a ViT") from None

    sd = {
        "patch_embed.proj.weight": _t(get("embedding/kernel").transpose(3, 2, 0, 1)),  # (D, C, P, P)
        "patch_embed.proj.bias": _t(get("embedding/bias")),
        "cls_token": _t(get("cls")),  # (1, 1, D)
        "pos_embed": _t(w[pos_key]),  # (1, N+1, D)
        **resnet_from_npz([k[len(p):] for k in w if k.startswith(p)], get),  # hybrids
    }
    depth = len({int(m.group(1)) for k in w if (m := re.match(re.escape(p) + r"Transformer/encoderblock_(\d+)/", k))})
    heads = None
    for i in range(depth):
        b, o = f"Transformer/encoderblock_{i}/", f"blocks.{i}."
        mha = f"{b}{names['mha']}/"
        q = get(mha + "query/kernel")  # (D, H, d)
        D, heads, d = q.shape
        # Linear weight rows are output features in (head, dim) order, which matches our
        # reshape(B, N, 3, H, d) of the fused projection.
        sd[o + "attn.qkv.weight"] = _t(np.concatenate(
            [get(f"{mha}{n}/kernel").reshape(D, heads * d).T for n in ("query", "key", "value")]))
        sd[o + "attn.qkv.bias"] = _t(np.concatenate(
            [get(f"{mha}{n}/bias").reshape(heads * d) for n in ("query", "key", "value")]))
        sd[o + "attn.proj.weight"] = _t(get(mha + "out/kernel").reshape(heads * d, D).T)  # (D, H*d)
        sd[o + "attn.proj.bias"] = _t(get(mha + "out/bias"))
        for ours, theirs in (("norm1", names["ln1"]), ("norm2", names["ln2"])):
            sd[f"{o}{ours}.weight"] = _t(get(f"{b}{theirs}/scale"))
            sd[f"{o}{ours}.bias"] = _t(get(f"{b}{theirs}/bias"))
        for j in (0, 1):
            sd[f"{o}mlp.fc{j + 1}.weight"] = _t(get(f"{b}{names['mlp']}/Dense_{j}/kernel").T)
            sd[f"{o}mlp.fc{j + 1}.bias"] = _t(get(f"{b}{names['mlp']}/Dense_{j}/bias"))
    sd["norm.weight"] = _t(get("Transformer/encoder_norm/scale"))
    sd["norm.bias"] = _t(get("Transformer/encoder_norm/bias"))
    if f"{p}pre_logits/kernel" in w:
        sd["pre_logits.0.weight"] = _t(get("pre_logits/kernel").T)  # (R, D)
        sd["pre_logits.0.bias"] = _t(get("pre_logits/bias"))
    if f"{p}head/kernel" in w:
        sd["head.weight"] = _t(get("head/kernel").T)  # (K, R)
        sd["head.bias"] = _t(get("head/bias"))
    return sd, layout, heads
