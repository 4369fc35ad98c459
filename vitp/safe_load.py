"""Reading files a user hands us (checkpoints, CIFAR batches) without running code from them:
unpicklers that build data only, and refuse, naming the file, one that asks for more. Owns
`torch_load`, `weights_only` (every torch.load in a block, DeepSpeed's too) and `load_data_pickle`.
Trust model: docs/security.md. Must not import anything from `vitp` but errors.
"""
from __future__ import annotations

import contextlib
import io
import os
import pickle
import re
import threading
from typing import Any, Iterator

from .errors import InputError

# (module, name) pairs a data pickle may name: numpy's array reconstruction (numpy 2 pickles
# arrays as numpy._core.multiarray, numpy 1 as numpy.core.multiarray) and the text-to-bytes
# function Python 3 writes bytes with at pickle protocols below 3. Pure functions, nothing else.
_DATA_GLOBALS = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
                 ("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode")}

# torch.load reads these at each call: the first forces weights_only=True whatever the caller
# passed; torch refuses to load at all while the second is set too
_ENV = ("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD")
_lock = threading.Lock()  # the environment is process-wide: nested or concurrent blocks share it
_depth = 0
_saved: dict[str, str | None] = {}


def checkpoint_globals() -> list[Any]:
    """What DeepSpeed 0.19's checkpoint files hold besides tensors and containers (its loss
    scaler, ZeRO-stage enum and parameter-fragment addresses in the optimizer states, torch.Size
    shapes), and numpy's arrays (the numpy RNG state in our rng/ files). Plain data classes:
    loading one sets attributes, it calls nothing a file could choose."""
    import numpy as np
    import torch

    out: list[Any] = [np.ndarray, np.dtype, torch.Size]
    out += [type(np.dtype(t)) for t in (np.uint8, np.uint32, np.int64, np.float32, np.float64)]
    core = getattr(np, "_core", None) or np.core  # numpy 2 / numpy 1
    out.append(core.multiarray._reconstruct)
    try:  # lazy: deepspeed (the CLI's non-training commands run without importing it)
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
        from deepspeed.runtime.zero.config import ZeroStageEnum
        from deepspeed.utils.tensor_fragment import fragment_address

        out += [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]
    except ImportError:
        pass
    return out


def _refusal(what: str, err: BaseException, fix: str) -> InputError:
    m = re.search(r"GLOBAL ([\w.]+)", str(err))  # torch's message and ours name it so
    asked = f" (it asks for {m.group(1)})" if m else ""
    return InputError(f"{what}: refusing to load it: the file holds more than data{asked}, and loading "
                      f"it would run code from it; {fix}")


@contextlib.contextmanager
def weights_only(what: str = "checkpoint") -> Iterator[None]:
    """Every torch.load inside loads data only (see the module doc); a refused file raises
    InputError naming `what` (the checkpoint directory the block reads)."""
    import torch

    global _depth
    with _lock:
        _depth += 1
        if _depth == 1:
            _saved.update({k: os.environ.pop(k, None) for k in _ENV})
            os.environ[_ENV[0]] = "1"
    try:
        with torch.serialization.safe_globals(checkpoint_globals()):
            yield
    except pickle.UnpicklingError as e:
        raise _refusal(what, e, "load only checkpoints written by vitp or DeepSpeed") from None
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                for k, v in _saved.items():
                    os.environ.pop(k, None)
                    if v is not None:
                        os.environ[k] = v


def torch_load(src: Any, map_location: Any = "cpu", what: str | None = None) -> Any:
    """torch.load of one file (a path or a file object), data only (InputError naming `what`,
    default the path, otherwise)."""
    import torch

    with weights_only(what or str(src)):
        return torch.load(src, map_location=map_location, weights_only=True)


class _DataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _DATA_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"GLOBAL {module}.{name}")


def load_data_pickle(data: bytes, name: str) -> Any:
    """Unpickle a dataset file (CIFAR's python batches: py2 pickles, so bytes keys) that may
    only hold dicts, lists, numbers, strings, bytes and numeric numpy arrays."""
    try:
        obj = _DataUnpickler(io.BytesIO(data), encoding="bytes").load()
    except pickle.UnpicklingError as e:
        raise _refusal(name, e, "use the dataset's official files") from None
    except (EOFError, ValueError, TypeError, AttributeError, IndexError) as e:
        raise InputError(f"{name}: not a readable python pickle ({e}); is the download complete?") from None
    _check_numeric(obj, name)
    return obj


# What a dataset pickle may hold, walked once after it loads: CIFAR-100's training batch, the
# largest, is a dict of 5 entries with three 50,000-entry lists (about 150,000 values) at depth 2.
# A pickle can build a list that contains itself (9 bytes) or nest shared lists so that a walk
# without memory visits 2^40 paths in a few hundred bytes; both are refused, in one pass.
MAX_DATA_VALUES = 1_000_000
MAX_DATA_DEPTH = 16


def _check_numeric(obj: Any, name: str) -> None:
    """A tree of plain data, each container visited once: no object arrays (their elements would be
    whatever the pickle built, still only data here, but a dataset has no use for them), no
    container that appears twice (a cycle or shared nesting), at most MAX_DATA_VALUES values and
    MAX_DATA_DEPTH levels."""
    import numpy as np

    seen: set[int] = set()
    stack: list[tuple[Any, int]] = [(obj, 0)]
    count = 1
    while stack:
        x, depth = stack.pop()
        if isinstance(x, np.ndarray) and x.dtype.hasobject:
            raise InputError(f"{name}: holds an array of Python objects; a dataset batch holds numbers")
        if not isinstance(x, (dict, list, tuple)) or not x:  # an empty one holds nothing (and () is shared)
            continue
        if id(x) in seen:
            raise InputError(f"{name}: a list or dict in it holds itself or appears twice; a dataset batch "
                             "is a plain tree of arrays, lists and numbers (use the dataset's official files)")
        seen.add(id(x))
        count += 2 * len(x) if isinstance(x, dict) else len(x)  # keys too: a tuple key can nest
        if count > MAX_DATA_VALUES:
            raise InputError(f"{name}: holds more than {MAX_DATA_VALUES:,} values; a dataset batch holds a few "
                             "arrays and lists (use the dataset's official files)")
        if depth >= MAX_DATA_DEPTH:
            raise InputError(f"{name}: nested more than {MAX_DATA_DEPTH} levels deep; a dataset batch is a dict "
                             "of arrays and lists (use the dataset's official files)")
        stack += [(c, depth + 1) for c in ([*x.keys(), *x.values()] if isinstance(x, dict) else x)]
