"""Pre-training on Ray Train: real shards, 2 CPU workers, gloo, DeepSpeed, MLflow (SQLite).

The debug recipe on the synthetic fractal corpus: the run contract (metrics, analysis, export, a
re-run) on the reference run of a worker kill, a crash, and a driver restart on object storage
continued with more steps (a worker kill on two nodes: tests/cluster/test_rehearsal.py).
"""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from vitp.config import Run
from vitp.recipes import resolve

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def _cfg(tmp_path, shards, *extra):
    return resolve("debug", [f"work_dir={tmp_path}", f"data.shards={shards}",
                             "train.log_every=5", *extra])


def _history(cfg, run_id, key):
    from vitp.tracking.store import get_client
    from vitp.config import Run

    client = get_client(Run.of(cfg).tracking_uri)
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def _check_run_contract(cfg, summary, tmp_path):
    """The Ray contract of a finished run with validation: every logged step's metrics in MLflow,
    a falling loss, the analysis artifact, a consolidated export that loads into plain
    vitp.model, and a re-run that trains nothing. Checked on the reference run of the
    worker-kill test (ZeRO-3 in `make test`: the consolidated export); that each stage learns the
    same curve as ZeRO-0 is checked in-process (tests/train/test_engine.py)."""
    import torch

    from vitp.train.export import export, load_model

    steps, every = cfg.train.steps, cfg.train.log_every
    assert summary.metrics["step"] == steps
    loss = _history(cfg, summary.mlflow_run_id, "train/loss")
    assert [s for s, _ in loss] == list(range(every, steps + 1, every))
    first, last = loss[0][1], loss[-1][1]
    assert last < first - 0.1, f"ZeRO-{cfg.parallel.zero_stage}: loss {first:.3f} -> {last:.3f} did not fall"
    for key in ("train/lr", "train/grad_norm", "perf/images_per_sec", "perf/mfu", "perf/mem_gb", "perf/mem_model_gb"):
        assert len(_history(cfg, summary.mlflow_run_id, key)) == len(loss), key
    assert summary.metrics["val/count"] > 0
    _analysis_was_logged(cfg, summary, tmp_path)
    exported = export(summary.checkpoint, str(tmp_path / "export"))
    model = load_model(exported)
    out = model(torch.zeros(2, 3, 32, 32))
    from vitp import storage
    from vitp.config import Run
    from vitp.model.weights import source_info

    index = storage.read_json(storage.join(Run.of(cfg).shards, "classes.json"))  # what preprocessing named
    assert source_info(exported).classes == sorted(index, key=index.get)  # recorded for predict and HF
    assert out.shape == (2, 10) and torch.isfinite(out).all() and out.abs().sum() > 0
    # the same run started again: its final checkpoint is reported, nothing trains
    _rerun_of_finished_run_trains_nothing(cfg, summary, len(loss))


def _analysis_was_logged(cfg, summary, tmp_path):
    """After the run, its own step (report.log_report, as `vitp pretrain` runs it): the Figure 7
    report of the final checkpoint is in the run's artifacts (`analysis/`), its position-embedding
    correlation a metric at the last step, both from the same weights; the run stays FINISHED."""
    from vitp.model.analysis import write_report
    from vitp.tracking.store import get_client
    from vitp.config import Run
    from vitp.train.export import load_model
    from vitp.train.report import log_report

    client = get_client(Run.of(cfg).tracking_uri)
    assert not client.list_artifacts(summary.mlflow_run_id, "analysis")  # not the training's work
    ended = client.get_run(summary.mlflow_run_id).info
    log_report(Run.of(cfg), summary)
    after = client.get_run(summary.mlflow_run_id).info
    assert (after.status, after.end_time) == ("FINISHED", ended.end_time)
    names = sorted(a.path for a in client.list_artifacts(summary.mlflow_run_id, "analysis"))
    assert names == ["analysis/analysis.json", "analysis/attention_distance.png",
                     "analysis/patch_embed_pcs.png", "analysis/pos_embed_similarity.png"], names
    with open(client.download_artifacts(summary.mlflow_run_id, "analysis/analysis.json", str(tmp_path))) as f:
        logged = json.load(f)
    corr = _history(cfg, summary.mlflow_run_id, "analysis/pos_embed_distance_corr")
    assert [s for s, _ in corr] == [summary.metrics["step"]]
    assert corr[0][1] == pytest.approx(logged["pos_embed"]["distance_corr"])
    assert logged["attention_distance"]["images"] == 4
    model = load_model(summary.checkpoint)  # the report is of the final weights
    mine = write_report(model, str(tmp_path / "analysis"))
    assert mine["pos_embed"] == pytest.approx(logged["pos_embed"])


def _rerun_of_finished_run_trains_nothing(cfg, summary, logged_steps):
    from vitp.tracking.store import get_client
    from vitp.config import Run
    from vitp.train.trainer import run_training

    client = get_client(Run.of(cfg).tracking_uri)
    before = client.get_run(summary.mlflow_run_id)
    for status in ("FINISHED", "KILLED"):  # KILLED: the driver died before ending the run
        if status == "KILLED":
            client.set_terminated(summary.mlflow_run_id, status="KILLED")
        again = run_training(Run.of(cfg))
        assert again.already_finished and again.mlflow_run_id == summary.mlflow_run_id
        assert os.path.realpath(again.checkpoint) == os.path.realpath(summary.checkpoint)
        for key in ("step", "val/top1", "val/loss", "train/loss"):
            assert again.metrics[key] == pytest.approx(summary.metrics[key]), key
        after = client.get_run(summary.mlflow_run_id)
        assert after.info.status == "FINISHED"
        assert len(_history(cfg, summary.mlflow_run_id, "train/loss")) == logged_steps  # none trained again
        if status == "FINISHED":  # left untouched
            assert after.info.end_time == before.info.end_time
            assert after.data.tags["vitp.attempt"] == before.data.tags["vitp.attempt"]


def _worker_pids():
    """Train worker processes of this test session's Ray (descendants of this process)."""
    import psutil

    out = []
    for proc in psutil.Process(os.getpid()).children(recursive=True):
        try:
            if "RayTrainWorker" in " ".join(proc.cmdline()):
                out.append(proc.pid)
        except psutil.Error:
            continue
    return out


def _wait_for_checkpoint(cfg, timeout=240, alive=lambda: True, after=0):
    """The first complete mid-run checkpoint (step < train.steps) in storage past step `after`.

    Any one will do: with keep_checkpoints=2 retention deletes the oldest as soon as a third is
    committed, so waiting for one particular step could miss it on a busy host.
    """
    from vitp import storage
    from vitp.config import Run
    from vitp.train import checkpoint as ckpt

    run_dir = Run.of(cfg).dir  # a local path or a URI
    t0 = time.time()
    while time.time() - t0 < timeout and alive():
        names = storage.listdir(run_dir)
        for name in names:
            path = storage.join(run_dir, name)
            if ckpt.CHECKPOINT_NAME.match(name) and int(name.split("_")[1]) > after and ckpt.verify(path)[0]:
                if ckpt.read_meta(path)["step"] >= cfg.train.steps:
                    raise AssertionError(f"the run finished before a mid-run checkpoint was seen: {names}")
                return path
        time.sleep(0.2)
    raise AssertionError(f"no complete checkpoint under {run_dir} after {time.time() - t0:.0f}s")


def _kill_a_worker_mid_upload(cfg, timeout=240, alive=lambda: True) -> tuple[str, str]:
    """Once a checkpoint is complete and a newer one is in the bucket but not yet (every rank's
    files, then its marker): SIGKILL a Train worker. (complete, partial) paths."""
    from vitp import storage
    from vitp.config import Run
    from vitp.train import checkpoint as ckpt

    run_dir = Run.of(cfg).dir
    t0 = time.time()
    while time.time() - t0 < timeout and alive():
        names = [n for n in storage.listdir(run_dir) if ckpt.CHECKPOINT_NAME.match(n)]
        done = [n for n in names if ckpt.verify(storage.join(run_dir, n))[0]]
        partial = [n for n in names if done and n > done[-1] and n not in done]
        if partial and (pids := _worker_pids()):
            os.kill(pids[-1], signal.SIGKILL)
            return storage.join(run_dir, done[-1]), storage.join(run_dir, partial[0])
        time.sleep(0.1)
    raise AssertionError(f"no upload in flight seen under {run_dir} after {time.time() - t0:.0f}s")


def _resumed_from(log: str) -> list[tuple[str, int]]:
    import re

    return [(m[0], int(m[1])) for m in re.findall(r"resumed from (\S+) at step (\d+)", log)]


def _wait_workers_gone(timeout=120):
    """Train workers of a killed driver die asynchronously: wait until none is left."""
    t0 = time.time()
    while _worker_pids() and time.time() - t0 < timeout:
        time.sleep(0.5)
    assert not _worker_pids(), "Train workers of the killed driver are still alive"


def _vitp_pretrain(cfg_args, env, log_path=None):
    """`vitp pretrain debug`; output to `log_path` (a file nobody has to drain) or a pipe."""
    out = open(log_path, "w") if log_path else subprocess.PIPE
    try:
        return subprocess.Popen([sys.executable, "-m", "vitp.cli", "pretrain", "debug", *cfg_args],
                                env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
    finally:
        if log_path:
            out.close()


@pytest.mark.long(reason="a long fault drill; CI kills the rehearsal's worker mid-run and resumes from the "
                         "bucket")
@pytest.mark.e2e
def test_driver_restart_resumes_on_object_storage_and_continues(tmp_path, shards, ray_session, s3):
    """work_dir on the S3 server, uploads slowed by its proxy. A Train worker SIGKILLed while a
    checkpoint uploads: the restarted workers resume from the previous complete one, never the
    partial. The `vitp pretrain` driver SIGKILLed after a later checkpoint: started again, it
    resumes into the same MLflow run, downloading the checkpoint once for its two ranks (bytes
    through the proxy); no step's metric lost or repeated; checkpoints land in the bucket (URIs),
    each with its timings; the finished run started again trains nothing; raising train.steps
    continues the same MLflow run with the schedule re-planned (the first value of train.steps
    kept, the new one recorded per continuation)."""
    import ray

    from vitp import storage
    from vitp.tracking.store import get_client
    from vitp.train import checkpoint as ckpt
    from vitp.train.trainer import run_training

    work, db = storage.join(s3.bucket(), "vit"), f"sqlite:///{tmp_path}/mlflow.db"
    base = [f"work_dir={work}", f"data.shards={shards}", "train.log_every=5", "train.checkpoint_every=20",
            f"tracking.uri={db}"]
    args = [f"--set={kv}" for kv in base + ["train.steps=100"]]
    cfg = resolve("debug", base + ["train.steps=100"])
    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address, "PYTHONUNBUFFERED": "1"}

    s3.proxy.up_rate = 100_000  # bytes/s per connection: each upload takes seconds, training goes on
    first = _vitp_pretrain(args, env, log_path=tmp_path / "first.log")
    try:
        complete, partial = _kill_a_worker_mid_upload(cfg, alive=lambda: first.poll() is None)
        complete_step = int(complete.rsplit("_", 1)[1])
        s3.proxy.up_rate = 0
        _wait_for_checkpoint(cfg, alive=lambda: first.poll() is None, after=complete_step)
    except AssertionError as e:
        raise AssertionError(f"{e}\n{(tmp_path / 'first.log').read_text()[-3000:]}") from None
    finally:
        s3.proxy.up_rate = 0
    first.send_signal(signal.SIGKILL)  # the driver dies; its Train controller goes with it
    first.wait()
    _wait_workers_gone()  # else the old rank 0 could still log a step beside the new one
    # the restarted workers went on from the last complete checkpoint, not the one mid-upload
    assert _resumed_from((tmp_path / "first.log").read_text())[0] == (complete, complete_step), partial

    down, second_log = s3.proxy.down, tmp_path / "second.log"
    second = _vitp_pretrain(args, env, log_path=second_log)
    t0 = time.time()  # the bytes read from the bucket until the workers resumed (the run's end reads
    while "resumed from" not in second_log.read_text() and second.poll() is None and time.time() - t0 < 600:
        time.sleep(0.2)  # the final checkpoint again, for its analysis)
    down = s3.proxy.down - down
    second.wait(timeout=600)
    log = second_log.read_text()
    assert second.returncode == 0, log[-3000:]
    (where, step), = _resumed_from(log)  # the newest complete one, which the first driver waited for
    assert step > complete_step and where.endswith(f"checkpoint_{step:08d}"), (where, step)

    client = get_client(db)
    exp = client.get_experiment_by_name(cfg.tracking.experiment)
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"  # same MLflow run continued
    run_id = runs[0].info.run_id
    assert [s for s, _ in _history(cfg, run_id, "train/loss")] == list(range(5, 101, 5))
    # the workers restarted after the kill mid-upload, then the second driver
    assert [s for s, _ in _history(cfg, run_id, "train/resumed_from")] == [complete_step, step]
    checkpoint = storage.join(work, "runs", cfg.run_name, "checkpoint_00000100")
    assert f"checkpoint: {checkpoint}" in log  # in the bucket
    assert ckpt.verify(checkpoint)[0] and ckpt.read_meta(checkpoint)["mlflow_run_id"] == run_id
    for key in ("perf/ckpt_blocked_s", "perf/ckpt_mb", "perf/ckpt_upload_s", "perf/ckpt_commit_s"):
        assert [s for s, _ in _history(cfg, run_id, key)] == [20, 40, 60, 80, 100], key
    assert [s for s, _ in _history(cfg, run_id, "perf/restore_s")] == [complete_step, step]
    waits = _history(cfg, run_id, "perf/data_wait_frac")
    assert len(waits) == 20 and all(0 <= w <= 1 for _, w in waits)
    assert _history(cfg, run_id, "perf/ckpt_mb")[0][1] > 0.1  # the model's state, in MB
    size = dict(_history(cfg, run_id, "perf/ckpt_mb"))[step] * 1e6  # the resumed one's files, all ranks
    assert size <= down < 1.5 * size, (size, down)  # one download for the node's two ranks

    again = run_training(Run.of(cfg))
    assert again.already_finished and again.mlflow_run_id == run_id

    more = run_training(Run.of(resolve("debug", base + ["train.steps=110"])))
    assert not more.already_finished and more.mlflow_run_id == run_id
    assert more.checkpoint == storage.join(work, "runs", cfg.run_name, "checkpoint_00000110")
    assert [s for s, _ in _history(cfg, run_id, "train/loss")] == list(range(5, 111, 5))
    assert [s for s, _ in _history(cfg, run_id, "train/resumed_from")] == [complete_step, step, 100]
    lr = dict(_history(cfg, run_id, "train/lr"))
    assert lr[105] > lr[100]  # re-planned to end at 110: the decay starts over from where 110 puts it
    run = client.get_run(run_id)
    assert run.data.params["train.steps"] == "100"
    assert run.data.params["train.steps.continued_at_100"] == "110"
    assert run.info.status == "FINISHED"
    # (a new run name beside a finished run starts fresh: test_worker_kill_resumes_on_exactly_the_same_samples)


@pytest.mark.long(reason="a long fault drill; CI kills the rehearsal's worker mid-run and resumes from the "
                         "bucket")
def test_crash_ends_mlflow_run_failed(tmp_path, shards):
    """A worker error (labels beyond the head: 10-class shards, 5-class model) fails the run."""
    from vitp.tracking.store import get_client
    from vitp.config import Run
    from vitp.train.trainer import run_training

    cfg = _cfg(tmp_path, shards, "model.num_classes=5", "train.max_failures=0", "train.steps=10")
    with pytest.raises(Exception) as e:
        run_training(Run.of(cfg))
    assert "out of bounds" in str(e.value) or "TrainingFailed" in type(e.value).__name__
    client = get_client(Run.of(cfg).tracking_uri)
    exp = client.get_experiment_by_name(cfg.tracking.experiment)
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.status == "FAILED"


class _FailureLog:
    """A Ray Train callback writing one line per worker-group failure its controller saw
    (rank:exception type ...): how many attempts a run made, seen from Train itself."""

    def __new__(cls, path):
        import ray.train

        class FailureLog(ray.train.UserCallback):
            def after_exception(self, run_context, worker_exceptions):
                with open(path, "a") as f:
                    f.write(" ".join(f"{r}:{type(e).__name__}" for r, e in sorted(worker_exceptions.items())) + "\n")

        return FailureLog()


def test_a_checkpoint_uploads_while_training_goes_on(tmp_path, shards, s3):
    """work_dir on the S3 server, the first checkpoint's uploads slowed by its proxy: the loop is
    blocked only for the snapshot to the node's disk; the next steps train (and are logged) while
    the checkpoint uploads, and its marker, written last, says when it was committed. Its timings
    are logged at its step (perf/ckpt_*). CI's form of the driver-restart drill's slow uploads."""
    from vitp import storage
    from vitp.tracking.store import get_client
    from vitp.train import checkpoint as ckpt
    from vitp.train.trainer import run_training

    work = storage.join(s3.bucket(), "vit")
    cfg = resolve("debug", [f"work_dir={work}", f"data.shards={shards}", f"tracking.uri=sqlite:///{tmp_path}/m.db",
                            "parallel.num_workers=1", "train.steps=20", "train.log_every=5", "train.eval_every=0",
                            "train.checkpoint_every=10", "train.keep_checkpoints=2"])
    # bytes/s a connection: the 1 MB optimizer state takes 10 s, most of it after the file has left
    # the client for the socket's buffer (no progress it can see: storage.S3_STALL_S)
    s3.proxy.slow("checkpoint_00000010", 100_000)
    try:
        summary = run_training(Run.of(cfg))
    finally:
        s3.proxy.slow("", 0)
    first = storage.join(work, "runs", cfg.run_name, "checkpoint_00000010")
    assert ckpt.verify(first) == (True, "complete") and ckpt.verify(summary.checkpoint) == (True, "complete")
    committed = storage.read_json(storage.join(first, "complete", "rank_00000.json"))["committed"]
    client = get_client(Run.of(cfg).tracking_uri)
    losses = {m.step: m.timestamp / 1000 for m in client.get_metric_history(summary.mlflow_run_id, "train/loss")}
    assert sorted(losses) == [5, 10, 15, 20]
    assert losses[15] < committed, (losses, committed)  # step 15 trained before checkpoint 10 was in the bucket
    timings = {key: dict(_history(cfg, summary.mlflow_run_id, key)) for key in
               ("perf/ckpt_blocked_s", "perf/ckpt_upload_s", "perf/ckpt_commit_s", "perf/ckpt_mb")}
    assert all(sorted(t) == [10, 20] for t in timings.values()), timings
    assert timings["perf/ckpt_blocked_s"][10] < timings["perf/ckpt_upload_s"][10], timings


@pytest.mark.long_cases("2", reason="two workers; CI runs the same with one")
@pytest.mark.parametrize("workers", [1, 2])
def test_a_users_mistake_in_a_worker_is_not_retried(tmp_path, shards, workers):
    """A worker's InputError (init_from names a damaged weights file, which only a worker reads)
    ends the run on its first attempt, max_failures notwithstanding, and the driver raises that
    InputError itself (one line from vitp); the MLflow run ends FAILED."""
    from vitp.errors import InputError
    from vitp.tracking.store import get_client
    from vitp.config import Run
    from vitp.train.trainer import run_training

    damaged = tmp_path / "downloaded.safetensors"
    damaged.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{\"a\":1}truncated")
    log = tmp_path / "failures.log"
    cfg = _cfg(tmp_path, shards, f"train.init_from={damaged}", "train.max_failures=2", "train.steps=10",
               f"parallel.num_workers={workers}")
    with pytest.raises(InputError, match="not a readable weights file") as e:
        run_training(Run.of(cfg), callbacks=[_FailureLog(str(log))])
    assert str(damaged) in str(e.value)
    (attempt,) = log.read_text().splitlines()  # one attempt; the ranks whose error Train had seen
    assert attempt and all(failure.endswith(":InputError") for failure in attempt.split()), attempt
    client = get_client(Run.of(cfg).tracking_uri)
    (run,) = client.search_runs([client.get_experiment_by_name(cfg.tracking.experiment).experiment_id])
    assert run.info.status == "FAILED"


def _samples(cfg) -> tuple[dict[tuple[int, int], list[str]], set[int]]:
    """({(rank, step): keys trained on}, steps the attempts it kept started from) from
    train.record_samples' files, followed back from the newest checkpoint's attempt."""
    from vitp.config import Run
    from vitp.train.samples import kept_samples

    kept = kept_samples(Run.of(cfg).dir)
    assert not kept.problems, kept.problems
    return ({k: [key for key, _ in v] for k, v in kept.steps.items()},
            {a["first"] for a in kept.attempts})


# Once, at ZeRO-3 (partitioned optimizer state, the consolidated export on Ray): that the engine
# resumes exactly at every stage, and with one worker accumulating two micro-batches, is
# test_engine.py's test_checkpoint_resume_continues_exactly, in-process.
@pytest.mark.long(reason="a long fault drill; CI kills the rehearsal's worker mid-run and resumes from the "
                         "bucket")
@pytest.mark.parametrize("workers,stage", [(2, 3)])
def test_worker_kill_resumes_on_exactly_the_same_samples(tmp_path, shards, workers, stage):
    """A Train worker SIGKILLed after a checkpoint: the restarted workers resume at the data
    position and train every step on the same samples as an uninterrupted run (each rank its
    own stream). The uninterrupted run, validated at its
    end, also carries the run contract (_check_run_contract); the killed run, a new name beside
    it, starts fresh."""
    import threading

    from vitp.train.trainer import run_training

    common = ["train.steps=16", "train.checkpoint_every=4", "train.eval_every=0",
              "train.record_samples=true", f"parallel.num_workers={workers}",
              f"parallel.grad_accum={3 - workers}", "train.max_failures=2",
              f"parallel.zero_stage={stage}", "train.log_every=1", "optim.lr=2e-3"]
    ref_cfg = _cfg(tmp_path, shards, *common, "tracking.run_name=ref")
    ref = run_training(Run.of(ref_cfg))
    _check_run_contract(ref_cfg, ref, tmp_path)
    reference, starts = _samples(ref_cfg)
    assert sorted({s for _, s in reference}) == list(range(1, 17)) and starts == {0}
    assert all(len(k) == 32 // workers for k in reference.values())

    cfg = _cfg(tmp_path, shards, *common, "tracking.run_name=killed")
    out = []
    runner = threading.Thread(target=lambda: out.append(run_training(Run.of(cfg), with_val=False)))
    runner.start()
    try:
        _wait_for_checkpoint(cfg, alive=runner.is_alive)
        os.kill(_worker_pids()[-1], signal.SIGKILL)
    finally:
        runner.join(timeout=600)
    assert out and out[0].metrics["step"] == 16
    got, starts = _samples(cfg)
    assert max(starts) >= 4, f"no attempt resumed from a checkpoint: {starts}"
    # a new run name beside the finished reference starts fresh: its own MLflow run, from step 0,
    # resumed only from its own checkpoint
    assert out[0].mlflow_run_id != ref.mlflow_run_id and not out[0].already_finished
    assert min(starts) == 0
    resumed = [v for _, v in _history(cfg, out[0].mlflow_run_id, "train/resumed_from")]
    assert resumed and all(4 <= v < 16 for v in resumed), resumed
    assert got == reference  # the same keys, in the same order, at every step of every rank
    assert sum(len(k) for k in got.values()) == 16 * 32
    # ... and the same losses: model, optimizer, RNG and data all resumed exactly
    losses = _history(cfg, out[0].mlflow_run_id, "train/loss")
    ref_losses = _history(ref_cfg, ref.mlflow_run_id, "train/loss")
    assert [s for s, _ in losses] == [s for s, _ in ref_losses] == list(range(1, 17))
    assert [v for _, v in losses] == pytest.approx([v for _, v in ref_losses], abs=1e-6)
