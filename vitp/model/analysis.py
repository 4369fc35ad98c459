"""Inspecting a trained ViT (paper Fig. 7): patch-embedding filter PCs, position-embedding
similarity, mean attention distance, written as one report (PNGs + analysis.json).

Owns the arithmetic and the pictures (Pillow, matplotlib's Agg canvas; no global pyplot state).
Files go through vitp.storage. Must not know about Ray, DeepSpeed or MLflow.
"""
from __future__ import annotations

import io
from typing import Any, Optional

import numpy as np
import torch
from PIL import Image

from .. import storage
from .attention import mean_attention_distance, patch_distances, plot_attention_distance
from .vit import ViT

COMPONENTS = 28  # principal components shown, as in the paper's Figure 7 (left): 4 rows of 7
REPORT = "analysis.json"
FILTERS_PNG = "patch_embed_pcs.png"
POS_PNG = "pos_embed_similarity.png"
ATTENTION_PNG = "attention_distance.png"


# ---------------------------------------------------------------------- the arithmetic


def filter_components(weight: torch.Tensor, k: int = COMPONENTS) -> tuple[np.ndarray, np.ndarray]:
    """Principal components of RGB patch-embedding filters (D, 3, P, P).

    The D filters are flattened to (D, 3 P P), centred over the filters and decomposed by SVD.
    Returns (components (k', P, P, 3), each scaled to [0, 1] for display; the explained-variance
    ratio of every component, (min(D, 3 P P),)), k' = min(k, D, 3 P P). A component's sign is
    arbitrary (as in any PCA).
    """
    if weight.ndim != 4 or weight.shape[1] != 3:
        raise ValueError(f"patch-embedding weight must be (D, 3, P, P), got {tuple(weight.shape)}")
    D, _, ph, pw = weight.shape
    x = weight.detach().double().cpu().reshape(D, -1)  # (D, 3 P P), channel-major
    x = x - x.mean(dim=0, keepdim=True)
    _, s, vt = torch.linalg.svd(x, full_matrices=False)  # vt: (min(D, 3PP), 3 P P)
    var = s**2
    ratio = (var / var.sum().clamp_min(1e-30)).numpy()
    k = min(k, vt.shape[0])
    comps = vt[:k].reshape(k, 3, ph, pw).permute(0, 2, 3, 1).numpy()  # (k, P, P, 3): as pictures
    lo = comps.min(axis=(1, 2, 3), keepdims=True)
    span = comps.max(axis=(1, 2, 3), keepdims=True) - lo
    return (comps - lo) / np.where(span > 0, span, 1.0), ratio


def _grid_shape(grid: int | tuple[int, int]) -> tuple[int, int]:
    return (grid, grid) if isinstance(grid, int) else tuple(grid)


def pos_embed_similarity(pos: torch.Tensor) -> np.ndarray:
    """Cosine similarity of every patch's position embedding with every other: (N, D) -> (N, N)."""
    p = torch.nn.functional.normalize(pos.detach().double().cpu(), dim=-1)  # (N, D), unit rows
    return (p @ p.T).numpy()


def similarity_vs_distance(sim: np.ndarray, grid: int | tuple[int, int]) -> dict[str, Optional[float]]:
    """How position-embedding similarity (N, N) relates to where patches sit on the grid.

    `distance_corr`: Pearson correlation between similarity and the Euclidean grid distance
    (in patches) over all pairs i != j; negative = nearer patches are more similar, ~0 = no
    spatial structure. `neighbour_similarity`: mean over 4-neighbour pairs (distance 1),
    `other_similarity`: mean over all other pairs i != j. None where a set of pairs is empty
    or the correlation is undefined (a constant input).
    """
    gh, gw = _grid_shape(grid)
    n = gh * gw
    if sim.shape != (n, n):
        raise ValueError(f"similarity is {sim.shape}, grid {gh}x{gw} needs ({n}, {n})")
    dist = patch_distances((gh, gw), 1).numpy()  # (N, N) in patch units
    off = ~np.eye(n, dtype=bool)
    near = off & np.isclose(dist, 1.0)
    s, d = sim[off], dist[off]
    corr = float(np.corrcoef(s, d)[0, 1]) if s.size > 1 and s.std() > 0 and d.std() > 0 else None

    def mean(mask):
        return float(sim[mask].mean()) if mask.any() else None

    return {"distance_corr": corr, "neighbour_similarity": mean(near), "other_similarity": mean(off & ~near)}


# ------------------------------------------------------------------------- pictures


def _need_matplotlib():
    try:
        import matplotlib  # noqa: F401  # lazy: matplotlib is optional (the demo extra)
    except ImportError:
        raise ImportError("Figure 7 pictures need matplotlib: pip install 'vit-pipeline[demo]' "
                          "(or pip install matplotlib)") from None


def _png(path: str, array_uint8: np.ndarray) -> str:
    buf = io.BytesIO()
    Image.fromarray(array_uint8).save(buf, format="PNG")
    storage.write_bytes(path, buf.getvalue())  # a path or URI
    return path


def save_filter_grid(components: np.ndarray, path: str, cols: int = 7, cell: int = 64, pad: int = 4) -> str:
    """Components (k, P, P, 3) in [0, 1] as one PNG: rows of `cols`, each upscaled (nearest)
    to about `cell` pixels, on a white background; returns path."""
    if components.ndim != 4 or components.shape[-1] != 3:
        raise ValueError(f"components must be (k, P, P, 3), got shape {components.shape}")
    k, ph, pw, _ = components.shape
    scale = max(1, cell // max(ph, pw))
    h, w = ph * scale, pw * scale
    cols = min(cols, k)
    rows = -(-k // cols)
    canvas = np.full((pad + rows * (h + pad), pad + cols * (w + pad), 3), 255, np.uint8)
    for i, c in enumerate(components):
        r, q = divmod(i, cols)
        tile = np.repeat(np.repeat(c, scale, axis=0), scale, axis=1)  # (h, w, 3)
        y, x = pad + r * (h + pad), pad + q * (w + pad)
        canvas[y:y + h, x:x + w] = np.clip(tile * 255.0 + 0.5, 0, 255).astype(np.uint8)
    return _png(path, canvas)


def similarity_mosaic(sim: np.ndarray, grid: int | tuple[int, int]) -> np.ndarray:
    """(N, N) similarities -> one (gh (gh+1) - 1, gw (gw+1) - 1) array: tile (i, j) is the gh x gw
    map of patch (i, j)'s similarity to every patch, tiles separated by one NaN row/column."""
    gh, gw = _grid_shape(grid)
    out = np.full((gh * (gh + 1) - 1, gw * (gw + 1) - 1), np.nan)
    for i in range(gh):
        for j in range(gw):
            y, x = i * (gh + 1), j * (gw + 1)
            out[y:y + gh, x:x + gw] = sim[i * gw + j].reshape(gh, gw)  # row-major patches
    return out


def save_similarity_grid(sim: np.ndarray, grid: int | tuple[int, int], path: str, title: str = "") -> str:
    """The grid of similarity maps (similarity_mosaic) as a PNG, viridis over [-1, 1] with a colour
    bar, axes numbered by input patch row/column (paper Fig. 7 centre); returns path."""
    _need_matplotlib()
    from matplotlib import colormaps  # lazy: optional dependency (see _need_matplotlib)
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    gh, gw = _grid_shape(grid)
    mosaic = similarity_mosaic(sim, (gh, gw))
    cmap = colormaps["viridis"].with_extremes(bad="white")  # NaN gaps between tiles
    fig = Figure(figsize=(5.2, 4.4), dpi=150)
    FigureCanvasAgg(fig)  # Agg canvas without touching pyplot's global backend
    ax = fig.add_subplot(1, 1, 1)
    im = ax.imshow(mosaic, cmap=cmap, vmin=-1, vmax=1, interpolation="nearest")
    ax.set_xticks([j * (gw + 1) + (gw - 1) / 2 for j in range(gw)], [str(j + 1) for j in range(gw)])
    ax.set_yticks([i * (gh + 1) + (gh - 1) / 2 for i in range(gh)], [str(i + 1) for i in range(gh)])
    ax.tick_params(length=0, labelsize=6 if max(gh, gw) > 12 else 8)
    ax.set_xlabel("input patch column")
    ax.set_ylabel("input patch row")
    for side in ax.spines.values():
        side.set_visible(False)
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04).set_label("cosine similarity")
    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    storage.write_bytes(path, buf.getvalue())  # a path or URI
    return path


# --------------------------------------------------------------------------- the report


def _rgb_filters(model: ViT) -> tuple[Optional[torch.Tensor], str]:
    """The first filters that read RGB: the patch embedding's (D, 3, P, P), or for a hybrid (whose
    projection reads ResNet channels) its root convolution's 7x7 ones, standardised as they are
    applied; or None and why not."""
    backbone = getattr(getattr(model, "patch_embed", None), "backbone", None)
    if backbone is not None:
        return backbone.stem.conv.standardized(), ""
    w = getattr(getattr(getattr(model, "patch_embed", None), "proj", None), "weight", None)
    if w is None or w.ndim != 4:
        return None, "the model has no convolutional patch embedding (patch_embed.proj)"
    if w.shape[1] != 3:
        return None, f"the patch embedding reads {w.shape[1]} input channels, not RGB pixels"
    return w, ""


@torch.no_grad()
def write_report(model: ViT, out_dir: str, images: Optional[torch.Tensor] = None,
                 components: int = COMPONENTS) -> dict[str, Any]:
    """Write the Figure 7 report of `model` into `out_dir` (a path or URI); returns it as a dict.

    out_dir/patch_embed_pcs.png (skipped, with the reason in the report, unless the patch
    embedding reads RGB), pos_embed_similarity.png, attention_distance.png (only with `images`:
    normalised (B, 3, S, S), as the model sees them) and analysis.json with the numbers.
    """
    spec = model.spec
    variant = spec.name if "/" in spec.name else f"{spec.name}/{spec.patch}"  # hybrids: "R50+B/16"
    title = f"{variant} at {model.image_size} px"
    gh, gw = _grid_shape(model.grid)
    report: dict[str, Any] = {"model": {"variant": variant, "image_size": model.image_size,
                                        "grid": [gh, gw], "pixels_per_token": spec.stride}}
    files: list[str] = []

    weight, why_not = _rgb_filters(model)
    if weight is None:
        report["patch_embed"] = {"skipped": why_not}
    else:
        comps, ratio = filter_components(weight, components)
        files.append(save_filter_grid(comps, storage.join(out_dir, FILTERS_PNG)))
        report["patch_embed"] = {"filters": "resnet root conv" if spec.hybrid else "patch embedding",
                                 "components": len(comps), "explained_variance": ratio[:len(comps)].tolist(),
                                 "explained_variance_total": float(ratio[:len(comps)].sum())}

    pos = model.pos_embed[0, 1:]  # (N, D): the class token's slot left out
    if pos.shape[0] != gh * gw:
        raise ValueError(f"pos_embed has {pos.shape[0]} patch positions, grid {gh}x{gw} needs {gh * gw}")
    sim = pos_embed_similarity(pos)
    report["pos_embed"] = similarity_vs_distance(sim, (gh, gw))
    files.append(save_similarity_grid(sim, (gh, gw), storage.join(out_dir, POS_PNG), title))

    if images is None or len(images) == 0:
        report["attention_distance"] = {"skipped": "no images given"}
    else:
        dist = mean_attention_distance(model, images)  # (L, H) pixels
        report["attention_distance"] = {"images": int(len(images)), "pixels": dist.tolist(),
                                        "layer_mean": dist.mean(dim=1).tolist()}
        files.append(plot_attention_distance(dist, storage.join(out_dir, ATTENTION_PNG), title))

    report["files"] = [storage.basename(f) for f in files]
    storage.write_json(storage.join(out_dir, REPORT), report)
    return report


def summary_lines(report: dict[str, Any]) -> list[str]:
    """A few lines a person reads: one per figure."""
    def num(x, fmt=".2f"):
        return "n/a" if x is None else format(x, fmt)

    pe, pos, att = report["patch_embed"], report["pos_embed"], report["attention_distance"]
    lines = [f"patch-embedding filters: skipped: {pe['skipped']}" if "skipped" in pe else
             f"patch-embedding filters: the top {pe['components']} principal components explain "
             f"{100 * pe['explained_variance_total']:.1f}% of the variance (first: "
             f"{100 * pe['explained_variance'][0]:.1f}%)",
             f"position embeddings: similarity vs grid distance r = {num(pos['distance_corr'], '+.3f')}; "
             f"4-neighbours {num(pos['neighbour_similarity'])} vs other pairs {num(pos['other_similarity'])}"]
    if "skipped" in att:
        lines.append(f"mean attention distance: skipped: {att['skipped']}")
    else:
        per_layer = ", ".join(f"{d:.1f}" for d in att["layer_mean"])
        lines.append(f"mean attention distance ({att['images']} images), per layer, px: {per_layer}")
    return lines
