"""train.record_samples: the keys (and epochs) each rank trains on, by step, written beside the
checkpoints; and `kept_samples`, the steps a run kept (its newest checkpoint's worker-group attempt,
back through the attempts each resumed from), to compare a resumed run with an uninterrupted one."""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from .. import storage
from ..config import Run
from . import checkpoint as ckpt


class SampleRecorder:
    """train.record_samples: the keys (and epochs) of every micro-batch this rank trains on, by step,
    written beside the checkpoints each time one is saved, up to its step:
    <run>/samples/rank_NNNNN/from_F_upto_S_A.jsonl, A the worker group's attempt (as in the
    checkpoint's meta.json) and F the step it started from; rank 0 adds samples/attempts/A.json
    ({first: F, parent: the attempt whose checkpoint it resumed from, world}). The steps a run kept
    are its newest checkpoint's attempt's, then its parent's before F, and so on back to step 0:
    what a resumed run trained on, to compare with an uninterrupted run (benchmarks/soak_checks.py)."""

    def __init__(self, run: Run, rank: int, world: int, first_step: int, parent: str | None):
        self.root = storage.join(run.dir, "samples")
        self.dir = storage.join(self.root, f"rank_{rank:05d}")
        self.accum, self.first, self.micro = run.cfg.parallel.grad_accum, first_step, 0
        self.rank, self.world, self.parent, self.noted = rank, world, parent, False
        self.pending: list[tuple[int, list[str], list[int]]] = []  # (step, keys, epochs)

    def __call__(self, keys, epochs) -> None:
        self.pending.append((self.first + 1 + self.micro // self.accum, [str(k) for k in keys],
                             [int(e) for e in epochs]))
        self.micro += 1

    def flush(self, upto: int, attempt: str) -> None:
        if self.rank == 0 and not self.noted:
            storage.write_json(storage.join(self.root, "attempts", f"{attempt}.json"),
                               {"first": self.first, "parent": self.parent, "world": self.world})
            self.noted = True
        done = [p for p in self.pending if p[0] <= upto]
        self.pending = [p for p in self.pending if p[0] > upto]
        if done:
            lines = "\n".join(json.dumps({"step": s, "keys": k, "epochs": e}) for s, k, e in done)
            name = f"from_{self.first:08d}_upto_{upto:08d}_{attempt}.jsonl"
            storage.write_bytes(storage.join(self.dir, name), lines.encode())


@dataclass
class Kept:
    """What a run kept up to its newest complete checkpoint (`checkpoint`, its meta.json `meta`):
    `steps` {(rank, step): [(key, epoch), ...]} and `attempts` (oldest first: attempt, first, upto,
    world); `problems` names what the record lacks (a step, an attempt) to say so."""

    checkpoint: str | None
    meta: dict = field(default_factory=dict)
    steps: dict = field(default_factory=dict)
    attempts: list = field(default_factory=list)
    problems: list = field(default_factory=list)


def kept_samples(root: str) -> Kept:
    """The samples the run in directory `root` (a path or URI) kept, from train.record_samples."""
    latest = ckpt.latest_complete_in(root)
    if latest is None:
        return Kept(None, problems=[f"{root}: no complete checkpoint"])
    meta = ckpt.read_meta(latest)
    kept, upto, attempt = Kept(latest, meta), int(meta["step"]), meta.get("attempt")
    samples = storage.join(root, "samples")
    while attempt is not None:
        where = storage.join(samples, "attempts", f"{attempt}.json")
        if not storage.exists(where):
            kept.problems.append(f"attempt {attempt} (steps up to {upto}) has no record in {samples}")
            break
        info = storage.read_json(where)
        kept.attempts.insert(0, {"attempt": attempt, "first": int(info["first"]), "upto": upto,
                                 "world": int(info["world"])})
        upto, attempt = int(info["first"]), info["parent"]
    if kept.attempts and kept.attempts[0]["first"] != 0 and not kept.problems:
        kept.problems.append(f"the attempts kept begin at step {kept.attempts[0]['first']}, not 0")
    for link in kept.attempts:
        for rank in range(link["world"]):
            rank_dir = storage.join(samples, f"rank_{rank:05d}")
            names = sorted(n for n in (storage.listdir(rank_dir) if storage.exists(rank_dir) else [])
                           if n.endswith(f"_{link['attempt']}.jsonl"))
            for name in names:  # one attempt's files: consecutive steps, in order
                for line in storage.read_bytes(storage.join(rank_dir, name)).decode().splitlines():
                    rec = json.loads(line)
                    if link["first"] < rec["step"] <= link["upto"]:
                        kept.steps.setdefault((rank, rec["step"]), []).extend(zip(rec["keys"], rec["epochs"]))
            missing = [s for s in range(link["first"] + 1, link["upto"] + 1) if (rank, s) not in kept.steps]
            if missing:
                kept.problems.append(f"rank {rank} of attempt {link['attempt']}: steps {missing[:5]}"
                                     f"{' ...' if len(missing) > 5 else ''} not recorded")
    return kept
