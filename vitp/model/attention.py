"""What a ViT looks at: attention rollout (paper Fig. 6) and mean attention distance (Fig. 7).

Owns the arithmetic over `ViT.attention_maps` and the PNG/plot writers (Pillow, matplotlib's Agg
canvas; no global pyplot state). Must not know about Ray, DeepSpeed or MLflow.
"""
from __future__ import annotations

import io
from typing import Optional, Sequence

import numpy as np
import torch
from PIL import Image

from .. import storage
from ..data.decode import resize_center_crop
from ..data.ingest import normalize
from .vit import ViT


def _maps(model: ViT, images: torch.Tensor) -> list[torch.Tensor]:
    """Per-layer softmax weights [(B, H, N+1, N+1)] in eval mode (no dropout), float32."""
    was_training = model.training
    model.eval()
    try:
        return [a.float() for a in model.attention_maps(images)]
    finally:
        model.train(was_training)


def rollout_from_maps(maps: Sequence[torch.Tensor], grid: int | tuple[int, int]) -> torch.Tensor:
    """Attention rollout (Abnar & Zuidema 2020) of per-layer maps [(B, H, T, T)], T = 1 + gh*gw.

    Each layer: average the heads, add the identity for the residual path, renormalise rows;
    multiply the layers from the input up; read the class-token row over the patch tokens and
    renormalise it to sum to 1. Returns (B, gh, gw).
    """
    gh, gw = (grid, grid) if isinstance(grid, int) else grid
    rollout = None
    for a in maps:
        a = a.mean(dim=1)  # (B, T, T): heads averaged
        a = a + torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
        a = a / a.sum(dim=-1, keepdim=True)
        rollout = a if rollout is None else a @ rollout  # (B, T, T): layer l applied after l-1
    if rollout is None:
        raise ValueError("no attention maps: the model has no blocks")
    cls_to_patches = rollout[:, 0, 1:]  # (B, N)
    if cls_to_patches.shape[-1] != gh * gw:
        raise ValueError(f"maps have {cls_to_patches.shape[-1]} patch tokens, grid {gh}x{gw} needs {gh * gw}")
    cls_to_patches = cls_to_patches / cls_to_patches.sum(dim=-1, keepdim=True)
    return cls_to_patches.reshape(-1, gh, gw)


@torch.no_grad()
def attention_rollout(model: ViT, images: torch.Tensor) -> torch.Tensor:
    """Normalised images (B, 3, S, S) -> rollout over the patch grid (B, gh, gw), rows sum to 1."""
    return rollout_from_maps(_maps(model, images), model.grid)


def patch_distances(grid: int | tuple[int, int], patch: int) -> torch.Tensor:
    """Euclidean pixel distance between patch centres, (N, N), patches in row-major order."""
    gh, gw = (grid, grid) if isinstance(grid, int) else grid
    ys, xs = torch.meshgrid(torch.arange(gh), torch.arange(gw), indexing="ij")
    centres = torch.stack([ys.flatten(), xs.flatten()], dim=-1).double() * patch  # (N, 2)
    return torch.cdist(centres, centres)  # (N, N)


def attention_distance_from_maps(maps: Sequence[torch.Tensor], grid: int | tuple[int, int],
                                 patch: int) -> torch.Tensor:
    """Mean attention distance in pixels, (L, H), from per-layer maps [(B, H, T, T)].

    The class token is left out as query and as key; each query's weights over the patch keys
    are renormalised, so a query's distance is the attention-weighted mean distance to the
    patches it attends to (in [0, image diagonal]). Averaged over queries and images.
    """
    dist = patch_distances(grid, patch)  # (N, N)
    out = []
    for a in maps:
        p = a[:, :, 1:, 1:].double()  # (B, H, N, N): patch queries -> patch keys
        p = p / p.sum(dim=-1, keepdim=True).clamp_min(1e-12)
        per_query = (p * dist).sum(dim=-1)  # (B, H, N)
        out.append(per_query.mean(dim=(0, 2)))  # (H,)
    return torch.stack(out).float()  # (L, H)


@torch.no_grad()
def mean_attention_distance(model: ViT, images: torch.Tensor) -> torch.Tensor:
    """Normalised images (B, 3, S, S) -> mean attention distance per layer and head (L, H), pixels."""
    return attention_distance_from_maps(_maps(model, images), model.grid, model.spec.stride)


# ------------------------------------------------------------------------------- pictures


def _as_numpy(x) -> np.ndarray:
    return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


def _need_matplotlib():
    try:
        import matplotlib  # noqa: F401  # lazy: matplotlib is optional (the demo extra)
    except ImportError:
        raise ImportError("attention pictures need matplotlib: pip install 'vit-pipeline[demo]' "
                          "(or pip install matplotlib)") from None


VIEW_SIZE = 384  # rollout pictures are drawn at this size (each panel), from the original pixels


def save_rollout_png(image_uint8_hwc, rollout, path: str, alpha: float = 0.55,
                     size: int = VIEW_SIZE) -> str:
    """Write the image and its rollout heat map overlaid side by side as a PNG (2 size x size);
    returns path.

    `image_uint8_hwc`: the original (H, W, 3) uint8 image (greyscale (H, W) is accepted), any
    size: it is resized and centre-cropped as evaluation does, but to `size` pixels, so the
    picture shows the model's view at a readable size. `rollout`: (gh, gw), upsampled
    bilinearly and scaled to its own maximum.
    """
    _need_matplotlib()
    from matplotlib import colormaps  # lazy: optional dependency (see _need_matplotlib)

    img = _as_numpy(image_uint8_hwc)
    if img.ndim == 2:
        img = np.repeat(img[..., None], 3, axis=-1)
    if img.dtype != np.uint8 or img.ndim != 3 or img.shape[-1] != 3:
        raise ValueError(f"image must be (H, W, 3) uint8, got {img.shape} {img.dtype}: pass the "
                         "un-normalised image (e.g. the shard's pixels), not the model input")
    r = _as_numpy(rollout).astype(np.float64)
    if r.ndim != 2:
        raise ValueError(f"rollout must be (gh, gw) for one image, got shape {r.shape}")
    view = resize_center_crop(img, size)  # (size, size, 3): the model's crop, at display size
    heat = Image.fromarray(r.astype(np.float32)).resize((size, size), Image.BILINEAR)
    heat = np.asarray(heat, dtype=np.float64)
    heat = heat / heat.max() if heat.max() > 0 else heat  # (size, size) in [0, 1]
    colour = colormaps["inferno"](heat)[..., :3] * 255.0  # (size, size, 3)
    overlay = (1 - alpha) * view.astype(np.float64) + alpha * colour
    both = np.concatenate([view, np.clip(overlay, 0, 255).astype(np.uint8)], axis=1)  # (size, 2 size, 3)
    buf = io.BytesIO()
    Image.fromarray(both).save(buf, format="PNG")
    storage.write_bytes(path, buf.getvalue())  # a path or URI
    return path


def write_rollout_pngs(model: ViT, images_uint8, labels: Sequence[int], out_dir: str,
                       originals: Optional[Sequence] = None) -> list[str]:
    """Rollout PNGs of a batch: images (n, S, S, 3) uint8 at the model's resolution, their labels,
    and the `originals` to draw on (default: the images themselves).

    Writes out_dir/rollout_{i}_label{label}_pred{prediction}.png per image (save_rollout_png) and
    returns the paths. The model input is the images normalised with the default mean/std (0.5).
    """
    images = _as_numpy(images_uint8)
    x = normalize(torch.from_numpy(np.ascontiguousarray(images))).contiguous()  # (n, 3, S, S)
    with torch.no_grad():
        rollout = attention_rollout(model, x)  # (n, gh, gw)
        was_training = model.training
        model.eval()
        try:
            pred = model(x).argmax(-1).tolist()
        finally:
            model.train(was_training)
    paths = []
    for i, label in enumerate(labels):
        path = storage.join(out_dir, f"rollout_{i}_label{int(label)}_pred{pred[i]}.png")
        paths.append(save_rollout_png(images[i] if originals is None else originals[i], rollout[i], path))
    return paths


def plot_attention_distance(dist, path: str, title: str = "") -> str:
    """Scatter of mean attention distance (pixels) against layer, one dot per head (paper Fig. 7)."""
    _need_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # lazy: optional dependency
    from matplotlib.figure import Figure

    d = _as_numpy(dist)
    if d.ndim != 2:
        raise ValueError(f"dist must be (layers, heads), got shape {d.shape}")
    L, H = d.shape
    fig = Figure(figsize=(4.5, 3.5), dpi=120)
    FigureCanvasAgg(fig)  # Agg canvas without touching pyplot's global backend
    ax = fig.add_subplot(1, 1, 1)
    for h in range(H):
        ax.scatter(np.arange(1, L + 1), d[:, h], s=14, label=f"head {h + 1}" if H <= 16 else None)
    ax.set_xlabel("network depth (layer)")
    ax.set_ylabel("mean attention distance (pixels)")
    ax.set_xticks(np.arange(1, L + 1))
    ax.set_ylim(bottom=0)
    if title:
        ax.set_title(title)
    if H <= 16:
        ax.legend(fontsize=6, ncol=2, loc="lower right")
    fig.tight_layout()
    buf = io.BytesIO()
    name = storage.basename(path)
    fig.savefig(buf, format=name.rpartition(".")[2].lower() if "." in name else "png")
    storage.write_bytes(path, buf.getvalue())  # a path or URI
    return path
