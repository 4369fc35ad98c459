"""`vitp` commands that evaluate or bring in weights: fewshot, import, attention, analyze, predict, compare.

Each parser sits beside its handler; a handler parses, calls the module that owns the work, prints.
Must not contain logic; torch, ray and mlflow are imported inside the handler that needs them.
"""
from __future__ import annotations

import argparse
import os
import sys

from vitp import storage
from vitp.cli.args import Handler, add_address, add_recipe, add_set, add_tracking, run_from, key_value, on_ray
from vitp.config import Run, absolute_paths
from vitp.errors import InputError
from vitp.model.weights import IMPORT_FORMATS  # torch-free: the importer's own --format names


# ----------------------------------------------------------------------------- fewshot


def cmd_fewshot(args: argparse.Namespace) -> int:
    from vitp.model.weights import check_source
    run = run_from(args)
    check_source(args.source)  # before Ray starts: a wrong --from fails once, here
    from vitp.eval.fewshot import run_fewshot  # lazy: keeps vitp --help fast (torch, ray)

    on_ray(args, run)
    result = run_fewshot(run, args.source, tracking=not args.no_tracking)
    for key, value in result.items():
        if key.startswith("fewshot/"):
            print(f"{key}: {value:.4f}")
    if result.get("run_id"):
        print(f"MLflow run: {result['run_id']}")
    return 0


def _add_fewshot(sub) -> Handler:
    p = sub.add_parser("fewshot", help="few-shot linear evaluation (1/5/10/25 shots, 3 seeds) of weights")
    add_recipe(p)
    p.add_argument("--from", dest="source", required=True, type=storage.abspath,
                   help="export dir, checkpoint dir or weights file")
    add_tracking(p)
    add_address(p)
    return cmd_fewshot


# ------------------------------------------------------------------------------ import


def cmd_import(args: argparse.Namespace) -> int:
    from vitp.model.convert import import_weights  # lazy: keeps vitp --help fast (torch)

    out = import_weights(args.source, args.out, fmt=args.format, image_size=args.image_size,
                         num_classes=args.num_classes)
    print(f"wrote {out} (fine-tune with: vitp finetune RECIPE --from {out})")
    return 0


def _add_import(sub) -> Handler:
    p = sub.add_parser("import", help="convert official .npz / timm / Hugging Face ViT weights to ours")
    p.add_argument("source", type=storage.abspath, help="a .npz, .safetensors, .pt or .bin file")
    p.add_argument("--out", required=True, help="export directory to write (model.safetensors + config.json)")
    p.add_argument("--format", default="auto", choices=IMPORT_FORMATS, metavar="FORMAT",
                   help="one of %(choices)s: npz = the paper's official JAX checkpoints, ours = an "
                        "export of this pipeline (default auto: detected from the keys)")
    p.add_argument("--image-size", type=int, help="resolution the weights were trained at (default: from the pos-embed grid)")
    p.add_argument("--num-classes", type=int, help="override the inferred head size")
    return cmd_import


# --------------------------------------------------------------------------- attention


def _check_image(path: str) -> None:
    """InputError naming `path` unless it is an image file within the byte limit whose header is of a
    format read here and within the pixel limit (checked before a model loads: its size, then only
    its header is read)."""
    from vitp.data.decode import (DEFAULT_MAX_PIXELS, IMAGE_FORMATS, DecodeError, max_file_bytes,  # lazy (pillow)
                                  open_header)

    if not storage.isfile(path):
        raise InputError(f"{path}: no such image file; give a JPEG or PNG (a path or URI)")
    size, limit = storage.size(path), max_file_bytes(DEFAULT_MAX_PIXELS)
    if size is not None and size > limit:
        raise InputError(f"{path}: {size} bytes, more than an image within the {DEFAULT_MAX_PIXELS}-pixel limit "
                         f"takes ({limit}); give a JPEG or PNG of at most that size")
    try:
        with storage.open_input(path) as f:
            open_header(f, DEFAULT_MAX_PIXELS, IMAGE_FORMATS)
    except DecodeError as e:
        raise InputError(f"{path}: not a usable image ({e.reason}: {e}): give a JPEG or PNG") from None
    except OSError as e:
        raise InputError(f"{path}: cannot be read ({e}); give a readable JPEG or PNG") from None


def _read_image(path: str, size: int):
    """An image file (path or URI) -> (the decoded original (H, W, 3) uint8, the model's (S, S, 3)
    uint8 view as evaluation crops it); InputError naming the file if it is missing or unusable.
    Read as the data pipeline reads a corpus's: no more bytes than an image within the pixel limit
    takes (data/decode.py max_file_bytes, from the file's size before any read), and decoded only
    by Pillow's decoders of IMAGE_FORMATS."""
    from vitp.data.bounds import read_bounded  # lazy: keeps vitp --help fast (numpy, pillow)
    from vitp.data.decode import (DEFAULT_MAX_PIXELS, IMAGE_FORMATS, DecodeError, decode_image, max_file_bytes,
                                  resize_center_crop)

    try:
        original = decode_image(read_bounded(path, -1, 0, max_file_bytes(DEFAULT_MAX_PIXELS)), DEFAULT_MAX_PIXELS,
                                formats=IMAGE_FORMATS)
        return original, resize_center_crop(original, size)
    except DecodeError as e:
        raise InputError(f"{path}: not a usable image ({e.reason}: {e}): give a JPEG or PNG") from None
    except OSError as e:
        raise InputError(f"{path}: cannot be read ({e}); give a readable JPEG or PNG") from None


def cmd_attention(args: argparse.Namespace) -> int:
    import torch  # lazy: keeps vitp --help fast (torch)

    from vitp.data.ingest import normalize  # lazy: keeps vitp --help fast (torch)
    from vitp.model.attention import (attention_rollout, mean_attention_distance,  # lazy: keeps vitp --help fast (torch)
                                          plot_attention_distance, save_rollout_png)
    from vitp.train.export import load_model  # lazy: keeps vitp --help fast (torch)

    _check_image(args.image)  # a missing image fails before the model loads
    model = load_model(args.checkpoint)
    original, arr = _read_image(args.image, model.image_size)  # arr: (S, S, 3) uint8, as evaluation
    x = normalize(torch.tensor(arr)[None]).contiguous()  # (1, 3, S, S); a copy: arr is read-only
    roll = attention_rollout(model, x)[0]  # the writers make --out (a directory or URI prefix)
    # drawn over the original pixels at a readable size, not the model's few-pixel input
    p1 = save_rollout_png(original, roll, storage.join(args.out, "rollout.png"))
    p2 = plot_attention_distance(mean_attention_distance(model, x), storage.join(args.out, "attention_distance.png"))
    print(f"wrote {p1} and {p2}")
    return 0


def cmd_predict(args: argparse.Namespace) -> int:
    import json

    import numpy as np
    import torch  # lazy: keeps vitp --help fast (torch)

    from vitp.data.ingest import normalize  # lazy: keeps vitp --help fast (torch)
    from vitp.model.weights import read_config, source_info
    from vitp.train.export import class_names, load_model  # lazy: keeps vitp --help fast (torch)

    for image in args.images:  # every missing image fails before the model loads
        _check_image(image)
    cfg, model = read_config(args.checkpoint), load_model(args.checkpoint)
    info = source_info(args.checkpoint)  # an export's recorded names, else a checkpoint's shards'
    names = info.classes if info.classes and len(info.classes) == cfg.model.num_classes else class_names(info.config)
    rows = []
    for i in range(0, len(args.images), 64):
        paths = args.images[i:i + 64]
        pixels = np.stack([_read_image(p, model.image_size)[1] for p in paths])  # as evaluation crops them
        with torch.no_grad():
            probs = model(normalize(torch.from_numpy(pixels), cfg.data.mean, cfg.data.std).contiguous()).softmax(-1)
        top = probs.topk(min(args.top, probs.shape[1]))
        rows += [{"image": path, "top": [{"class": int(c), **({"name": names[int(c)]} if names else {}),
                                          "prob": round(float(v), 6)} for v, c in zip(vs, cs)]}
                 for path, vs, cs in zip(paths, top.values, top.indices)]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for row in rows:
        print(f"{row['image']}: " + ", ".join(f"{t['name']} (class {t['class']}) {t['prob']:.3f}" if "name" in t
                                              else f"class {t['class']} {t['prob']:.3f}" for t in row["top"]))
    return 0


def _add_predict(sub) -> Handler:
    p = sub.add_parser("predict", help="the top classes a model gives images",
                       description="Each image is decoded and centre-cropped as evaluation does, then "
                                   "classified by the model of an export or checkpoint; one line per "
                                   "image with its top classes (name where the export or the training "
                                   "shards say it, class index, probability), or --json.")
    p.add_argument("checkpoint", help="export dir (vitp export / import) or checkpoint dir")
    p.add_argument("images", nargs="+", help="image files (paths or URIs)")
    p.add_argument("--top", type=int, default=5, help="classes shown per image")
    p.add_argument("--json", action="store_true", help="print JSON")
    return cmd_predict


def _add_attention(sub) -> Handler:
    p = sub.add_parser("attention", help="attention rollout PNG and mean attention distance plot")
    p.add_argument("checkpoint", help="export dir (vitp export / import) or checkpoint dir")
    p.add_argument("image", help="an image file (path or URI)")
    p.add_argument("--out", default="attention", help="output directory or URI (default ./attention)")
    return cmd_attention


# ----------------------------------------------------------------------------- analyze


def cmd_analyze(args: argparse.Namespace) -> int:
    import numpy as np  # lazy: keeps vitp --help fast
    import torch  # lazy: keeps vitp --help fast (torch)

    from vitp.data.ingest import normalize  # lazy: keeps vitp --help fast (torch)
    from vitp.model.analysis import summary_lines, write_report  # lazy: keeps vitp --help fast (torch)
    from vitp.model.weights import read_config  # lazy: keeps vitp --help fast
    from vitp.train.export import load_model  # lazy: keeps vitp --help fast (torch)

    for path in args.image:  # a missing image fails before the model loads
        _check_image(path)
    images = None
    if args.images > 0 and not args.image:  # the first held-out rows of the run's own shards
        images = _shard_images(Run.of(absolute_paths(read_config(args.checkpoint))), args.images)
    model = load_model(args.checkpoint)
    if args.image:
        images = np.stack([_read_image(p, model.image_size)[1] for p in args.image])  # (n, S, S, 3)
    x = None if images is None else normalize(torch.from_numpy(np.ascontiguousarray(images))).contiguous()
    report = write_report(model, args.out, x)  # (n, 3, S, S) as the model sees them, or None
    for line in summary_lines(report):
        print(line)
    print(f"wrote {', '.join(storage.join(args.out, f) for f in report['files'])} and "
          f"{storage.join(args.out, 'analysis.json')}")
    return 0


def _shard_images(run: Run, count: int):
    """The first `count` rows of the val split (else train) of the shards the model was trained
    on; None, with a note, where there are none (an imported model, or shards since removed)."""
    from vitp.data.ingest import peek_rows  # lazy: keeps vitp --help fast (pyarrow)

    root = run.shards
    if storage.exists(storage.join(root, "manifest.json")):
        try:
            return peek_rows(run, ("val", "train"), count)["image"]
        except InputError:
            pass
    print(f"no images for the attention distances: no shards at {root} (give --image FILE ...)")
    return None


def _add_analyze(sub) -> Handler:
    p = sub.add_parser("analyze", help="paper Figure 7 report: patch-embedding filters, position-embedding "
                                       "similarity, mean attention distance")
    p.add_argument("checkpoint", help="export dir (vitp export / import) or checkpoint dir")
    p.add_argument("--out", default="analysis", help="output directory or URI (default ./analysis)")
    p.add_argument("--images", type=int, default=8, metavar="N",
                   help="images for the attention distances, the first N held-out rows of the shards "
                        "the model was trained on (default 8; 0: skip that figure)")
    p.add_argument("--image", action="append", default=[], metavar="FILE",
                   help="use this image (path or URI) instead of the shards' (repeatable)")
    return cmd_analyze


# ----------------------------------------------------------------------------- compare


def _require_store(uri: str) -> None:
    """InputError for a SQLite store that does not exist: compare only reads, so it makes none."""
    if uri.startswith("sqlite:///") and not os.path.exists(uri[len("sqlite:///"):]):
        raise InputError(f"no MLflow store at {uri}: nothing was logged there yet; pass --tracking-uri "
                         "(or MLFLOW_TRACKING_URI) or the recipe / --set work_dir=... the runs used")


def cmd_compare(args: argparse.Namespace) -> int:
    from vitp.tracking.compare import compare_rows, format_table, sweep_parents  # lazy: keeps vitp --help fast (mlflow)
    from vitp.tracking.seeds import aggregate_rows, format_aggregate  # lazy: keeps vitp --help fast (mlflow)
    from vitp.tracking.plots import log_plot_to_parent, plot_compare  # lazy: keeps vitp --help fast (mlflow)
    from vitp.tracking.search_curve import (compare_url, plot_search, search_plot_path, summary_lines,  # lazy (mlflow)
                                            swept_keys)

    # --tracking-uri, else the recipe's default store (sqlite in its work_dir): read, never made
    uri = args.tracking_uri or run_from(args, check_paths=False).tracking_uri
    _require_store(uri)
    _mark_stale(uri, args.experiment, args.stale_after)
    rows = compare_rows(uri, args.experiment, sweep=args.sweep, tags=dict(args.tag), filter_string=args.filter)
    print(format_aggregate(aggregate_rows(rows), args.format) if args.seeds else format_table(rows, args.format))
    if args.sweep and args.format == "text" and not args.seeds:  # the search: best so far, best configuration
        for line in summary_lines(rows, swept_keys(uri, sweep_parents(rows))):
            print(line)
        url = compare_url(uri, rows)
        if url:
            print(f"the trials side by side in MLflow (parallel coordinates of the params they differ in): {url}")
    if args.plot:
        plots = [plot_compare(uri, rows, args.plot)]
        if args.sweep:
            plots.append(plot_search(rows, search_plot_path(args.plot)))
        for out in plots:
            for parent in sweep_parents(rows):
                log_plot_to_parent(uri, parent, out)
            print(f"wrote {out}", file=sys.stderr)
    return 0


def _mark_stale(uri: str, experiments, stale_after: float) -> None:
    """Runs left RUNNING by a process that died (SIGKILL, a lost node) are shown KILLED."""
    from vitp.tracking.stale import mark_stale_runs  # lazy: keeps vitp --help fast (mlflow)
    from vitp.tracking.store import get_client  # lazy: keeps vitp --help fast (mlflow)

    if stale_after <= 0:
        return
    names = experiments or [e.name for e in get_client(uri).search_experiments()]
    for name in names:
        for run in mark_stale_runs(uri, name, stale_after):
            print(f"marked run {run.run_id} ({run.run_name}) KILLED: no heartbeat for "
                  f"{run.idle_s:.0f} s", file=sys.stderr)


def _add_compare(sub) -> Handler:
    p = sub.add_parser("compare", help="table (text/CSV/JSON) and plot of runs from MLflow")
    p.add_argument("--recipe", default="debug", help="recipe whose MLflow store to read (default debug)")
    add_set(p, help="override the recipe (e.g. --set work_dir=...)")
    add_tracking(p, can_disable=False, help="MLflow tracking URI (overrides the recipe's store)")
    p.add_argument("--experiment", action="append", help="experiment name(s); default all")
    p.add_argument("--sweep", help="only the runs of this sweep")
    p.add_argument("--tag", action="append", default=[], type=key_value, metavar="KEY=VALUE", help="filter by tag")
    p.add_argument("--filter", default="", help="an MLflow filter string, ANDed with the rest")
    p.add_argument("--format", choices=["text", "csv", "json"], default="text", help="output: a table, CSV or JSON")
    p.add_argument("--json", dest="format", action="store_const", const="json",
                   help="print JSON (--format json; the spelling model, plan and predict take)")
    p.add_argument("--seeds", action="store_true",
                   help="one row per configuration (runs that differ only in train.seed): the best "
                        "top-1 of each seed and their mean +- std")
    p.add_argument("--plot", metavar="PNG", help="also write learning curves + best top-1 per dataset (with "
                                                 "--sweep, also PNG-search.png: best so far vs trials and time)")
    p.add_argument("--stale-after", type=float, default=600.0, metavar="SECONDS",
                   help="mark RUNNING runs without a heartbeat for this long KILLED first (0: don't)")
    return cmd_compare


def add_parsers(sub) -> dict[str, Handler]:
    """Add this group's subcommands to `sub`; returns {command name: handler}."""
    return {"fewshot": _add_fewshot(sub), "import": _add_import(sub), "attention": _add_attention(sub),
            "analyze": _add_analyze(sub), "predict": _add_predict(sub), "compare": _add_compare(sub)}
