"""Few-shot probes during training: every `train.fewshot_every` steps rank 0 copies the weights
(gathered under ZeRO-3), puts them in the object store and a low-priority CPU actor scores them
(features.py, solver.py); the results are logged at the snapshot's step. Must not
make a training step wait on an evaluation, nor let a failed one stop training (it is a warning).
"""
from __future__ import annotations

import collections
import dataclasses
import os
import time
import warnings
from typing import Any, Callable, Optional

import numpy as np
import ray

from .. import storage
from ..console import get_logger
from ..config import ExperimentConfig, Run
from .solver import SHOTS, fewshot_accuracy, num_classes_of, shot_indices
from .features import read_split

_log = get_logger(__name__)

SEEDS = 3  # as `vitp fewshot` and big_vision
# The actor reserves no logical CPU: 0.25 left Ray Data's readers (whole-CPU tasks) one slot short
# beside the worker group and slowed the input pipeline by 10-20% (benchmarks/RESULTS.md); at
# SCHED_IDLE it only ever runs on cycles nothing else wants.
PROBE_CPUS = 0
PROBE_NICE = 19  # where SCHED_IDLE is not available: the lowest nice (Ray's workers run at 15)
MAX_PENDING = 4  # snapshots queued or being scored; a later one is skipped (with a warning)
FINISH_TIMEOUT_S = 600.0  # at the end of training, the longest wait for the queued ones


def dataset_roots(run: Run) -> dict[str, str]:
    """{name: shard dir} of train.fewshot_datasets: an entry with a "/" (a path or URI) is a shard
    dir named by its last part; a bare name is `<work_dir>/shards/<name>` (where `vitp
    preprocess` puts a recipe's shards, e.g. debug_finetune's digits)."""
    out = {}
    for entry in (e.strip() for e in run.cfg.train.fewshot_datasets):
        if entry:
            root = entry if "/" in entry else run.paths.shards(entry)
            out[storage.basename(root.rstrip("/"))] = root
    return out


def metric_key(dataset: str, shots: int) -> str:
    return f"fewshot/{dataset}_{shots}shot_top1"


def snapshot_weights(module, zero_stage: int, rank: int) -> Optional[dict[str, np.ndarray]]:
    """An fp32 copy of the model's weights on rank 0 (None on other ranks). Under ZeRO-3 each rank
    holds a slice, so every rank must call it: one `init_groups` group at a time is gathered (as
    `load_grouped` does) and rank 0 copies it; the whole model is never gathered at once."""
    import torch  # lazy: the actor imports this module before lowering its priority

    if zero_stage != 3:
        if rank != 0:
            return None
        return {k: v.detach().to("cpu", torch.float32).numpy().copy() for k, v in module.state_dict().items()}
    import deepspeed  # lazy: deepspeed (ZeRO-3 only)

    names = {id(p): n for n, p in module.named_parameters()}
    out: dict[str, np.ndarray] = {}
    failed: Optional[Exception] = None
    for params in module.init_groups():
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            if rank == 0 and failed is None:
                try:
                    out.update({names[id(p)]: p.detach().to("cpu", torch.float32).numpy().copy() for p in params})
                except Exception as e:  # noqa: BLE001 - keep joining the other ranks' gathers
                    failed = e
    if failed is not None:
        raise failed
    if rank != 0:
        return None
    keys = set(module.state_dict())  # persistent buffers (none in our ViT) are not partitioned
    return {**out, **{k: b.detach().to("cpu", torch.float32).numpy().copy()
                      for k, b in module.named_buffers() if k in keys}}


def lower_priority() -> None:
    """This thread, and the threads it starts, to SCHED_IDLE: CPU time no other process wants
    (below any nice level; Ray's own workers run at nice 15); nice 19 where Linux's policy is missing."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        os.nice(PROBE_NICE)


class FewshotActor:
    """The Ray actor that scores snapshots, one at a time, on one idle-priority thread. Each
    dataset's rows are read once (Ray Data) and kept: the test split, and of the train split only
    the rows some (seed, shots) draw uses (`shot_indices` depends on the labels alone)."""

    def __init__(self, cfg_dict: dict[str, Any], roots: dict[str, str]):
        lower_priority()  # first: torch's import and the model build run at it too
        from threadpoolctl import threadpool_limits  # lazy: the actor only

        from ..model.vit import build_vit  # lazy: torch
        from .features import FeatureExtractor

        threadpool_limits(1)  # numpy's BLAS in the solver: one thread too
        self.cfg = ExperimentConfig.from_dict(cfg_dict)
        self.roots = roots
        self.model = build_vit(self.cfg.model, self.cfg.data.image_size, init=False,
                               mpp=self.cfg.train.objective == "mpp")  # (its probe features differ)
        self.extract = FeatureExtractor(self.model, self.cfg.data.mean, self.cfg.data.std, threads=1)
        self.sets: dict[str, tuple] = {}

    def warm(self) -> None:
        """Read the datasets now (while training starts up); a failure is reported by evaluate."""
        for name in self.roots:
            try:
                self._rows(name)
            except Exception:  # noqa: BLE001 - evaluate() reads it again and reports the error
                pass

    def _rows(self, name: str) -> tuple:
        if name not in self.sets:
            data = dataclasses.replace(self.cfg.data, shards=self.roots[name])
            run = Run.of(dataclasses.replace(self.cfg, data=data))
            train = read_split(run, "train", self.model.image_size)
            test = read_split(run, "val", self.model.image_size)
            k = num_classes_of(train["label"], test["label"])
            used = np.unique(np.concatenate(list(shot_indices(train["label"], k, SHOTS, SEEDS).values())))
            self.sets[name] = (train["image"][used], used, train["label"], test["image"], test["label"])
        return self.sets[name]

    def _features(self, images: np.ndarray, batch: int = 256) -> np.ndarray:
        return np.concatenate([self.extract({"image": images[i:i + batch]})["features"]
                               for i in range(0, len(images), batch)])

    def evaluate(self, weights: dict[str, np.ndarray]) -> tuple[dict[str, float], dict[str, str]]:
        """({fewshot/<dataset>_<k>shot_top1: top-1, perf/fewshot_eval_s, perf/fewshot_eval_cpu_s},
        {dataset: error line})."""
        import torch  # lazy: loaded by __init__

        t0, c0 = time.perf_counter(), time.process_time()
        wanted = set(self.model.state_dict())
        missing = sorted(wanted - set(weights))
        if missing:
            raise ValueError(f"the snapshot lacks {missing[:5]}")
        with warnings.catch_warnings():  # object-store arrays are read-only; load_state_dict copies
            warnings.simplefilter("ignore", UserWarning)
            self.model.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()
                                        if k in wanted})
        self.model.eval()
        metrics, errors = {}, {}
        for name in self.roots:
            try:
                images, used, train_y, test_images, test_y = self._rows(name)
                feats = self._features(images)  # (len(used), R)
                train_x = np.zeros((len(train_y), feats.shape[1]), np.float32)  # rows never drawn stay 0
                train_x[used] = feats
                acc = fewshot_accuracy(train_x, train_y, self._features(test_images), test_y, SHOTS, SEEDS)
                metrics.update({metric_key(name, k): v for k, v in acc.items()})
            except Exception as e:  # noqa: BLE001 - one dataset's failure is reported, not raised
                lines = str(e).strip().splitlines()
                errors[name] = f"{type(e).__name__}: {lines[0] if lines else ''}"[:300]
        if not metrics:
            return {}, errors
        # seconds from start to result, and CPU seconds this process spent (what training lost at most)
        return {**metrics, "perf/fewshot_eval_s": time.perf_counter() - t0,
                "perf/fewshot_eval_cpu_s": time.process_time() - c0}, errors


class FewshotProbes:
    """The training side. `snapshot(step)` is LoopHooks.on_fewshot (every rank); on rank 0 it
    queues the copy on the actor. `poll()` (at log steps) and `finish()` (after the last step)
    log finished results in step order; `close()` ends the actor."""

    def __init__(self, run: Run, engine, rank: int, logger=None,
                 say: Callable[[str], None] = _log.info, ema=None):
        self.cfg, self.engine, self.rank, self.logger, self.say = run.cfg, engine, rank, logger, say
        self.ema = ema  # train.fewshot_weights=ema: the probes score the weight EMA (ema.WeightEMA)
        self.roots = dataset_roots(run)
        self.actor = None
        self.pending: collections.deque = collections.deque()  # (step, ObjectRef) in step order
        self.warned: set[str] = set()
        self.snapshot_s: dict[int, float] = {}
        if rank == 0 and self.roots:
            self._start()  # its process start and dataset reads overlap the run's first steps

    def _start(self) -> None:
        try:
            self.actor = ray.remote(num_cpus=PROBE_CPUS)(FewshotActor).remote(self.cfg.to_dict(), self.roots)
            self.actor.warm.remote()
        except Exception as e:  # noqa: BLE001
            self._warn(f"few-shot actor not started ({type(e).__name__}: {e})")

    def _warn(self, line: str, once: Optional[str] = None) -> None:
        if once is None or once not in self.warned:
            self.say(f"warning: {line}; training goes on")
            self.warned.add(once or line)

    def snapshot(self, step: int) -> None:
        t0 = time.perf_counter()
        try:
            if self.ema is not None:
                whole = self.ema.whole(everywhere=False)  # a collective, one block at a time
                weights = {k: v.numpy() for k, v in whole.items()} if whole is not None else None
            else:
                weights = snapshot_weights(self.engine.module, self.cfg.parallel.zero_stage, self.rank)
        except Exception as e:  # noqa: BLE001 - a failed copy costs this probe, not the run
            self._warn(f"few-shot snapshot of step {step} failed ({type(e).__name__}: {e})")
            return
        if self.rank != 0 or not self.roots:
            return
        if len(self.pending) >= MAX_PENDING:
            self._warn(f"few-shot probe of step {step} skipped: {len(self.pending)} earlier ones are "
                       "still running (raise train.fewshot_every)")
            return
        try:
            if self.actor is None:
                self._start()
            self.pending.append((step, self.actor.evaluate.remote(ray.put(weights))))
            self.snapshot_s[step] = time.perf_counter() - t0  # what the training step paid
        except Exception as e:  # noqa: BLE001
            self._warn(f"few-shot probe of step {step} not started ({type(e).__name__}: {e})")

    def poll(self) -> None:
        """Log the results that are in, oldest first; never waits."""
        while self.pending and ray.wait([self.pending[0][1]], timeout=0)[0]:
            self._log(*self.pending.popleft())

    def finish(self, timeout_s: float = FINISH_TIMEOUT_S) -> None:
        """Wait (at most timeout_s in all) for the queued probes and log them."""
        deadline = time.monotonic() + timeout_s
        while self.pending:
            step, ref = self.pending[0]
            if not ray.wait([ref], timeout=max(deadline - time.monotonic(), 0))[0]:
                self._warn(f"{len(self.pending)} few-shot probe(s) from step {step} on not finished "
                           f"after {timeout_s:.0f} s: not logged")
                self.pending.clear()
                return
            self._log(*self.pending.popleft())

    def close(self) -> None:
        if self.actor is not None:
            ray.kill(self.actor, no_restart=True)
            self.actor = None

    def _log(self, step: int, ref) -> None:
        try:
            metrics, errors = ray.get(ref)
        except Exception as e:  # noqa: BLE001 - the actor died or the evaluation raised
            if isinstance(e, ray.exceptions.RayActorError):
                self.actor = None  # the next snapshot starts a new one
            line = (str(e).strip().splitlines() or [""])[-1][:300]
            self._warn(f"few-shot probe of step {step} failed ({type(e).__name__}: {line})")
            return
        for name, err in errors.items():
            self._warn(f"few-shot probe on {name} ({self.roots[name]}) failed: {err}", once=f"{name}: {err}")
        if not metrics:
            return
        self.say(f"few-shot at step {step}: " + ", ".join(
            f"{name} " + "/".join(f"{metrics[metric_key(name, k)]:.3f}" for k in SHOTS)
            for name in self.roots if metric_key(name, SHOTS[0]) in metrics) + f" ({'/'.join(map(str, SHOTS))} shots)")
        if self.logger is not None:
            self.logger.log_metrics({**metrics, "perf/fewshot_snapshot_s": self.snapshot_s.pop(step, 0.0)}, step=step)
