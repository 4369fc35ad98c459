"""Few-shot probes during pre-training (train.fewshot_every): a real Ray Train + DeepSpeed run on
2 CPU workers logs fewshot/<dataset>_<k>shot_top1 to its MLflow run at every multiple of
fewshot_every; the last probe equals `vitp fewshot`'s evaluation of the final checkpoint (ZeRO-3:
the gathered snapshot is the real model); a dataset that cannot be read is a warning, not a crash.
"""
import numpy as np
import pytest

from vitp.errors import ConfigError
from vitp.recipes import resolve

SHOTS = (1, 5, 10, 25)


def test_fewshot_every_is_validated():
    with pytest.raises(ConfigError, match=r"train.fewshot_every=-1: must be >= 0"):
        resolve("debug", ["train.fewshot_every=-1"])
    with pytest.raises(ConfigError, match=r"train.fewshot_datasets is empty: .*--set train.fewshot_datasets=digits"):
        resolve("debug", ["train.fewshot_every=10", "train.fewshot_datasets=[]"])
    cfg = resolve("debug", ["train.fewshot_every=10", "train.fewshot_datasets=digits,/data/shards/pets/"])
    assert cfg.train.fewshot_datasets == ("digits", "/data/shards/pets/")
    assert resolve("debug").train.fewshot_every == 0  # off unless asked for


def test_dataset_names_and_paths():
    from vitp.train.fewshot_probe import dataset_roots

    cfg = resolve("debug", ["work_dir=/w", "train.fewshot_datasets=digits, s3://b/shards/cifar10/,/x/pets"])
    assert dataset_roots(cfg) == {"digits": "/w/shards/digits", "cifar10": "s3://b/shards/cifar10/",
                                  "pets": "/x/pets"}


@pytest.fixture(scope="module")
def corpora(debug_shards, digits_shards, tmp_path_factory):
    """A work_dir whose shards/digits are the digits shards (where `vitp preprocess debug_finetune`
    puts them), the debug pre-training corpus, and the digits config."""
    root = tmp_path_factory.mktemp("fewshot_train")
    (root / "shards").mkdir()
    (root / "shards" / "digits").symlink_to(digits_shards)
    digits = resolve("debug_finetune", [f"work_dir={root}"])
    return str(root), debug_shards, digits


def _history(cfg, run_id, key):
    from vitp.tracking.store import get_client, resolve_tracking_uri

    client = get_client(resolve_tracking_uri(cfg))
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


@pytest.mark.ray
@pytest.mark.slow
# ZeRO-3 keeps parameters under 1e5 elements whole on every rank (memory.PERSISTENCE_THRESHOLD):
# pico/8 has none that large, nano/16's MLP and qkv weights are partitioned (Ti's width, 2 blocks),
# so its snapshot is gathered. ZeRO-3 (the gathered snapshot) in `make test`; ZeRO-2 in the e2e run
@pytest.mark.parametrize("stage,variant", [pytest.param(2, "pico/8", marks=pytest.mark.e2e), (3, "nano/16")])
def test_pretraining_logs_fewshot_at_every_multiple(tmp_path, corpora, stage, variant):
    from vitp.tracking.store import get_client, resolve_tracking_uri
    from vitp.train.export import load_model
    from vitp.train.fewshot_lsr import FeatureExtractor, fewshot_accuracy, read_split
    from vitp.train.trainer import run_training

    work, fractals, digits = corpora
    missing = str(tmp_path / "no-such-shards")
    # work_dir holds shards/digits, so the bare name resolves; the second entry cannot be read
    cfg = resolve("debug", [f"work_dir={work}", f"tracking.uri=sqlite:///{tmp_path}/mlflow.db",
                            f"tracking.run_name=fewshot-z{stage}", f"data.shards={fractals}",
                            f"parallel.zero_stage={stage}", f"model.variant={variant}", "train.steps=20", "train.log_every=5",
                            "train.eval_every=0", "train.checkpoint_every=0", "train.fewshot_every=10",
                            f"train.fewshot_datasets=digits,{missing}", "optim.lr=2e-3"])
    summary = run_training(cfg)
    assert summary.metrics["step"] == 20
    client = get_client(resolve_tracking_uri(cfg))
    run = client.get_run(summary.mlflow_run_id)
    assert run.info.status == "FINISHED"  # the unreadable dataset was a warning (worker log)
    keys = {k for k in run.data.metrics if k.startswith("fewshot/")}
    assert keys == {f"fewshot/digits_{k}shot_top1" for k in SHOTS}, keys  # nothing for the missing set
    final = {}
    for k in SHOTS:
        hist = _history(cfg, summary.mlflow_run_id, f"fewshot/digits_{k}shot_top1")
        assert [s for s, _ in hist] == [10, 20], hist
        assert all(0.0 <= v <= 1.0 for _, v in hist), hist
        final[k] = hist[-1][1]

    # The step-20 snapshot is the final checkpoint's model: its features (the FeatureExtractor
    # `vitp fewshot`'s actors run, here in this process on the same rows; that the actor pool gives
    # the same features is tests/tune/test_fewshot.py's) and the solver give the same accuracies
    # (a float32 feature may move in its last bits between batchings, which can flip one test
    # prediction, rarely).
    model = load_model(summary.checkpoint)
    train, val = (read_split(digits, split, model.image_size) for split in ("train", "val"))

    import torch

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
