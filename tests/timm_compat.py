"""Import timm (test-only) from the folder `make install` puts it in (.venv/timm-pkgs).

The torchvision wheel that installs beside a CPU-only torch here is a CUDA build: its C++ ops do
not load, and its import then fails registering fake kernels for `torchvision::nms`/`qnms`. timm
only needs torchvision's Python layers, so those two op schemas are declared (no kernels) first.
"""
import os
import sys

import torch

PKGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".venv", "timm-pkgs")
_lib = None


def import_timm():
    global _lib
    if not os.path.isdir(PKGS):
        raise RuntimeError(f"{PKGS} is missing: run `make install` (it installs timm there for the tests)")
    if PKGS not in sys.path:
        sys.path.insert(0, PKGS)
    if _lib is None and "torchvision" not in sys.modules:
        try:
            torch.ops.load_library(os.path.join(PKGS, "torchvision", "_C.so"))
        except OSError:  # a CUDA build on a CPU torch
            _lib = torch.library.Library("torchvision", "DEF")
            for op in ("nms", "qnms"):
                _lib.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    import timm

    return timm
