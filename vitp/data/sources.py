"""Input layouts -> items (key, label, where the bytes are) plus the class names, read through
vitp.storage within the limits of bounds.py. Scalable sources (ImageFolder, unlabelled, ImageNet,
Parquet, WebDataset, synthetic) are planned on the driver, which lists only directories or files,
into listing units that Ray tasks expand into items (`expand_unit`). Must not decode images.
"""
from __future__ import annotations

import os
import tarfile
from dataclasses import dataclass, field
from typing import Optional

import pyarrow.fs as pafs

from ..errors import InputError
from ..storage import filesystem, join, open_input
from .bounds import (CLS_BYTES, MAX_CLASSES, BoundedTarInfo, label_text_problem, parquet_group_problem,
                     parse_index)
from .files import child_dirs, entries, file_type, files_with, list_files
from .parquet import open_parquet
from .synth import class_name

# An item is one input: a dict with exactly these keys (the columns of the preprocess dataset).
#   key    file identity, stable across runs (relative path, "data_batch_1/123", ...)
#   label  class index, -1 when the source gave none (quarantined as bad_label)
#   split  "train" / "val" for sources with an official split, "" = split by hash of key
#   path   URI or local path to read; "" for in-memory items
#   offset, length   byte range inside `path` (tar members); -1 = whole file
#   data   inline bytes: an encoded image, or raw uint8 pixels when `shape` is set
#   shape  "HxWxC" for raw pixels, else ""
#   synth  image index for the synthetic source (rendered by the worker), else -1
#   error  a quarantine reason found while listing ("bad_label: ..."), else ""
#   raw_label  the label as the source wrote it, when the class map comes from the labels
#          found (Parquet, WebDataset): label is -1 until the driver maps it (resolve_labels)
#   row_group, row  where a Parquet source's image is (row `row` of row group `row_group`)
ITEM_FIELDS = ("key", "label", "split", "path", "offset", "length", "data", "shape", "synth",
               "error", "raw_label", "row_group", "row")

IMAGE_EXTS = {".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm"}


def item(key: str, label: int, split: str = "", path: str = "", offset: int = -1, length: int = -1,
         data: bytes = b"", shape: str = "", synth: int = -1, error: str = "", raw_label: str = "",
         row_group: int = -1, row: int = -1) -> dict:
    return {"key": key, "label": int(label), "split": split, "path": path, "offset": int(offset),
            "length": int(length), "data": data, "shape": shape, "synth": int(synth), "error": error,
            "raw_label": raw_label, "row_group": int(row_group), "row": int(row)}


@dataclass
class Listing:
    """What a source yields: the items, the class names (index = label) and provenance."""

    items: list[dict]
    classes: list[str]
    official_split: bool = False
    info: dict = field(default_factory=dict)


@dataclass
class Plan:
    """A source as the driver sees it: listing units for Ray tasks (`expand_unit`) and/or items
    listed here, the class names, or `label_order` when they come from the labels found:
    "natural" (the distinct labels as text, numerically sorted when all are integers) or
    "range" (0 .. the largest integer label). `decode_early`: the images are read in blocks
    (Parquet row groups), so workers decode them before grouping rows into shards."""

    classes: Optional[list[str]]
    units: list[dict] = field(default_factory=list)
    items: list[dict] = field(default_factory=list)
    official_split: bool = False
    info: dict = field(default_factory=dict)
    label_order: str = ""
    decode_early: bool = False


# ----------------------------------------------------------------------------- sources


def _folder_units(root: str, split: str, classes: list[str], key_prefix: str, unlabelled: bool = False,
                  fence: str = "", allow_outside: bool = False) -> list[dict]:
    """One listing unit per child directory of `root` (its label, or why it has none) and one
    for the files at the top level (inputs without a class) and the links out of `fence` (the
    corpus root). `unlabelled`: every image file, at any depth, is an input of class 0, and
    files of other extensions are not inputs."""
    index = {c: i for i, c in enumerate(classes)}
    top_error = "" if unlabelled else "bad_label: file at the top level, not inside a class directory"
    common = {"root": root, "split": split, "prefix": key_prefix, "images_only": unlabelled,
              "fence": fence or root, "allow_outside": allow_outside}
    units = [{"kind": "top", "label": 0 if unlabelled else -1, "error": top_error, **common}]
    for d in child_dirs(root, fence or root, allow_outside):
        label = 0 if unlabelled else index.get(d, -1)
        units.append({"kind": "dir", "dir": d, "label": label, **common,
                      "error": "" if label >= 0 else f"bad_label: class directory {d!r} is not in the class map"})
    return units


def is_image_name(name: str) -> bool:
    return os.path.splitext(name)[1].lower() in IMAGE_EXTS


def _expand_folder(u: dict) -> list[dict]:
    keep = is_image_name if u["images_only"] else (lambda _: True)
    fence, allow = u.get("fence", u["root"]), u.get("allow_outside", False)
    if u["kind"] == "top":  # the files here, and every link out of the root (directories too)
        return [item(u["prefix"] + f, u["label"], u["split"], join(u["root"], f), error=err or u["error"])
                for f, is_dir, err in entries(u["root"], fence, allow)
                if err or (not is_dir and keep(f))]
    d = join(u["root"], u["dir"])
    return [item(f"{u['prefix']}{u['dir']}/{rel}", u["label"], u["split"], path, error=err or u["error"])
            for rel, path, err in list_files(d, fence, allow) if keep(rel) or err]


def imagefolder_plan(root: str, split: str = "", classes: Optional[list[str]] = None,
                     key_prefix: str = "", allow_outside_root: bool = False) -> Plan:
    """root/<class>/<file...>: every non-hidden file is an input (non-images get quarantined).
    The driver lists the class directories; one Ray task lists each of them. Symlinks that
    lead out of root are quarantined (outside_root) unless `allow_outside_root`."""
    classes = classes if classes is not None else child_dirs(root, root, allow_outside_root)
    if not classes:
        raise FileNotFoundError(f"{root}: no class directories; expected root/<class>/<image>")
    return Plan(list(classes), _folder_units(root, split, classes, key_prefix,
                                             allow_outside=allow_outside_root), official_split=bool(split))


UNLABELLED = "unlabelled"  # the one class name of an unlabelled corpus


def unlabelled_plan(root: str, allow_outside_root: bool = False) -> Plan:
    """Any tree of images without classes (self-supervised pre-training): every image file
    (IMAGE_EXTS) at any depth is an input of class 0, key = its path under root. Listed like an
    ImageFolder: the driver lists the top directory, a Ray task each child directory. The
    manifest records `labelled: false` (see `require_labels`)."""
    if file_type(root) != pafs.FileType.Directory:
        raise FileNotFoundError(f"{root}: not a directory; set data.path to the folder of images")
    return Plan([UNLABELLED], _folder_units(root, "", [], "", unlabelled=True,
                                            allow_outside=allow_outside_root), info={"labelled": False})


def imagefolder(root: str, split: str = "", classes: Optional[list[str]] = None,
                key_prefix: str = "", allow_outside_root: bool = False) -> Listing:
    return expand_plan(imagefolder_plan(root, split, classes, key_prefix, allow_outside_root))


def natural_order(names: set[str]) -> list[str]:
    """Labels as class names: numerically sorted when all are integers, else as text."""
    try:
        return [str(n) for n in sorted(names, key=int)]
    except ValueError:
        return sorted(names)


# The columns a Parquet corpus may have that vitp reads, and what each must hold (parquet.KINDS)
SOURCE_COLUMNS = {"image": "image", "bytes": "image", "label": "label", "key": "label", "path": "label"}


def image_column(names: list[str]) -> Optional[str]:
    return "image" if "image" in names else ("bytes" if "bytes" in names else None)


def parquet_plan(root: str, allow_outside_root: bool = False) -> Plan:
    """Existing Parquet files (columns: image bytes, label; optional key/path). The driver lists
    the files; a Ray task per file reads its key and label columns (never the images), and the
    images are read by row group where they are decoded."""
    units = [{"kind": "parquet", "path": p, "rel": rel, "error": err}
             for rel, p, err in files_with(root, ".parquet", allow_outside_root)]
    return Plan(None, units, label_order="natural", decode_early=True)


def _expand_parquet(u: dict) -> list[dict]:
    path, rel = u["path"], u["rel"]
    with open_input(path) as f:
        try:
            pf = open_parquet(f, path, SOURCE_COLUMNS)
        except InputError as e:  # a column that could run code, or of a type vitp does not read:
            return [item(rel, -1, path=path, error=f"unreadable: {e}")]  # no row is read
        names = pf.schema_arrow.names
        img_col = image_column(names)
        if img_col is None or "label" not in names:
            raise InputError(f"{path}: Parquet source needs columns image (bytes) and label; "
                             f"found {', '.join(names)}")
        key_col = "key" if "key" in names else ("path" if "path" in names else None)
        out, first = [], 0
        for g in range(pf.metadata.num_row_groups):
            t = pf.read_row_group(g, columns=[c for c in ("label", key_col) if c])
            labels = t.column("label").to_pylist()
            keys = t.column(key_col).to_pylist() if key_col else \
                [f"{rel}/{first + i}" for i in range(t.num_rows)]
            too_large = parquet_group_problem(pf.metadata.row_group(g), img_col, f"row group {g} of {path}")
            for i, (k, lab) in enumerate(zip(keys, labels)):
                raw = "" if lab is None else str(lab)
                err = too_large or (label_text_problem(raw, f"row {first + i} of {path}") if lab is not None
                                    else "bad_label: null label")
                out.append(item(str(k), -1, path=path, row_group=g, row=i, raw_label="" if err else raw, error=err))
            first += t.num_rows
    return out


def webdataset_plan(root: str, allow_outside_root: bool = False) -> Plan:
    """WebDataset .tar shards: members key.jpg / key.png (image) + key.cls (class index text).
    A Ray task per tar reads its headers and .cls members; images are read by byte range."""
    units = [{"kind": "tar", "path": p, "rel": rel, "error": err}
             for rel, p, err in files_with(root, ".tar", allow_outside_root)]
    return Plan(None, units, label_order="range")


def _expand_tar(u: dict) -> list[dict]:
    """A tar's samples: each .cls read only when its header says it fits CLS_BYTES, and parsed
    by bounds.parse_index; images located by byte range (their size is checked when read). A
    tar that cannot be read to its end keeps the samples before the damage, plus one entry."""
    path, rel = u["path"], u["rel"]
    samples: dict[str, dict] = {}
    broken = ""
    fs, inner = filesystem(path)
    with fs.open_input_file(inner) as f:
        try:
            with tarfile.open(fileobj=f, mode="r:", tarinfo=BoundedTarInfo) as tf:
                for m in tf:
                    if not m.isfile():
                        continue
                    stem, _, ext = m.name.partition(".")
                    s = samples.setdefault(f"{rel}/{stem}", {})
                    if ext.lower() in ("jpg", "jpeg", "png", "webp", "bmp"):
                        s["image"] = (path, m.offset_data, m.size)
                    elif ext.lower() == "cls":
                        raw = tf.extractfile(m).read(CLS_BYTES) if m.size <= CLS_BYTES else b""
                        s["cls"] = parse_index(raw, f"{m.name} in {path}", m.size)
        except tarfile.TarError as e:
            broken = f"corrupt: {path} cannot be read past its first {len(samples)} samples ({e}); re-write the tar"
    items = [item(rel, -1, "", path, error=broken)] if broken else []
    for key, s in sorted(samples.items()):
        label, err = s.get("cls", (-1, f"bad_label: no {key}.cls in {path}"))
        ipath, off, size = s.get("image", ("", -1, -1))
        if not ipath:
            err = "not_an_image: no image member for this sample"
        items.append(item(key, -1, "", ipath, off, size, error=err, raw_label=str(label) if label >= 0 else ""))
    return items


def imagenet_plan(root: str, allow_outside_root: bool = False) -> Plan:
    """ImageNet as ImageFolder: train/<wnid>/*.JPEG -> train, val/<wnid>/*.JPEG -> val; the
    class map comes from train's wnids (sorted). A split directory that leads out of root is
    refused (InputError), links below it quarantined (as imagefolder_plan)."""
    for name, _, err in entries(root, root, allow_outside_root):
        if name in ("train", "val") and err:
            raise InputError(err.partition(": ")[2])
    classes = child_dirs(join(root, "train"), root, allow_outside_root)
    units = [u for split in ("train", "val") for u in _folder_units(
        join(root, split), split, classes, f"{split}/", fence=root, allow_outside=allow_outside_root)]
    return Plan(classes, units, official_split=True)


def synthetic_plan(num_classes: int, images_per_class: int, seed: int) -> Plan:
    """The fractal corpus, rendered by the preprocess workers (no files in between): a
    listing unit per class."""
    units = [{"kind": "synth", "label": c, "n": images_per_class} for c in range(num_classes)]
    return Plan([class_name(c) for c in range(num_classes)], units,
                info={"synth_seed": seed, "synth_classes": num_classes,
                      "synth_images_per_class": images_per_class})


def expand_unit(unit: dict) -> list[dict]:
    """One listing unit -> its items (runs in a Ray task; also locally for `list_source`)."""
    kind = unit["kind"]
    if unit.get("error") and kind in ("parquet", "tar"):  # a link out of the root: not opened
        return [item(unit["rel"], -1, path=unit["path"], error=unit["error"])]
    if kind in ("top", "dir"):
        return _expand_folder(unit)
    if kind == "parquet":
        return _expand_parquet(unit)
    if kind == "tar":
        return _expand_tar(unit)
    if kind == "synth":
        c = unit["label"]
        return [item(f"{class_name(c)}/{i:06d}", c, synth=i) for i in range(unit["n"])]
    raise ValueError(f"unknown listing unit kind {kind!r}")


def classes_from_labels(raw_labels: set[str], order: str, limit: Optional[int] = None) -> list[str]:
    """The class names of a source whose labels are data (Plan.label_order). "range" stops at
    `limit` (data.num_classes) when given, and at MAX_CLASSES: a label beyond is quarantined by
    preprocess (or the listing), never made a class."""
    if order == "range":
        ints = [v for v in (int(x) for x in raw_labels if x.isascii() and x.isdigit() and len(x) <= CLS_BYTES)
                if v < MAX_CLASSES]
        n = max(ints) + 1 if ints else 0
        return [str(i) for i in range(min(n, limit) if limit else n)]
    return natural_order(raw_labels)


def expand_plan(plan: Plan) -> Listing:
    """The whole listing in this process (small corpora, tests); `preprocess` expands the
    units in Ray tasks instead."""
    items = list(plan.items)
    for u in plan.units:
        items.extend(expand_unit(u))
    classes = plan.classes
    if classes is None:
        classes = classes_from_labels({it["raw_label"] for it in items if it["raw_label"]},
                                      plan.label_order)
        index = {c: i for i, c in enumerate(classes)}
        for it in items:
            if it["raw_label"]:
                it["label"] = index.get(it["raw_label"], -1)
    return Listing(items, classes, plan.official_split, dict(plan.info))
