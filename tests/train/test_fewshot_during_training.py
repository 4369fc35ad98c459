"""Few-shot probes during pre-training (train.fewshot_every): a real Ray Train + DeepSpeed run on
2 CPU workers logs fewshot/<dataset>_<k>shot_top1 to its MLflow run at every multiple of
fewshot_every; the last probe equals `vitp fewshot`'s evaluation of the final checkpoint (ZeRO-3:
the gathered snapshot is the real model); a dataset that cannot be read is a warning, not a crash.
"""
import pytest

from vitp.config import Run
from vitp.errors import ConfigError
from vitp.recipes import resolve

from .fewshot_probes import check_probes, probe_settings


def test_fewshot_every_is_validated():
    with pytest.raises(ConfigError, match=r"train.fewshot_every=-1: must be >= 0"):
        resolve("debug", ["train.fewshot_every=-1"])
    with pytest.raises(ConfigError, match=r"train.fewshot_datasets is empty: .*--set train.fewshot_datasets=digits"):
        resolve("debug", ["train.fewshot_every=10", "train.fewshot_datasets=[]"])
    cfg = resolve("debug", ["train.fewshot_every=10", "train.fewshot_datasets=digits,/data/shards/pets/"])
    assert cfg.train.fewshot_datasets == ("digits", "/data/shards/pets")
    assert resolve("debug").train.fewshot_every == 0  # off unless asked for


def test_dataset_names_and_paths(tmp_path, monkeypatch):
    """A name is a dataset under <work_dir>/shards; a path is resolved where it was given (the probe
    actor runs in another working directory), a URI kept."""
    from vitp.eval.probe import dataset_roots

    monkeypatch.chdir(tmp_path)
    cfg = resolve("debug", ["work_dir=/w", "train.fewshot_datasets=digits, s3://b/shards/cifar10/,/x/pets,mine/flowers"])
    assert dataset_roots(Run.of(cfg)) == {"digits": "/w/shards/digits", "cifar10": "s3://b/shards/cifar10/",
                                          "pets": "/x/pets", "flowers": str(tmp_path / "mine" / "flowers")}


@pytest.mark.ray
def test_a_probe_of_a_dataset_that_cannot_be_read_is_a_warning_and_training_goes_on(ray_session, tmp_path):
    """What CI runs of the probes beside the CLI chain's (which scores digits during pre-training):
    a snapshot scored on the real probe actor, of a dataset that is not there, says so once in a
    warning; nothing is raised and no metric is made up for it."""
    from types import SimpleNamespace

    from vitp.model.vit import build_vit
    from vitp.eval.probe import FewshotProbes

    missing = tmp_path / "no-such-shards"
    cfg = resolve("debug", [f"work_dir={tmp_path}", "train.fewshot_every=10", f"train.fewshot_datasets={missing}"])
    model = build_vit(cfg.model, cfg.data.image_size)
    said = []
    probes = FewshotProbes(Run.of(cfg), SimpleNamespace(module=model), rank=0, say=said.append)
    try:
        for step in (10, 20):
            probes.snapshot(step)
        probes.finish(timeout_s=300)
    finally:
        probes.close()
    assert len(said) == 1, said  # once, for both probes
    assert said[0].startswith(f"warning: few-shot probe on no-such-shards ({missing}) failed: ") and \
        said[0].endswith("; training goes on"), said


@pytest.mark.ray
@pytest.mark.slow
# ZeRO-3 keeps parameters under 1e5 elements whole on every rank (memory.PERSISTENCE_THRESHOLD):
# pico/8 has none that large, nano/16's MLP and qkv weights are partitioned (Ti's width, 2 blocks),
# so its snapshot is gathered. ZeRO-3 (the gathered snapshot) here; ZeRO-2 with pico/8 (the debug
# recipe's) is the e2e outage run's (tests/train/test_mlflow_outage.py), through an MLflow outage.
@pytest.mark.long(reason="a whole Ray Train run of one feature; CI has the CLI chain's pre-training, "
                         "fine-tuning, few-shot")
def test_pretraining_logs_fewshot_at_every_multiple(tmp_path, corpora):
    from vitp.train.trainer import run_training

    work, fractals, digits = corpora
    cfg = resolve("debug", [f"work_dir={work}", f"tracking.uri=sqlite:///{tmp_path}/mlflow.db",
                            "tracking.run_name=fewshot-z3", f"data.shards={fractals}",
                            "parallel.zero_stage=3", "model.variant=nano/16", "train.steps=20", "train.log_every=5",
                            "train.eval_every=0", "train.checkpoint_every=0", "optim.lr=2e-3",
                            *probe_settings(10, tmp_path)])
    summary = run_training(Run.of(cfg))
    assert summary.metrics["step"] == 20
    check_probes(cfg, summary, digits)
