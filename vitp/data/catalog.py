"""`data.source` -> a Plan: which layout reads a source, and the whole listing in one process
for small corpora and tests (`list_source`). Must not decode images.
"""
from __future__ import annotations

from ..errors import InputError
from . import datasets
from .sources import (Listing, Plan, expand_plan, imagefolder_plan, imagenet_plan, parquet_plan,
                      synthetic_plan, unlabelled_plan, webdataset_plan)


def plan_source(source: str, path: str = "", *, synth_classes: int = 10,
                synth_images_per_class: int = 64, seed: int = 0, allow_outside_root: bool = False) -> Plan:
    """Dispatch on `data.source`. A `synthetic` source with a path reads that ImageFolder
    corpus (written by `vitp synth`); without one it renders in the workers.
    `allow_outside_root` (data.allow_outside_root): read files that symlinks or a list lead to
    outside `path`; otherwise they are quarantined as outside_root (data/bounds.py)."""
    if source == "synthetic":
        if path:
            return imagefolder_plan(path, allow_outside_root=allow_outside_root)
        return synthetic_plan(synth_classes, synth_images_per_class, seed)
    if source == "digits":
        return _listed(datasets.digits())
    if not path:
        raise InputError(f"data.source={source!r} reads files: set --set data.path=/path/to/{source}")
    planners = {"imagefolder": imagefolder_plan, "unlabelled": unlabelled_plan, "parquet": parquet_plan,
                "webdataset": webdataset_plan, "imagenet": imagenet_plan}
    listers = {"csv": datasets.csv_list, "cifar10": lambda p, _: datasets.cifar(p, "cifar10"),
               "cifar100": lambda p, _: datasets.cifar(p, "cifar100"), "pets": datasets.pets,
               "flowers": lambda p, _: datasets.flowers(p)}
    if source in planners:
        return planners[source](path, allow_outside_root=allow_outside_root)
    if source in listers:
        return _listed(listers[source](path, allow_outside_root))
    raise InputError(f"data.source={source!r} is not a source; use one of synthetic, imagefolder, "
                     "unlabelled, csv, parquet, webdataset, cifar10, cifar100, digits, pets, flowers, imagenet")


def _listed(listing: Listing) -> Plan:
    return Plan(listing.classes, items=listing.items, official_split=listing.official_split,
                info=listing.info)


def list_source(source: str, path: str = "", **kw) -> Listing:
    """The source's whole listing in this process (see plan_source)."""
    return expand_plan(plan_source(source, path, **kw))
