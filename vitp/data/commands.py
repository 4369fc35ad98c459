"""What `vitp synth` / `vitp preprocess` call, and `ensure_shards` before training: a Run in (its
config and where its corpus and shards go), files out, a summary dict back.

Owns mapping the config onto the source listing, the synthetic renderer and the shard writer,
and the progress/summary lines. Must not parse CLI arguments or touch models.
"""
from __future__ import annotations

import time
from typing import Callable, Optional

from .. import storage
from ..storage import through_outages
from ..console import get_logger
from ..errors import InputError
from ..config import Run
from . import shards as sh
from .decode import DEFAULT_MAX_PIXELS
from .preprocess import ShardSpec, preprocess
from .catalog import plan_source
from .synth import foreign_files, generate_corpus

_log = get_logger(__name__)


def check_synth_output(run: Run, out_dir: Optional[str] = None, overwrite: bool = False) -> str:
    """The corpus folder `vitp synth` writes (default <work_dir>/synth), once it is known to be
    empty or, with `overwrite`, to hold only an earlier corpus: FileExistsError otherwise."""
    out = out_dir or run.paths.synth
    if storage.listdir(out):
        foreign = foreign_files(out)
        if foreign:  # `--out ~ --overwrite` must not delete a home directory
            listed = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
            raise FileExistsError(f"{out}: holds files vitp synth did not write ({listed}); "
                                  "choose an empty or new --out directory")
        if not overwrite:
            raise FileExistsError(f"{out}: not empty; pass --overwrite to re-render the corpus "
                                  "or choose another output directory")
    return out


def run_synth(run: Run, out_dir: Optional[str] = None, overwrite: bool = False,
              log: Callable[[str], None] = _log.info) -> dict:
    """Render data.synth_classes x synth_images_per_class fractals at data.storage_size into an
    ImageFolder tree (default <work_dir>/synth), seeded by data.synth_seed."""
    d = run.cfg.data
    out = check_synth_output(run, out_dir, overwrite)
    for name in storage.listdir(out):  # an earlier corpus's class folders, each only rendered images
        storage.rmtree(storage.join(out, name), out)
    t0 = time.time()
    res = generate_corpus(d.synth_classes, d.synth_images_per_class, d.storage_size,
                          d.synth_seed, out)
    dt = time.time() - t0
    res["seconds"] = dt
    res["images_per_sec"] = res["images"] / max(dt, 1e-9)
    log(f"rendered {res['images']} fractal images ({d.synth_classes} classes, "
        f"{d.storage_size}px, seed {d.synth_seed}) to {out} in {dt:.1f}s; "
        f"{res['images_per_sec']:.0f} images/s")
    return res


def run_preprocess(run: Run, overwrite: bool = False, out_dir: Optional[str] = None,
                   max_pixels: int = DEFAULT_MAX_PIXELS, resume: bool = False,
                   rows_per_task: int = 128, log: Callable[[str], None] = _log.info) -> dict:
    """Source (data.source, data.path) -> shards at run.shards (or `out_dir`); returns the summary
    dict (input, written, quarantined, reasons, shards, bytes, images_per_sec) and prints it.
    resume=True finishes an unfinished run there, writing only the shards it lacks."""
    cfg = run.cfg
    d = cfg.data
    out = out_dir or run.shards
    t0 = time.time()
    plan = plan_source(d.source, d.path, synth_classes=d.synth_classes,
                       synth_images_per_class=d.synth_images_per_class, seed=d.synth_seed,
                       allow_outside_root=d.allow_outside_root)
    plan.info["source"] = d.source
    labelled = plan.info.get("labelled", True)  # False: one class, recorded in the manifest
    what = f"{len(plan.units)} listing units" if plan.units else f"{len(plan.items)} inputs"
    log(f"preprocess: {what} from {d.source}{' ' + d.path if d.path else ''} "
        f"(planned in {time.time() - t0:.1f}s) -> {out}")
    if labelled and d.num_classes and plan.classes is not None and len(plan.classes) > d.num_classes:
        log(f"preprocess: warning: the source has {len(plan.classes)} classes but "
            f"data.num_classes={d.num_classes}; labels >= {d.num_classes} will be quarantined "
            f"(set --set data.num_classes={len(plan.classes)})")
    spec = ShardSpec(size=d.storage_size, storage_format=d.storage_format, jpeg_quality=d.jpeg_quality,
                     max_pixels=max_pixels, num_classes=(d.num_classes or None) if labelled else len(plan.classes),
                     seed=d.synth_seed, val_fraction=d.val_fraction, train_fraction=d.train_fraction,
                     shard_mb=d.shard_mb)
    return preprocess(plan, out, spec, overwrite=overwrite, resume=resume, rows_per_task=rows_per_task,
                      manifest_extra={"path": d.path, "config": {"data": cfg.to_dict()["data"]}}, log=log)


def ensure_shards(run: Run, log: Callable[[str], None] = _log.info) -> str:
    """Shards for `run` exist (manifest present) or, for the corpora that need no files
    (synthetic fractals, scikit-learn's digits), are made now; unlabelled shards only for a
    self-supervised objective (`require_labels`); every listed shard present (`check_shard_files`)."""
    cfg, root = run.cfg, run.shards

    def check() -> None:
        manifest = sh.read_manifest(root)
        require_labels(cfg, root, manifest)
        sh.check_shard_files(root, manifest)  # a missing or foreign shard fails here, not in each worker

    try:  # an unreachable store is waited out; a missing manifest is the answer
        through_outages(check, f"[{cfg.run_name}] the shards at {root}", _log.warning)
        return root
    except FileNotFoundError:
        if cfg.data.source not in ("synthetic", "digits"):
            raise FileNotFoundError(
                f"no shards at {root} for data.source={cfg.data.source!r}: run "
                f"`vitp preprocess {cfg.recipe}` first (or set data.shards to existing shards)"
            ) from None
    log(f"[{cfg.run_name}] no shards at {root}: preprocessing the bundled {cfg.data.source} corpus")
    run_preprocess(run, overwrite=False, log=log)
    return root


SELF_SUPERVISED = ("mpp",)  # train.objective values that read no labels


def require_labels(cfg, root: str, manifest: dict) -> None:
    """InputError when `cfg` would train a classifier on shards written without labels
    (manifest `labelled: false`: data.source=unlabelled, every image class 0)."""
    objective = cfg.train.objective
    if manifest.get("labelled", True) or objective in SELF_SUPERVISED:
        return
    raise InputError(f"{root}: unlabelled shards (one class) cannot train a classifier "
                     f"(train.objective={objective!r}): set --set train.objective=mpp")
