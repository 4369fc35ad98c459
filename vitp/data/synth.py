"""The synthetic pre-training corpus: fractals from random iterated function systems (IFS).

As in FractalDB (Kataoka et al.): one IFS per class (2-4 contractive affine maps, chosen with
probability ~ |det|), rendered by the chaos game; each image perturbs the maps and varies colour,
background and point count. A pure function of (seed, class, index); knows no shards or models.
"""
from __future__ import annotations

import hashlib
import io
import os
import re
from typing import Optional

import numpy as np
from PIL import Image

from .. import storage


def _rng(*parts: int) -> np.random.Generator:
    """A generator seeded from a tuple of ints, so (seed, class, index) streams never collide."""
    return np.random.default_rng([int(p) & 0xFFFFFFFF for p in parts])


def class_system(seed: int, cls: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The IFS of class `cls`: A (M, 2, 2), b (M, 2), p (M,) with M in 2..4.

    Each A = R(t1) diag(s1, s2) R(t2), singular values in [0.25, 0.85] so every map contracts
    and the attractor exists; a random reflection makes half the maps orientation-reversing.
    Systems whose attractor fills too little or too much of its box are redrawn (FractalDB's
    filling-rate filter) so that no class is a dot or a blob.
    """
    rng = _rng(seed, 0x1F5, cls)
    for _ in range(50):
        m = int(rng.integers(2, 5))
        a = np.empty((m, 2, 2))
        for i in range(m):
            t1, t2 = rng.uniform(0, 2 * np.pi, 2)
            s = rng.uniform(0.25, 0.85, 2)
            r1 = np.array([[np.cos(t1), -np.sin(t1)], [np.sin(t1), np.cos(t1)]])
            r2 = np.array([[np.cos(t2), -np.sin(t2)], [np.sin(t2), np.cos(t2)]])
            flip = np.diag([1.0, -1.0]) if rng.random() < 0.5 else np.eye(2)
            a[i] = r1 @ np.diag(s) @ flip @ r2
        b = rng.uniform(-1, 1, (m, 2))
        det = np.abs(np.linalg.det(a))
        p = det / det.sum()
        fill = _filling_rate(a, b, p, rng)
        if 0.08 <= fill <= 0.6:
            return a, b, p
    return a, b, p


def _filling_rate(a, b, p, rng) -> float:
    pts = _chaos_game(a, b, p, rng, chains=128, steps=40)
    img = _rasterise(pts, 32, margin=0)
    return float((img > 0).mean())


def _chaos_game(a: np.ndarray, b: np.ndarray, p: np.ndarray, rng: np.random.Generator,
                chains: int, steps: int, burn_in: int = 12) -> np.ndarray:
    """Run `chains` independent chaos games for `steps` steps; points after burn-in, (N, 2)."""
    x = rng.uniform(-1, 1, (chains, 2))
    cum = np.cumsum(p)
    out = []
    for t in range(steps):
        idx = np.minimum(np.searchsorted(cum, rng.random(chains)), len(p) - 1)
        x = np.einsum("nij,nj->ni", a[idx], x) + b[idx]  # (chains, 2)
        if t >= burn_in:
            out.append(x)
    return np.concatenate(out, axis=0)


def _rasterise(pts: np.ndarray, size: int, margin: int,
               pose: Optional[tuple[float, float, float, float]] = None) -> np.ndarray:
    """Point cloud -> (size, size) hit counts, fitted into the frame keeping aspect ratio, then
    posed: rotated by angle, scaled by zoom (<= 1/sqrt 2 keeps any rotation inside the frame)
    and shifted by (dx, dy) in units of the room left, pose = (angle, zoom, dx, dy)."""
    lo, hi = np.percentile(pts, 0.5, axis=0), np.percentile(pts, 99.5, axis=0)
    span = float(max(hi[0] - lo[0], hi[1] - lo[1], 1e-6))
    centre = (lo + hi) / 2
    inner = size - 2 * margin
    uv = (pts - centre) / span * (inner - 1)  # centred at 0
    if pose is not None:
        angle, zoom, dx, dy = pose
        rot = np.array([[np.cos(angle), -np.sin(angle)], [np.sin(angle), np.cos(angle)]])
        room = (inner - 1) * (1 - zoom * np.sqrt(2)) / 2  # how far the posed shape can move
        uv = uv @ (zoom * rot).T + np.array([dx, dy]) * max(room, 0.0)
    uv = uv + (size - 1) / 2.0
    ij = np.rint(uv).astype(np.int64)
    keep = (ij >= 0).all(axis=1) & (ij < size).all(axis=1)
    ij = ij[keep]
    counts = np.bincount(ij[:, 1] * size + ij[:, 0], minlength=size * size)
    return counts.reshape(size, size)


def render(seed: int, cls: int, index: int, size: int,
           system: Optional[tuple[np.ndarray, np.ndarray, np.ndarray]] = None) -> np.ndarray:
    """Image `index` of class `cls`: (size, size, 3) uint8.

    Per-image variation: each map parameter is perturbed by N(0, 0.04), the point count varies
    by ~2x, the shape is posed at random (any rotation, 45-70% of the frame, anywhere in it) and
    foreground/background colours are random (dark background, bright fractal), so only the
    shape carries the class, as an object in a photo: raw pixels do not line up across images.
    """
    a, b, p = system if system is not None else class_system(seed, cls)
    rng = _rng(seed, 0x1A6E, cls, index)
    a = a + rng.normal(0, 0.04, a.shape)
    b = b + rng.normal(0, 0.04, b.shape)
    chains = int(size * size * rng.uniform(0.15, 0.3)) // 8 + 32
    pts = _chaos_game(a, b, p, rng, chains=chains, steps=40)
    pose = (rng.uniform(0, 2 * np.pi), rng.uniform(0.45, 0.7), *rng.uniform(-1, 1, 2))
    # render at 2x and box-filter down: antialiased edges instead of isolated dots
    big = _rasterise(pts, 2 * size, margin=size // 16, pose=pose)
    dens = big.reshape(size, 2, size, 2).sum(axis=(1, 3)).astype(np.float32)
    dens = np.log1p(dens) / max(np.log1p(dens).max(), 1e-6)  # (size, size) in [0, 1]
    fg = rng.uniform(0.5, 1.0, 3) * 255
    bg = rng.uniform(0.0, 0.25, 3) * 255
    img = bg[None, None, :] * (1 - dens[..., None]) + fg[None, None, :] * dens[..., None]
    return np.rint(img).astype(np.uint8)


def class_name(cls: int) -> str:
    return f"fractal_{cls:05d}"


# What the renderer writes under its output: fractal_00000/000000.png, and a writer's temporary
# name beside a file it had not finished (storage.write_bytes: <file>.tmp<pid>)
_OWN_FILE = re.compile(r"^fractal_\d{5}/\d{6}\.png(\.tmp\d+)?$")
_OWN_FOLDER = re.compile(r"^fractal_\d{5}$")


def foreign_files(out_dir: str) -> list[str]:
    """The files under `out_dir` (relative) that the renderer does not write: a folder holding any
    is not a corpus `vitp synth --overwrite` may delete."""
    others = [name for name in storage.listdir(out_dir) if not _OWN_FOLDER.match(name)]
    return others + [f for f in storage.file_sizes(out_dir)
                     if _OWN_FOLDER.match(f.split("/")[0]) and not _OWN_FILE.match(f)]


def corpus_fingerprint(num_classes: int, images_per_class: int, image_size: int, seed: int) -> str:
    """A short id of a corpus' parameters (recorded in its manifest)."""
    h = hashlib.sha1(f"{num_classes}/{images_per_class}/{image_size}/{seed}".encode())
    return h.hexdigest()[:12]


def _render_batch(batch: dict, seed: int, size: int, out_dir: str) -> dict:
    """Ray Data map_batches fn: render rows (cls, index) and write PNGs (temp then rename)."""
    systems: dict[int, tuple] = {}
    paths = []
    for cls, idx in zip(batch["cls"], batch["index"]):
        cls, idx = int(cls), int(idx)
        if cls not in systems:
            systems[cls] = class_system(seed, cls)
        img = render(seed, cls, idx, size, systems[cls])
        path = storage.join(out_dir, class_name(cls), f"{idx:06d}.png")
        if storage.is_uri(path):  # one PUT: the object appears whole
            buf = io.BytesIO()
            Image.fromarray(img).save(buf, format="PNG")
            storage.write_bytes(path, buf.getvalue())
        else:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = path + f".tmp{os.getpid()}"
            Image.fromarray(img).save(tmp, format="PNG")
            os.replace(tmp, path)
        paths.append(path)
    return {"path": np.array(paths, dtype=object)}


def generate_corpus(num_classes: int, images_per_class: int, image_size: int, seed: int,
                    out_dir: str, blocks: Optional[int] = None) -> dict:
    """Render the corpus as an ImageFolder tree out_dir/fractal_00000/000000.png in parallel
    with Ray Data; returns {"images", "classes", "out_dir", "fingerprint"}.

    Same arguments -> byte-identical files (PNG encoding is deterministic). out_dir is an absolute
    path every worker can write (a shared file system on a cluster) or a storage URI; the `synthetic`
    source needs no corpus at all: preprocess renders it straight into shards.
    """
    import ray  # lazy: ray (render / class_system run without it, in preprocess workers)

    rows = [{"cls": c, "index": i} for c in range(num_classes) for i in range(images_per_class)]
    storage.makedirs(out_dir)
    n_blocks = blocks or max(1, min(len(rows) // 64, 256))  # ~64 images per task
    ds = ray.data.from_items(rows, override_num_blocks=n_blocks).map_batches(
        _render_batch, batch_size=64, fn_kwargs={"seed": seed, "size": image_size,
                                                  "out_dir": out_dir})
    written = sum(len(b["path"]) for b in ds.iter_batches(batch_size=None))
    return {"images": written, "classes": num_classes, "out_dir": out_dir,
            "fingerprint": corpus_fingerprint(num_classes, images_per_class, image_size, seed)}
