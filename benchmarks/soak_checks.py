"""The chaos soak's invariants (benchmarks/soak.py), checked once its workloads have ended: each is a
name, what was checked, and the violations found (none is the pass)."""
from __future__ import annotations

import functools
import re
import subprocess
import sys
from pathlib import Path

from soak_dealing import dealt, read_units  # benchmarks/, on the path of whatever imports this

ROOT = Path(__file__).resolve().parent.parent
LOCAL_ONLY = ("*.parquet", "meta.json", "*.safetensors", "checkpoint_*")  # what belongs in storage
ENDED = ("FINISHED", "KILLED", "FAILED")


@functools.lru_cache(maxsize=16)
def _kept(run_dir: str):
    """What the run in `run_dir` kept (vitp.train.samples.kept_samples), read once for the checks that
    need it (every rank's record files, from the bucket)."""
    from vitp.train.samples import kept_samples

    return kept_samples(run_dir)


def _runs(uri: str) -> list:
    from vitp.tracking.store import get_client

    client = get_client(uri)
    experiments = [e.experiment_id for e in client.search_experiments()]
    return [r for r in client.search_runs(experiments, max_results=5000)
            if (r.data.tags.get("sweep") or "").startswith("soak-") or r.info.run_name.startswith("soak-")]


def _ranges(steps: list[int]) -> str:
    """[1, 2, 3, 7, 9, 10] as "1-3, 7, 9-10"."""
    spans: list[list[int]] = []
    for s in steps:
        if spans and s == spans[-1][1] + 1:
            spans[-1][1] = s
        else:
            spans.append([s, s])
    return ", ".join(f"{a}-{b}" if b > a else str(a) for a, b in spans)


def _last_step(run) -> int | None:
    """The step a run's train/loss must reach: train.steps for a run that ended FINISHED (it trained
    them all), None for one stopped, killed or failed on the way (its last logged step is its end)."""
    steps = run.data.params.get("train.steps")
    return int(steps) if run.info.status == "FINISHED" and steps and run.data.tags.get("kind") != "sweep" else None


def metrics_once(uri: str, runs) -> dict:
    """Every (metric, step) of every run exactly once; train/loss steps contiguous from 1, up to
    train.steps for a FINISHED run (a lost tail is a violation, not a shorter run)."""
    from vitp.tracking.store import get_client

    client, bad, n = get_client(uri), [], 0
    for run in runs:
        name, keys, last = run.info.run_name, set(run.data.metrics), _last_step(run)
        if last is not None and "train/loss" not in keys:
            bad.append(f"{name}: FINISHED after {last} steps without train/loss")
        for key in keys:
            steps = [m.step for m in client.get_metric_history(run.info.run_id, key)]
            n += len(steps)
            if len(steps) != len(set(steps)):
                bad.append(f"{name} {key}: {len(steps) - len(set(steps))} step(s) logged twice")
            if key == "train/loss":
                end = max(steps) if last is None else last
                missing = sorted(set(range(1, end + 1)) - set(steps))
                if missing:
                    bad.append(f"{name} train/loss: {len(missing)} step(s) missing: {_ranges(missing)}")
                if max(steps) > end:
                    bad.append(f"{name} train/loss: steps past train.steps {end}: up to {max(steps)}")
    return {"name": "every (metric, step) once, train/loss steps contiguous to the end",
            "checked": f"{n} points of {len(runs)} runs", "violations": bad}


def resends(folder: Path, runs) -> dict:
    """No metric point acknowledged twice: every post the server acknowledged, as each process wrote
    it down (VITP_METRIC_SEND_LOG, vitp/tracking/spool.py). MLflow keeps one of identical points, so
    a resend with the original timestamp would pass metrics_once; this count does not read MLflow."""
    names = {r.info.run_id: r.info.run_name for r in runs}
    posts: dict[tuple[str, str, str], int] = {}
    for path in sorted(Path(folder).glob("sends-*.tsv")):
        for line in path.read_text().splitlines():
            run_id, key, step, _ts = line.split("\t")
            if run_id in names:
                posts[(run_id, key, step)] = posts.get((run_id, key, step), 0) + 1
    bad = [f"{names[r]} {k} step {s}: acknowledged {n} times" for (r, k, s), n in sorted(posts.items()) if n > 1]
    return {"name": "every metric point posted once (the senders' own record)",
            "checked": f"{len(posts)} points acknowledged", "violations": bad}


def statuses(runs) -> dict:
    """Every run ended as it should, none RUNNING; each trial stopped or failed says why. (That a
    FINISHED run logged every step is metrics_once's.)"""
    bad = []
    for run in runs:
        name, status, tags = run.info.run_name, run.info.status, run.data.tags
        if status not in ENDED:
            bad.append(f"{name}: {status}")
        trial = tags.get("mlflow.parentRunId")
        if trial and status == "KILLED" and not tags.get("vitp.stopped_by") and not tags.get("vitp.stale"):
            bad.append(f"{name}: trial KILLED without a scheduler's or staleness tag")
        if trial and status == "FAILED" and not tags.get("vitp.error"):
            bad.append(f"{name}: trial FAILED without vitp.error")
    return {"name": "runs ended FINISHED/KILLED/FAILED with a reason, none RUNNING",
            "checked": f"{len(runs)} runs", "violations": bad}


def epochs_whole(name: str, taken: dict[int, list[str]], every: set[str]) -> list[str]:
    """What a run trained, by epoch, against the shards' keys alone: no sample twice in an epoch and
    none from outside the shards. Whether an epoch holds every sample it should by the checkpoint is
    kept_complete's: the ranks' shares of an epoch differ in rows (a shard's short last unit), so a
    rank may be epochs behind another and no fixed lag says when an epoch must be whole (docs/data.md)."""
    bad = []
    for epoch in sorted(taken):
        got = taken[epoch]
        if len(got) != len(set(got)):
            bad.append(f"{name} epoch {epoch}: {len(got) - len(set(got))} sample(s) twice")
        if set(got) - every:
            bad.append(f"{name} epoch {epoch}: {len(set(got) - every)} sample(s) not in the shards")
    return bad


def _taken(kept) -> dict[int, list[str]]:
    """{epoch: keys trained} of a run's kept samples (vitp.train.samples.Kept)."""
    taken: dict[int, list[str]] = {}
    for rows in kept.steps.values():
        for key, epoch in rows:
            taken.setdefault(epoch, []).append(key)
    return taken


def kept_complete(name: str, kept, units: list[list[str]]) -> tuple[int, list[str]]:
    """One run's samples (vitp.train.samples.Kept) against what the dealing order gave its workers by
    its checkpoint (soak_dealing.dealt: from the shards' read units `units`, the seed and the run's
    worker-count history alone): how many it kept, and what is wrong: a sample due and never trained
    (skipped), one trained before it was due. (Duplicates and keys outside the shards: epochs_whole.)"""
    meta, bad, taken = kept.meta, [f"{name}: {p}" for p in kept.problems], _taken(kept)
    state, count = meta["train_state"], sum(len(v) for v in taken.values())
    if count != int(state["samples_seen"]):
        bad.append(f"{name}: {count} samples recorded, its checkpoint counts {state['samples_seen']}")
    worlds = state.get("worlds") or [[int(meta["world_size"]), 0]]
    due = dealt(units, int(meta["config"]["train"]["seed"]), worlds, int(state["samples_seen"]),
                int(state.get("dealing") or 1))
    for epoch in sorted(set(taken) | set(due)):
        got, want = set(taken.get(epoch, [])), set(due.get(epoch, []))
        if got - want:
            bad.append(f"{name} epoch {epoch}: {len(got - want)} sample(s) trained that the dealing order "
                       "had not given its workers by then")
        if want - got:
            bad.append(f"{name} epoch {epoch}: {len(want - got)} sample(s) dealt and never trained")
    return count, bad


def samples(work: str, runs) -> dict:
    """train.record_samples: what each run kept (its newest checkpoint's attempt back to step 0,
    vitp.train.samples) is every step recorded on every rank, as many samples as its checkpoint
    counts; against the shards alone (epochs_whole), each sample at most once an epoch; every epoch
    what the dealing order gave its workers by then, nothing skipped (kept_complete)."""
    from vitp.config import Run
    from vitp.paths import RunPaths
    from vitp.recipes import resolve

    shards, bad, checked, units = Run.of(resolve("debug", [f"work_dir={work}"], check_paths=False)).shards, [], 0, {}
    every = None  # the shards' keys, read once
    for run in runs:
        name = run.info.run_name
        if not name.startswith("soak-pretrain-"):
            continue
        kept = _kept(RunPaths(work).run(name))
        if kept.checkpoint is None:
            continue  # killed before its first checkpoint: nothing kept
        rows = int(kept.meta["train_state"]["unit_rows"])
        units[rows] = units.get(rows) or read_units(shards, rows)
        every = every if every is not None else {key for unit in units[rows] for key in unit}
        count, wrong = kept_complete(name, kept, units[rows])
        checked, bad = checked + count, bad + epochs_whole(name, _taken(kept), every) + wrong
    return {"name": "each sample at most once per epoch, none skipped",
            "checked": f"{checked} samples trained", "violations": bad}


_OPTIM = re.compile(r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt")


def independently_complete(where: str) -> tuple[bool, str]:
    """Whether the checkpoint at `where` holds what DeepSpeed writes for its world size and ZeRO
    stage (the model states: rank 0's, or every rank's at ZeRO-3; every rank's optimizer states from
    ZeRO-1 on), each torch file an intact zip archive (every member's CRC read). Read without
    vitp.train.checkpoint.verify and its completion markers, which are what chose it."""
    import io
    import zipfile

    from vitp import storage

    try:
        meta = storage.read_json(storage.join(where, "meta.json"))
        world, tag = int(meta["world_size"]), meta["tag"]
        stage = int(meta["config"]["parallel"]["zero_stage"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        return False, f"meta.json unreadable: {e}"
    names = {rel.split("/", 1)[1] for rel in storage.file_sizes(where) if rel.startswith(tag + "/")}
    model = ([f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(world)] if stage == 3
             else ["mp_rank_00_model_states.pt"])
    missing = [n for n in model if n not in names]
    optim = {int(m.group(1)) for n in names if (m := _OPTIM.fullmatch(n))}
    if stage >= 1 and optim != set(range(world)):
        missing.append(f"optimizer states of rank(s) {sorted(set(range(world)) - optim)} of {world}")
    if missing:
        return False, f"ZeRO-{stage}, {world} rank(s): missing {', '.join(missing)}"
    for name in sorted(n for n in names if n.endswith(".pt")):
        with storage.open_input(storage.join(where, tag, name)) as f:
            data = f.read()
        try:
            bad = zipfile.ZipFile(io.BytesIO(data)).testzip()
        except zipfile.BadZipFile as e:
            bad = f"not a whole archive ({e})"
        if bad:
            return False, f"{tag}/{name}: {bad}"
    return True, f"ZeRO-{stage}, {world} rank(s): complete"


class Picks:
    """What each resume picked, read at the time: the soak's loop calls `scan` every few seconds,
    which finds new "resumed from X" lines in the workloads' logs and reads X at once with
    independently_complete (later, retention may have deleted it)."""

    def __init__(self):
        self.seen: dict[str, int] = {}  # log -> bytes read
        self.found: list[dict] = []

    def scan(self, logs: list[Path]) -> None:
        for log in logs:
            if not log.exists():
                continue
            with open(log, "rb") as f:
                f.seek(self.seen.get(str(log), 0))
                text = f.read()
            end = text.rfind(b"\n") + 1  # whole lines only; the rest on the next scan
            self.seen[str(log)] = self.seen.get(str(log), 0) + end
            for where, step in re.findall(r"\] resumed from (\S+) at step (\d+)", text[:end].decode(errors="replace")):
                ok, why = independently_complete(where)
                self.found.append({"log": log.name, "where": where, "step": int(step), "complete": ok, "why": why})


def checkpoints(work: str, runs, logs: list[Path], env: dict, picks: Picks) -> dict:
    """Every checkpoint a resume picked was complete when it was picked (`picks`, read at the time,
    independently of the verify that chose it; a pick the scans missed is read now, if it is still
    there); each finished pre-training's final weights export."""
    from vitp import storage
    from vitp.paths import RunPaths
    from vitp.train import checkpoint as ckpt

    picks.scan(logs)  # lines written since the loop's last scan
    bad = [f"picked incomplete: {p['where']} (at step {p['step']}): {p['why']}" for p in picks.found
           if not p["complete"]]
    for run in runs:  # a check that read no pick must not pass a run that resumed
        name = run.info.run_name
        if name.startswith("soak-pretrain-"):
            resumed = [a for a in _kept(RunPaths(work).run(name)).attempts if a["first"] > 0]
            seen = {p["step"] for p in picks.found if p["log"] == f"{name.removeprefix('soak-')}.log"}
            if missing := [a["first"] for a in resumed if a["first"] not in seen]:
                bad.append(f"{name} resumed at step(s) {missing} (its samples record) and its log shows no "
                           "'resumed from' line for them: the picks there were not checked")
    exported = 0
    for run in runs:
        if not run.info.run_name.startswith("soak-pretrain-") or run.info.status != "FINISHED":
            continue
        steps = run.data.params.get("train.steps")
        final = storage.join(RunPaths(work).run(run.info.run_name), ckpt.checkpoint_dir_name(int(steps)))
        out = storage.join(work, "exports", run.info.run_name)
        r = subprocess.run([sys.executable, "-m", "vitp.cli", "export", final, "--out", out], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=600)
        if r.returncode != 0 or not storage.isfile(storage.join(out, "model.safetensors")):
            bad.append(f"{run.info.run_name}: export of {final} failed: {(r.stderr or r.stdout)[-300:]}")
        exported += 1
    return {"name": "no incomplete checkpoint picked (read when picked), final weights export",
            "checked": f"{len(picks.found)} resumes' checkpoints, {exported} exported", "violations": bad}


def node_local(world) -> dict:
    """No file on a live node's own disk that belongs in storage (shards, checkpoints, exports)."""
    alive = [0] + world.alive_worker_nodes()
    hits = []
    for i in alive:
        d = world.cluster.state_dir / f"node-{i}"
        for pat in LOCAL_ONLY:
            hits += [str(p) for p in d.rglob(pat)]
    return {"name": "nothing left on node-local disks that belongs in storage",
            "checked": f"{len(alive)} live nodes' directories", "violations": sorted(hits)}


def ended(workloads, interrupted: list[str]) -> dict:
    """Each workload ended by itself before the deadline, its last launch with exit 0."""
    for w in workloads:
        w.poll()  # the last launch's exit, where the soak's loop ended before it saw it
    bad = [f"{name}: interrupted at the deadline" for name in interrupted]
    bad += [f"{w.name}: last launch exited {w.exits[-1]}" for w in workloads
            if w.name not in interrupted and w.exits and w.exits[-1] != 0]
    return {"name": "workloads ended by themselves, exit 0", "checked": f"{len(workloads)} workloads",
            "violations": bad}


def check_all(world, work: str, env: dict, interrupted: list[str], picks: Picks) -> dict:
    runs = _runs(world.uri)
    logs = [w.log for w in world.workloads]
    return {"runs": len(runs), "checks": [ended(world.workloads, interrupted), metrics_once(world.uri, runs),
                                          resends(world.sends, runs), statuses(runs), samples(work, runs), checkpoints(work, runs, logs, env, picks),
                                          node_local(world)]}


def table(result: dict) -> str:
    from soak_faults import KINDS  # benchmarks/soak_faults.py

    hit = [f for f in result["faults"] if f["hit"] and f["kind"] in KINDS]
    counts = ", ".join(f"{k} {sum(f['kind'] == k for f in hit)}" for k in KINDS)
    after = [f for f in result["faults"] if f["kind"] not in KINDS]  # a node back, MLflow up, S3 back
    later = ", ".join(f"{k} {sum(f['kind'] == k for f in after)}" for k in sorted({f["kind"] for f in after}))
    launches = ", ".join(f"{n} ({w['launches']} launches)" for n, w in result["workloads"].items())
    missed = sum(not f["hit"] for f in result["faults"])
    lines = [f"{len(hit)} faults thrown ({counts}; then {later}), {missed} tries found nothing to hit; "
             f"workloads: {launches}", "",
             "| invariant | checked | violations |", "|---|---|---|"]
    for c in result["checks"]:
        lines.append(f"| {c['name']} | {c['checked']} | {len(c['violations'])} |")
    for c in result["checks"]:
        lines += [f"  {c['name']}: {v}" for v in c["violations"][:10]]
    load = result.get("tracking_load")
    if load:
        lines += ["", "Tracking load on the same PostgreSQL-backed server:", ""]
        from tracking_load import table as load_table  # benchmarks/tracking_load.py

        lines.append(load_table(load))
    return "\n".join(lines)
