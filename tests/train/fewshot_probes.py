"""What a pre-training run with few-shot probes (train.fewshot_every) must have logged, checked
on a finished run: by tests/train/test_fewshot_during_training.py (ZeRO-3) and by the MLflow
outage run (ZeRO-2, tests/train/test_mlflow_outage.py)."""
import numpy as np
import pytest

SHOTS = (1, 5, 10, 25)


def probe_settings(every: int, tmp_path, digits: str = "digits") -> list[str]:
    """Overrides for probes every `every` steps on `digits` (a name under work_dir/shards or a
    path) and on a dataset that cannot be read (a warning in the worker log, not a crash)."""
    return [f"train.fewshot_every={every}", f"train.fewshot_datasets={digits},{tmp_path / 'no-such-shards'}"]


def _history(client, run_id, key):
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def check_probes(cfg, summary, digits, weights_of: str = "model") -> None:
    """fewshot/digits_<k>shot_top1 at every multiple of train.fewshot_every and nothing for the
    unreadable dataset; the last probe is `vitp fewshot`'s evaluation of the final checkpoint (of its
    weight EMA with weights_of="ema") and not what the same model untrained scores."""
    import torch

    from vitp.tracking.store import get_client
    from vitp.config import Run
    from vitp.train.export import export, load_model
    from vitp.eval.features import FeatureExtractor, read_split
    from vitp.eval.solver import fewshot_accuracy

    client = get_client(Run.of(cfg).tracking_uri)
    run = client.get_run(summary.mlflow_run_id)
    assert run.info.status == "FINISHED"  # the unreadable dataset was a warning (worker log)
    keys = {k for k in run.data.metrics if k.startswith("fewshot/")}
    assert keys == {f"fewshot/digits_{k}shot_top1" for k in SHOTS}, keys  # nothing for the missing set
    every, steps = cfg.train.fewshot_every, cfg.train.steps
    final = {}
    for k in SHOTS:
        hist = _history(client, summary.mlflow_run_id, f"fewshot/digits_{k}shot_top1")
        assert [s for s, _ in hist] == list(range(every, steps + 1, every)), hist
        assert all(0.0 <= v <= 1.0 for _, v in hist), hist
        final[k] = hist[-1][1]

    # The last snapshot is the final checkpoint's model: its features (the FeatureExtractor
    # `vitp fewshot`'s actors run, here in this process on the same rows; that the actor pool gives
    # the same features is tests/eval/test_fewshot.py's) and the solver give the same accuracies
    # (a float32 feature may move in its last bits between batchings, which can flip one test
    # prediction, rarely).
    if weights_of == "ema":
        import tempfile

        model = load_model(export(summary.checkpoint, tempfile.mkdtemp(prefix="ema-export-"), "ema"))
    else:
        model = load_model(summary.checkpoint)
    train, val = (read_split(Run.of(digits), split, model.image_size) for split in ("train", "val"))
    extract = FeatureExtractor(model, digits.data.mean, digits.data.std, threads=torch.get_num_threads())

    def features(rows):  # (the model's current weights: init_weights below changes them in place)
        return np.concatenate([extract({"image": rows["image"][i:i + 256]})["features"]
                               for i in range(0, len(rows["image"]), 256)])

    tx, vx = features(train), features(val)
    ref = fewshot_accuracy(tx, train["label"], vx, val["label"])
    for k in SHOTS:
        assert final[k] == pytest.approx(ref[k], abs=1.01 / len(val["label"])), (k, final, ref)
    # and not what an untrained model of the same shape scores (the snapshot is not the init)
    model.init_weights()
    ix, jx = features(train), features(val)
    assert not np.allclose(ix, tx) and fewshot_accuracy(ix, train["label"], jx, val["label"]) != ref
