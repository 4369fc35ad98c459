"""A run's params on a resume: MLflow params cannot change, so a resumed run logs only what is new,
records the new value of a key it may continue with (CONTINUABLE) beside the first, and refuses any
other change with ParamConflictError, which names each key and the fix. No MLflow call here.
"""
from __future__ import annotations

from vitp.tracking.store import TrackingError

# Params a finished run may be continued with a new value of (`vitp pretrain ... --set train.steps=N`).
# Keys a resumed run may change: its length, the worker count (resume at another world size keeps
# the global batch; micro batch and accumulation follow it), and how long it waits for them.
CONTINUABLE = ("train.steps", "train.pause_at", "parallel.num_workers", "parallel.min_workers", "parallel.grad_accum",
               "parallel.micro_batch", "parallel.placement_timeout_s")


class ParamConflictError(TrackingError, ValueError):
    """A resumed run already holds a different value for a param (MLflow params are immutable)."""


def continued(wanted: dict[str, str], existing: dict[str, str], continued_at: int,
              continuable: tuple[str, ...] = ()) -> dict[str, str]:
    """`wanted` (MLflow param strings) for a run continued at step `continued_at` that holds
    `existing`: a CONTINUABLE key (or one of `continuable`: a population-based search's perturbed
    keys) with a new value keeps its first, and the new one is recorded as
    `<key>.continued_at_<step>` unless an earlier continuation recorded it already."""
    wanted = dict(wanted)
    for key in CONTINUABLE + tuple(continuable):
        if key in wanted and key in existing and existing[key] != wanted[key]:
            value = wanted.pop(key)
            recorded = {v for k, v in existing.items() if k.startswith(f"{key}.continued_at_")}
            if value not in recorded:
                wanted[f"{key}.continued_at_{continued_at}"] = value
    return wanted


def check_conflicts(run_id: str, run_name: str, wanted: dict[str, str], existing: dict[str, str]) -> None:
    """ParamConflictError naming every key of `wanted` whose value the run already holds differently."""
    conflicts = [(k, existing[k], v) for k, v in wanted.items() if k in existing and existing[k] != v]
    if not conflicts:
        return
    lines = "\n".join(f"  {k}: logged {old!r}, now {new!r}" for k, old, new in conflicts[:10])
    more = f"\n  ... and {len(conflicts) - 10} more" if len(conflicts) > 10 else ""
    raise ParamConflictError(
        f"MLflow run {run_id} ({run_name!r}) already has different values for "
        f"{len(conflicts)} param(s):\n{lines}{more}\n"
        "MLflow params cannot change. To run with the new values start a new run "
        "(e.g. --set tracking.run_name=<new name>); to resume this run use its original config."
    )
