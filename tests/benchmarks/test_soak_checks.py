"""The chaos soak's invariants (benchmarks/soak_checks.py) find what is planted: each check given
runs in a real MLflow store (SQLite here) with one violation each, and the healthy runs beside
them pass."""
import os
import sys
from pathlib import Path

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import soak_checks  # noqa: E402


def _run(client, experiment, name, status, steps, train_steps=6):
    """A run with train.steps and train/loss at `steps` (a step listed twice is sent twice, as a
    resend with a new timestamp would be), ended with `status`."""
    run_id = client.create_run(experiment, run_name=name).info.run_id
    client.log_param(run_id, "train.steps", str(train_steps))
    for i, step in enumerate(steps):
        client.log_metric(run_id, "train/loss", 1.0 / step, step=step, timestamp=1_000 + i)
    client.set_terminated(run_id, status)
    return client.get_run(run_id)


def test_metrics_once_finds_a_lost_tail_a_gap_a_resend_and_a_finished_run_without_loss(tmp_path):
    from vitp.tracking.store import get_client

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = get_client(uri)
    experiment = client.create_experiment("soak")
    runs = [_run(client, experiment, "soak-pretrain-whole", "FINISHED", range(1, 7)),
            _run(client, experiment, "soak-pretrain-stopped", "KILLED", range(1, 4)),  # ended early: fine
            _run(client, experiment, "soak-pretrain-lost-tail", "FINISHED", range(1, 5)),
            _run(client, experiment, "soak-pretrain-gap", "KILLED", [1, 2, 4]),
            _run(client, experiment, "soak-pretrain-resent", "FINISHED", [1, 2, 2, 3, 4, 5, 6]),
            _run(client, experiment, "soak-pretrain-no-loss", "FINISHED", [])]
    result = soak_checks.metrics_once(uri, runs)
    assert sorted(result["violations"]) == sorted([
        "soak-pretrain-lost-tail train/loss: 2 step(s) missing: 5-6",
        "soak-pretrain-gap train/loss: 1 step(s) missing: 3",
        "soak-pretrain-resent train/loss: 1 step(s) logged twice",
        "soak-pretrain-no-loss: FINISHED after 6 steps without train/loss"]), result
    healthy = [r for r in runs if r.info.run_name in ("soak-pretrain-whole", "soak-pretrain-stopped")]
    assert soak_checks.metrics_once(uri, healthy)["violations"] == []


def test_resends_counts_what_the_senders_wrote_down_not_what_mlflow_kept(tmp_path, monkeypatch):
    """A real MetricSender (SQLite store) writes down each acknowledged point; the check finds a
    point acknowledged twice (planted: a second sender posts step 2 again with its original
    timestamp, which MLflow keeps once, so metrics_once passes it)."""
    from vitp.tracking.spool import SEND_LOG_ENV, MetricSender
    from vitp.tracking.store import get_client

    monkeypatch.setenv(SEND_LOG_ENV, str(tmp_path / "sends"))
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = get_client(uri)
    run = client.create_run(client.create_experiment("soak"), run_name="soak-pretrain-1")
    run_id = run.info.run_id
    sender = MetricSender(uri, run_id, None, spool_dir=tmp_path / "spool-a")
    for step in (1, 2, 3):
        sender.append(step, 1_000 + step, {"train/loss": 1.0 / step})
    assert sender.drain()
    sender.close(5.0)
    runs = [client.get_run(run_id)]
    clean = soak_checks.resends(tmp_path / "sends", runs)
    assert clean["violations"] == [] and clean["checked"] == "3 points acknowledged", clean

    again = MetricSender(uri, run_id, {"train/loss": 1}, spool_dir=tmp_path / "spool-b")  # a stale top
    again._checked.add("train/loss")  # the planted bug: it trusts that top and does not ask the server
    again.append(2, 1_002, {"train/loss": 0.5})
    assert again.drain()
    again.close(5.0)
    assert soak_checks.metrics_once(uri, [client.get_run(run_id)])["violations"] == []  # MLflow kept one
    assert soak_checks.resends(tmp_path / "sends", runs)["violations"] == [
        "soak-pretrain-1 train/loss step 2: acknowledged 2 times"]


def _checkpoint(root, ranks_with_optim=(0, 1), truncate=None):
    """A ZeRO-2 checkpoint of 2 ranks laid out as DeepSpeed and vitp write it (meta.json, the torch
    files under its tag, a completion marker per rank listing its files and their sizes). Files
    named in `truncate` are cut short before the markers record their sizes, as a writer that
    lost a race would leave them: vitp's own verify then sees nothing wrong."""
    import json

    import torch

    state = root / "state"
    state.mkdir(parents=True)
    files = {0: ["mp_rank_00_model_states.pt"]}
    torch.save({"module": {"w": torch.ones(64)}}, state / "mp_rank_00_model_states.pt")
    for r in ranks_with_optim:
        name = f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"
        torch.save({"optimizer_state_dict": {"exp_avg": torch.full((256,), float(r))}}, state / name)
        files.setdefault(r, []).append(name)
    for name in truncate or ():
        data = (state / name).read_bytes()
        (state / name).write_bytes(data[: len(data) // 2])
    (root / "meta.json").write_text(json.dumps({"world_size": 2, "tag": "state", "attempt": "a",
                                                "config": {"parallel": {"zero_stage": 2}}}))
    (root / "complete").mkdir()
    for r in (0, 1):
        listed = {f"state/{n}": (state / n).stat().st_size for n in files.get(r, [])}
        (root / "complete" / f"rank_{r:05d}.json").write_text(json.dumps({"files": listed, "attempt": "a"}))
    return str(root)


def test_a_picked_checkpoint_is_read_independently_of_the_verify_that_chose_it(tmp_path):
    from vitp.train import checkpoint as ckpt

    whole = _checkpoint(tmp_path / "whole")
    torn = _checkpoint(tmp_path / "torn", truncate=["zero_pp_rank_1_mp_rank_00_optim_states.pt"])
    short = _checkpoint(tmp_path / "short", ranks_with_optim=(0,))
    for where in (whole, torn, short):
        assert ckpt.verify(where) == (True, "complete")  # the markers agree with what is there
    assert soak_checks.independently_complete(whole) == (True, "ZeRO-2, 2 rank(s): complete")
    ok, why = soak_checks.independently_complete(torn)
    assert not ok and why.startswith("state/zero_pp_rank_1_mp_rank_00_optim_states.pt: "), why
    assert soak_checks.independently_complete(short) == (
        False, "ZeRO-2, 2 rank(s): missing optimizer states of rank(s) [1] of 2")

    # read when picked: a checkpoint deleted after its resume (retention) still counts
    log = tmp_path / "soak-pretrain-1.log"
    log.write_text(f"[12:00:01] resumed from {whole} at step 4\n[12:00:09] resumed from {torn} at step 6\n"
                   f"[12:00:10] resumed from {short} at st")  # a line still being written: next scan
    picks = soak_checks.Picks()
    picks.scan([log])
    assert [(p["step"], p["complete"]) for p in picks.found] == [(4, True), (6, False)]
    import shutil

    shutil.rmtree(torn)
    with open(log, "a") as f:
        f.write("ep 8\n")
    result = soak_checks.checkpoints(str(tmp_path / "work"), [], [log], {}, picks)
    assert [v.split(":")[0] for v in result["violations"]] == ["picked incomplete", "picked incomplete"]
    assert torn in result["violations"][0] and short in result["violations"][1], result
    assert result["checked"] == "3 resumes' checkpoints, 0 exported"


def test_epochs_are_checked_against_the_shards_keys_alone(tmp_path):
    """read_units reads the keys with pyarrow from the manifest's files; epochs_whole finds a
    sample twice and a key the shards lack (an epoch short of what was due: kept_complete)."""
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    shards = tmp_path / "shards"
    (shards / "train").mkdir(parents=True)
    files = []
    for i, keys in enumerate((["a", "b", "c"], ["d", "e"])):
        pq.write_table(pa.table({"key": keys, "label": [0] * len(keys)}), shards / "train" / f"part-{i}.parquet")
        files.append({"file": f"train/part-{i}.parquet", "rows": len(keys)})
    (shards / "manifest.json").write_text(json.dumps({"shards": {"train": files}}))
    import soak_dealing

    assert soak_dealing.read_units(str(shards), 2) == [["a", "b"], ["c"], ["d", "e"]]
    every = {k for unit in soak_dealing.read_units(str(shards), 2) for k in unit}

    # the run stopped in epoch 2, one rank still finishing epoch 0
    fine = {0: ["c", "a", "e", "b"], 1: ["b", "d", "a"], 2: ["e"]}
    assert soak_checks.epochs_whole("soak-pretrain-1", fine, every) == []
    planted = {0: ["c", "a", "e", "b"], 1: ["b", "d", "d", "zz"], 2: ["e"]}
    assert soak_checks.epochs_whole("soak-pretrain-1", planted, every) == [
        "soak-pretrain-1 epoch 1: 1 sample(s) twice",
        "soak-pretrain-1 epoch 1: 1 sample(s) not in the shards"]


def _by_position(units, seed, worlds, samples_seen, dealing):
    """({epoch: keys} still due at `samples_seen`, the newest epoch begun) as vitp.data.position
    works them out: the code the soak's own dealing (benchmarks/soak_dealing.py) is held against."""
    import numpy as np

    from vitp.data.augment import row_order
    from vitp.data.position import RankStream, current_segment

    sizes = np.array([len(u) for u in units], dtype=np.int64)
    seg = current_segment(sizes, seed, worlds, dealing)
    streams = [RankStream(sizes, seed, seg, r) for r in range(seg.world)]
    consumed = (samples_seen - seg.start) // seg.world
    upto = max(st.last_epoch(consumed) for st in streams)
    due = {e: set() for e in range(upto + 1)}
    for st in streams:
        for unit, epoch, skip in st.leftover(consumed, upto):
            due[epoch].update(np.asarray(units[unit])[row_order(units[unit], seed, epoch)][skip:].tolist())
    return due, upto


# worker-count histories [[world, samples_seen at its start], ...] and where each run stopped: a
# resize mid-unit and mid-epoch, down and up again, one at an epoch's end, more workers than units
# of an epoch's rest, and a run that never resized
HISTORIES = [([[2, 0], [3, 14], [1, 29]], 47), ([[3, 0], [2, 33]], 57), ([[1, 0], [4, 37]], 61),
             ([[2, 0], [5, 40]], 95), ([[2, 0]], 58), ([[4, 0], [2, 12], [4, 20]], 84)]


@pytest.mark.parametrize("dealing", [1, 2])
@pytest.mark.parametrize("worlds, seen", HISTORIES)
def test_the_soaks_own_dealing_order_agrees_with_the_data_position(worlds, seen, dealing):
    """soak_dealing.dealt (written from docs/data.md's dealing order) and vitp.data.position agree:
    what one says the workers took and what the other says is still due partition every epoch
    begun, for units of uneven sizes (a shard's short last unit) across resizes, in both orders a
    checkpoint may name."""
    import soak_dealing

    keys = [f"img-{i:03d}" for i in range(40)]
    units = [keys[a:min(a + 3, 20)] for a in range(0, 20, 3)] + [keys[a:a + 3] for a in range(20, 40, 3)]  # 2 shards
    every = set(keys)
    taken = soak_dealing.dealt(units, 5, worlds, seen, dealing)
    due, upto = _by_position(units, 5, worlds, seen, dealing)
    assert sum(len(v) for v in taken.values()) == seen
    assert max(taken) == upto, (sorted(taken), upto)
    for epoch in range(upto + 1):
        got = taken.get(epoch, [])
        assert len(got) == len(set(got)), epoch
        assert not set(got) & due[epoch] and set(got) | due[epoch] == every, (epoch, worlds, seen)


def test_a_run_is_held_to_what_the_dealing_order_gave_it(tmp_path):
    """kept_complete finds a sample skipped, one trained before it was dealt and a count that is not
    the checkpoint's, from the shards' units (read with pyarrow), the seed and the worker history."""
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    import soak_dealing
    from vitp.train.samples import Kept

    shards = tmp_path / "shards"
    (shards / "train").mkdir(parents=True)
    files = []
    for i, n in enumerate((11, 9)):
        keys = [f"s{i}-{j}" for j in range(n)]
        pq.write_table(pa.table({"key": keys}), shards / "train" / f"part-{i}.parquet")
        files.append({"file": f"train/part-{i}.parquet", "rows": n})
    (shards / "manifest.json").write_text(json.dumps({"shards": {"train": files}}))
    units = soak_dealing.read_units(str(shards), 4)
    assert [len(u) for u in units] == [4, 4, 3, 4, 4, 1]
    worlds, seen = [[2, 0], [3, 18]], 36  # epoch 1 begun on two workers, finished on three
    meta = {"world_size": 3, "config": {"train": {"seed": 3}},
            "train_state": {"samples_seen": seen, "worlds": worlds, "dealing": 2}}
    rows = [(k, e) for e, keys in soak_dealing.dealt(units, 3, worlds, seen, 2).items() for k in keys]
    whole = Kept("ckpt", meta, {(0, 1): rows})
    assert soak_checks.kept_complete("soak-pretrain-1", whole, units) == (seen, [])

    in_epoch_1 = [k for k, e in rows if e == 1]
    not_yet = sorted({f"s{i}-{j}" for i, n in enumerate((11, 9)) for j in range(n)} - set(in_epoch_1))[0]
    planted = [r for r in rows if r != (in_epoch_1[0], 1)] + [(not_yet, 1), ("s0-0", 0)]
    count, bad = soak_checks.kept_complete("soak-pretrain-1", Kept("ckpt", meta, {(0, 1): planted}), units)
    assert count == seen + 1
    assert bad == ["soak-pretrain-1: 37 samples recorded, its checkpoint counts 36",
                   "soak-pretrain-1 epoch 1: 1 sample(s) trained that the dealing order had not given its "
                   "workers by then",
                   "soak-pretrain-1 epoch 1: 1 sample(s) dealt and never trained"], bad


def test_a_resume_the_logs_do_not_show_is_a_violation_not_a_pass(tmp_path):
    """The pick check reads what the logs say each resume picked; a run whose samples record shows a
    resume (an attempt that began at step 4) while its log shows no pick at step 4 is a violation,
    not a check with nothing to check."""
    import json
    from types import SimpleNamespace

    from vitp.paths import RunPaths

    work = tmp_path / "work"
    run_dir = Path(RunPaths(str(work)).run("soak-pretrain-1"))
    ckpt_dir = run_dir / "checkpoint_00000008"
    _checkpoint(ckpt_dir)
    meta = json.loads((ckpt_dir / "meta.json").read_text())
    (ckpt_dir / "meta.json").write_text(json.dumps({**meta, "step": 8}))
    (run_dir / "samples" / "attempts").mkdir(parents=True)
    for attempt, first, parent in (("a", 4, "b"), ("b", 0, None)):
        (run_dir / "samples" / "attempts" / f"{attempt}.json").write_text(
            json.dumps({"first": first, "parent": parent, "world": 2}))
    run = SimpleNamespace(info=SimpleNamespace(run_name="soak-pretrain-1", status="RUNNING"))
    log = tmp_path / "pretrain-1.log"
    log.write_text("[12:00:00] step 1\n")
    result = soak_checks.checkpoints(str(work), [run], [log], {}, soak_checks.Picks())
    assert result["violations"] == ["soak-pretrain-1 resumed at step(s) [4] (its samples record) and its log "
                                    "shows no 'resumed from' line for them: the picks there were not checked"]
    log.write_text(f"[12:00:01] resumed from {ckpt_dir} at step 4\n")
    assert soak_checks.checkpoints(str(work), [run], [log], {}, soak_checks.Picks())["violations"] == []
