"""The AugReg settings together in a real Ray Train + DeepSpeed run (2 CPU workers, ZeRO-2): a named
setting (RandAugment on the Ray Data workers, Mixup), CutMix, label smoothing, the sigmoid loss with its
head bias, stochastic depth, layer-wise LR decay and the weight EMA, checkpointed and exported."""
import numpy as np
import pytest

from vitp.config import Run
from vitp.recipes import resolve

from .fewshot_probes import check_probes, probe_settings

pytestmark = [pytest.mark.ray, pytest.mark.slow]


@pytest.mark.long(reason="a whole Ray Train run of one feature; CI has the CLI chain's pre-training, "
                         "fine-tuning, few-shot")
def test_a_run_with_every_augreg_setting_trains_checkpoints_and_exports_its_ema(tmp_path, corpora):
    """... and its few-shot probes score the EMA (train.fewshot_weights=ema): the last one is the EMA
    export's few-shot evaluation."""
    from vitp.train.ema import full_ema
    from vitp.train.export import consolidate
    from vitp.train.trainer import run_training

    work, fractals, digits = corpora
    cfg = resolve("debug", [f"work_dir={work}", f"data.shards={fractals}", "tracking.run_name=augreg",
                            f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", *probe_settings(6, tmp_path),
                            "train.fewshot_weights=ema",
                            "train.augreg=light2", "train.cutmix_alpha=1.0", "train.label_smoothing=0.1",
                            "train.loss=sigmoid", "model.head_bias=-2.3", "model.drop_path=0.1",
                            "optim.layer_decay=0.8", "train.ema_decay=0.9", "train.steps=12",
                            "train.checkpoint_every=6", "train.eval_every=12"])
    summary = run_training(Run.of(cfg))
    m = summary.metrics
    assert m["step"] == 12 and np.isfinite(m["val/loss"]) and np.isfinite(m["val_ema/loss"])
    assert 0 <= m["val_ema/top1"] <= 1 and m["val_ema/count"] == m["val/count"]  # the same images scored
    ema, trained = full_ema(summary.checkpoint), consolidate(summary.checkpoint)
    assert ema is not None and ema.keys() == trained.keys()
    assert any(not np.allclose(ema[k].numpy(), trained[k].detach().numpy()) for k in ema)  # it averages
    bias = trained["head.bias"].detach().numpy()
    assert abs(float(bias.mean()) + 2.3) < 0.5  # started at -2.3 (a sigmoid head), moved a little
    check_probes(cfg, summary, digits, "ema")
