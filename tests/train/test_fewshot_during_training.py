"""Few-shot probes during pre-training (train.fewshot_every): a real Ray Train + DeepSpeed run on
2 CPU workers logs fewshot/<dataset>_<k>shot_top1 to its MLflow run at every multiple of
fewshot_every; the last probe equals `vitp fewshot`'s evaluation of the final checkpoint (ZeRO-3:
the gathered snapshot is the real model). The probe itself: tests/eval/test_probe.py.
"""
import pytest

from vitp.config import Run
from vitp.recipes import resolve

from .fewshot_probes import check_probes, probe_settings


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
