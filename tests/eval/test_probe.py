"""The few-shot probes during pre-training (vitp/eval/probe.py): the settings validated, the
datasets a probe reads, and a probe on the real probe actor of a dataset that cannot be read, which is
a warning, not a crash. A whole run with probes: tests/train/test_fewshot_during_training.py.
"""
import pytest

from vitp.config import Run
from vitp.errors import ConfigError
from vitp.recipes import resolve


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
    cfg = resolve("debug", ["work_dir=/w",
                            "train.fewshot_datasets=digits, s3://b/shards/cifar10/,/x/pets,mine/flowers"])
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
