"""Transfer on Ray Train: a debug pre-training checkpoint fine-tuned on digits at 48 px."""
import pytest

from pipeline.config import validate
from pipeline.recipes import resolve, with_overrides

pytestmark = [pytest.mark.ray, pytest.mark.slow]


@pytest.mark.e2e
def test_finetune_from_pretrain_checkpoint_at_higher_resolution(tmp_path, debug_shards, digits_shards):
    from pipeline.tracking.store import get_client, resolve_tracking_uri
    from pipeline.train.trainer import run_training
    from pipeline.train.transfer import finetune_config

    pre = resolve("debug", [f"work_dir={tmp_path}", f"data.shards={debug_shards}", "train.steps=20",
                            "train.checkpoint_every=0"])
    pre_summary = run_training(pre)

    cfg, tags = finetune_config(with_overrides("debug_finetune", [f"work_dir={tmp_path}",
                                                                  f"data.shards={digits_shards}"]),
                                pre_summary.checkpoint)
    cfg = validate(cfg)
    assert cfg.model.variant == "pico/8" and cfg.model.head == "finetune"
    assert cfg.data.image_size == 48 and tags["source_image_size"] == "32"  # 4x4 -> 6x6 grid
    assert tags["source_run_id"] == pre_summary.mlflow_run_id
    summary = run_training(cfg, extra_tags=tags)

    client = get_client(resolve_tracking_uri(cfg))
    run = client.get_run(summary.mlflow_run_id)
    assert run.data.tags["source_run_id"] == pre_summary.mlflow_run_id
    init = client.get_metric_history(summary.mlflow_run_id, "train/init_logit_absmax")
    assert [(m.step, m.value) for m in init] == [(0, 0.0)]  # zero-init head: logits exactly 0
    top1 = [m.value for m in sorted(client.get_metric_history(summary.mlflow_run_id, "val/top1"),
                                    key=lambda m: m.step)]
    assert len(top1) == 2  # at step 100 and at the end
    # Observed 0.49-0.66 over runs (the streaming split's order varies); chance is 0.1.
    assert top1[-1] > 0.3, f"digits top-1 {top1[-1]:.3f} is not well above chance (0.1)"
    print(f"digits top-1 after fine-tuning from a 20-step debug pre-training: {top1}")
    rollouts = [a.path for a in client.list_artifacts(summary.mlflow_run_id, "attention")]
    assert len(rollouts) == 4 and all(p.endswith(".png") for p in rollouts)
