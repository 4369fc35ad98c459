"""Input layouts -> items (key, label, where the bytes are) plus the class names, read through
vitp.storage. Scalable sources (ImageFolder, unlabelled, ImageNet, Parquet, WebDataset,
synthetic) are planned on the driver, which lists only directories or files, into listing units
that Ray tasks expand into items (`expand_unit`); CSV lists are read on the driver. Must not
decode images.
"""
from __future__ import annotations

import csv
import io
import os
import tarfile
from dataclasses import dataclass, field
from typing import Optional

import pyarrow.fs as pafs
import pyarrow.parquet as pq

from ..errors import InputError
from ..storage import filesystem, is_uri, join, open_input
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


# ------------------------------------------------------------------------ file systems


def read_bytes(path: str, offset: int = -1, length: int = -1) -> bytes:
    """The bytes of `path` (or of [offset, offset+length)); OSError if it cannot be read."""
    with open_input(path) as f:
        if offset >= 0:
            f.seek(offset)
            return f.read(length)
        return f.read()


def _uri_of(base: str, fs_path: str, base_fs_path: str) -> str:
    """Turn a path inside `base`'s file system back into something read_bytes accepts."""
    return join(base, os.path.relpath(fs_path, base_fs_path).replace(os.sep, "/"))


def list_files(root: str) -> list[tuple[str, str]]:
    """All non-hidden files under root, sorted: (relative path, readable path/URI)."""
    fs, base = filesystem(root)
    info = fs.get_file_info(base)
    if info.type == pafs.FileType.NotFound:
        raise FileNotFoundError(f"{root}: does not exist; set data.path to the corpus directory")
    out = []
    for fi in fs.get_file_info(pafs.FileSelector(base, recursive=True)):
        if fi.type != pafs.FileType.File:
            continue
        rel = os.path.relpath(fi.path, base).replace(os.sep, "/")
        if any(part.startswith(".") for part in rel.split("/")):
            continue
        out.append((rel, _uri_of(root, fi.path, base) if is_uri(root) else os.path.join(base, rel)))
    out.sort()
    return out


def _info_type(path: str) -> pafs.FileType:
    fs, base = filesystem(path)
    return fs.get_file_info(base).type


def _child_dirs(root: str) -> list[str]:
    fs, base = filesystem(root)
    names = [os.path.basename(fi.path) for fi in fs.get_file_info(pafs.FileSelector(base))
             if fi.type == pafs.FileType.Directory]
    return sorted(n for n in names if not n.startswith("."))


# ----------------------------------------------------------------------------- sources


def _folder_units(root: str, split: str, classes: list[str], key_prefix: str,
                  unlabelled: bool = False) -> list[dict]:
    """One listing unit per child directory of `root` (its label, or why it has none) and one
    for the files at the top level (inputs without a class). `unlabelled`: every image file,
    at any depth, is an input of class 0, and files of other extensions are not inputs."""
    index = {c: i for i, c in enumerate(classes)}
    top_error = "" if unlabelled else "bad_label: file at the top level, not inside a class directory"
    units = [{"kind": "top", "root": root, "split": split, "prefix": key_prefix,
              "label": 0 if unlabelled else -1, "error": top_error, "images_only": unlabelled}]
    for d in _child_dirs(root):
        label = 0 if unlabelled else index.get(d, -1)
        units.append({"kind": "dir", "root": root, "dir": d, "label": label, "split": split,
                      "prefix": key_prefix, "images_only": unlabelled,
                      "error": "" if label >= 0 else f"bad_label: class directory {d!r} is not in the class map"})
    return units


def is_image_name(name: str) -> bool:
    return os.path.splitext(name)[1].lower() in IMAGE_EXTS


def _expand_folder(u: dict) -> list[dict]:
    keep = is_image_name if u["images_only"] else (lambda _: True)
    if u["kind"] == "top":
        fs, base = filesystem(u["root"])
        files = sorted(os.path.basename(fi.path) for fi in fs.get_file_info(pafs.FileSelector(base))
                       if fi.type == pafs.FileType.File)
        return [item(u["prefix"] + f, u["label"], u["split"], join(u["root"], f), error=u["error"])
                for f in files if not f.startswith(".") and keep(f)]
    d = join(u["root"], u["dir"])
    return [item(f"{u['prefix']}{u['dir']}/{rel}", u["label"], u["split"], path, error=u["error"])
            for rel, path in list_files(d) if keep(rel)]


def imagefolder_plan(root: str, split: str = "", classes: Optional[list[str]] = None,
                     key_prefix: str = "") -> Plan:
    """root/<class>/<file...>: every non-hidden file is an input (non-images get quarantined).
    The driver lists the class directories; one Ray task lists each of them."""
    classes = classes if classes is not None else _child_dirs(root)
    if not classes:
        raise FileNotFoundError(f"{root}: no class directories; expected root/<class>/<image>")
    return Plan(list(classes), _folder_units(root, split, classes, key_prefix),
                official_split=bool(split))


UNLABELLED = "unlabelled"  # the one class name of an unlabelled corpus


def unlabelled_plan(root: str) -> Plan:
    """Any tree of images without classes (self-supervised pre-training): every image file
    (IMAGE_EXTS) at any depth is an input of class 0, key = its path under root. Listed like an
    ImageFolder: the driver lists the top directory, a Ray task each child directory. The
    manifest records `labelled: false` (see `require_labels`)."""
    if _info_type(root) != pafs.FileType.Directory:
        raise FileNotFoundError(f"{root}: not a directory; set data.path to the folder of images")
    return Plan([UNLABELLED], _folder_units(root, "", [], "", unlabelled=True),
                info={"labelled": False})


def imagefolder(root: str, split: str = "", classes: Optional[list[str]] = None,
                key_prefix: str = "") -> Listing:
    return expand_plan(imagefolder_plan(root, split, classes, key_prefix))


def _natural(names: set[str]) -> list[str]:
    try:
        return [str(n) for n in sorted(names, key=int)]
    except ValueError:
        return sorted(names)


def csv_list(csv_path: str) -> Listing:
    """A labels CSV with columns path,label; relative paths are relative to the CSV's folder."""
    text = read_bytes(csv_path).decode("utf-8-sig")
    rows = list(csv.DictReader(io.StringIO(text)))
    if rows and not {"path", "label"} <= set(rows[0]):
        raise InputError(f"{csv_path}: needs columns path,label; found {', '.join(rows[0])}")
    base = csv_path.rsplit("/", 1)[0] if "/" in csv_path else "."
    classes = _natural({r["label"].strip() for r in rows if (r["label"] or "").strip()})
    index = {c: i for i, c in enumerate(classes)}
    items = []
    for r in rows:
        p = (r["path"] or "").strip()
        full = p if (is_uri(p) or os.path.isabs(p)) else join(base, p)
        lab = (r["label"] or "").strip()
        err = "" if lab else f"bad_label: empty label for {p!r} in {csv_path}"
        items.append(item(p, index.get(lab, -1), "", full, error=err))
    return Listing(items, classes)


def _files_with(root: str, ext: str) -> list[tuple[str, str]]:
    if root.endswith(ext):
        return [(os.path.basename(root), root)]
    return [(rel, p) for rel, p in list_files(root) if rel.endswith(ext)]


def image_column(names: list[str]) -> Optional[str]:
    return "image" if "image" in names else ("bytes" if "bytes" in names else None)


def parquet_plan(root: str) -> Plan:
    """Existing Parquet files (columns: image bytes, label; optional key/path). The driver lists
    the files; a Ray task per file reads its key and label columns (never the images), and the
    images are read by row group where they are decoded."""
    units = [{"kind": "parquet", "path": p, "rel": rel} for rel, p in _files_with(root, ".parquet")]
    return Plan(None, units, label_order="natural", decode_early=True)


def _expand_parquet(u: dict) -> list[dict]:
    path, rel = u["path"], u["rel"]
    with open_input(path) as f:
        pf = pq.ParquetFile(f)
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
            for i, (k, lab) in enumerate(zip(keys, labels)):
                out.append(item(str(k), -1, path=path, row_group=g, row=i,
                                raw_label="" if lab is None else str(lab),
                                error="" if lab is not None else "bad_label: null label"))
            first += t.num_rows
    return out


def webdataset_plan(root: str) -> Plan:
    """WebDataset .tar shards: members key.jpg / key.png (image) + key.cls (class index text).
    A Ray task per tar reads its headers and .cls members; images are read by byte range."""
    units = [{"kind": "tar", "path": p, "rel": rel} for rel, p in _files_with(root, ".tar")]
    return Plan(None, units, label_order="range")


def _expand_tar(u: dict) -> list[dict]:
    path, rel = u["path"], u["rel"]
    samples: dict[str, dict] = {}
    fs, inner = filesystem(path)
    with fs.open_input_file(inner) as f, tarfile.open(fileobj=f, mode="r:") as tf:
        for m in tf:
            if not m.isfile():
                continue
            stem, _, ext = m.name.partition(".")
            s = samples.setdefault(f"{rel}/{stem}", {})
            if ext.lower() in ("jpg", "jpeg", "png", "webp", "bmp"):
                s["image"] = (path, m.offset_data, m.size)
            elif ext.lower() == "cls":
                s["cls"] = tf.extractfile(m).read().decode().strip()
    items = []
    for key, s in sorted(samples.items()):
        cls = s.get("cls", "")
        ok = cls.lstrip("-").isdigit() and int(cls) >= 0
        path, off, size = s.get("image", ("", -1, -1))
        err = "" if ok else f"bad_label: no usable {key}.cls"
        if not path:
            err = "not_an_image: no image member for this sample"
        items.append(item(key, -1, "", path, off, size, error=err, raw_label=str(int(cls)) if ok else ""))
    return items


def imagenet_plan(root: str) -> Plan:
    """ImageNet as ImageFolder: train/<wnid>/*.JPEG -> train, val/<wnid>/*.JPEG -> val; the
    class map comes from train's wnids (sorted)."""
    classes = _child_dirs(join(root, "train"))
    units = (_folder_units(join(root, "train"), "train", classes, "train/")
             + _folder_units(join(root, "val"), "val", classes, "val/"))
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


def classes_from_labels(raw_labels: set[str], order: str) -> list[str]:
    """The class names of a source whose labels are data (Plan.label_order)."""
    if order == "range":
        ints = [int(x) for x in raw_labels]
        return [str(i) for i in range(max(ints) + 1)] if ints else []
    return _natural(raw_labels)


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
