"""Non-finite losses on Ray Train (2 CPU workers, DeepSpeed ZeRO-2, MLflow on SQLite): a NaN that
persists rolls back once, then stops the run. (A NaN at one step, skipped and logged, is checked
in the run of tests/train/test_mlflow_outage.py; on every ZeRO stage in-process in
tests/train/test_nonfinite.py.)"""
import pytest

from vitp.recipes import resolve

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.e2e]


def _cfg(tmp_path, shards, *extra):
    return resolve("debug", [f"work_dir={tmp_path}", f"data.shards={shards}", "train.steps=16",
                             "train.log_every=1", "train.eval_every=0", "train.checkpoint_every=4",
                             "train.max_failures=0", *extra])


def _history(cfg, run_id, key):
    from vitp.tracking.store import get_client
    from vitp.config import Run

    return sorted((m.step, m.value) for m in get_client(Run.of(cfg).tracking_uri).get_metric_history(run_id, key))


@pytest.mark.long(reason="a long fault drill; CI kills the rehearsal's worker mid-run and resumes from the "
                         "bucket")
def test_persistent_nan_rolls_back_once_then_stops(tmp_path, shards, capfd):
    from vitp.tracking.store import get_client
    from vitp.config import Run
    from vitp.train.trainer import run_training

    cfg = _cfg(tmp_path, shards, "train.nan_drill=6-16", "train.nonfinite_patience=3",
               "tracking.run_name=nan-forever")
    with pytest.raises(Exception) as failed:
        run_training(Run.of(cfg), with_val=False)
    text = str(failed.value) + capfd.readouterr().out
    assert "again after rolling back to the checkpoint of step 4" in text and "Likely causes" in text, text[-4000:]
    client = get_client(Run.of(cfg).tracking_uri)
    run = client.search_runs([e.experiment_id for e in client.search_experiments()],
                             "attributes.run_name = 'nan-forever'")[0]
    assert run.info.status == "FAILED"
    assert [v for _, v in _history(cfg, run.info.run_id, "train/rollbacks")][-1] == 1
