"""A hybrid ResNet+ViT through the whole path: ZeRO-3 pre-training on Ray Train, fine-tuning at a
higher resolution (the position embedding resampled to the hybrid's grid) with the lineage and
the zero-initialised head recorded, export, few-shot. (A plain ViT takes the same path from an
export in tests/cli/test_every_command.py's chain and tests/test_uri_paths.py.)"""
import pytest

from vitp.config import Run, validate
from vitp.recipes import resolve, with_overrides

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.e2e]


@pytest.mark.long(reason="a whole Ray Train run of one feature; CI has the CLI chain's pre-training, "
                         "fine-tuning, few-shot")
def test_hybrid_pretrains_finetunes_exports_and_fewshots(tmp_path, debug_shards, digits_shards):
    from vitp.model.attention import mean_attention_distance
    from vitp.model.weights import read_config
    from vitp.tracking.store import get_client
    from vitp.train.export import export, load_model
    from vitp.train.report import log_report
    from vitp.train.trainer import run_training
    from vitp.train.transfer import finetune_config
    from vitp.eval.fewshot import run_fewshot

    import torch

    pre = resolve("debug", [f"work_dir={tmp_path}", f"data.shards={debug_shards}", "model.variant=R8+pico/8",
                            "parallel.zero_stage=3", "train.steps=20", "train.checkpoint_every=0"])
    pre_summary = run_training(Run.of(pre))
    client = get_client(Run.of(pre).tracking_uri)
    loss = sorted(client.get_metric_history(pre_summary.mlflow_run_id, "train/loss"), key=lambda m: m.step)
    assert loss and all(torch.isfinite(torch.tensor(m.value)) for m in loss)

    cfg, tags = finetune_config(with_overrides("debug_finetune", [f"work_dir={tmp_path}",
                                                                  f"data.shards={digits_shards}"]),
                                pre_summary.checkpoint)
    cfg = validate(cfg)
    assert cfg.model.variant == "R8+pico/8" and cfg.data.image_size == 48  # 4x4 -> 6x6 tokens
    assert cfg.model.head == "finetune" and tags["source_image_size"] == "32"
    assert tags["source_run_id"] == pre_summary.mlflow_run_id
    summary = run_training(Run.of(cfg), extra_tags=tags)
    log_report(Run.of(cfg), summary)  # as `vitp finetune` does after training
    assert client.get_run(summary.mlflow_run_id).data.tags["source_run_id"] == pre_summary.mlflow_run_id
    init = client.get_metric_history(summary.mlflow_run_id, "train/init_logit_absmax")
    assert [(m.step, m.value) for m in init] == [(0, 0.0)]  # zero-init head: logits exactly 0
    top1 = [m.value for m in sorted(client.get_metric_history(summary.mlflow_run_id, "val/top1"),
                                    key=lambda m: m.step)]
    assert len(top1) == 2  # at step 100 and at the end
    assert top1[-1] > 0.2, f"digits top-1 {top1[-1]:.3f} after fine-tuning the hybrid (chance 0.1)"
    rollouts = [a.path for a in client.list_artifacts(summary.mlflow_run_id, "attention")]
    assert len(rollouts) == 4  # attention rollout drawn on the hybrid's 6x6 grid

    out = export(summary.checkpoint, str(tmp_path / "export"))
    model = load_model(out)
    assert read_config(out).model.variant == "R8+pico/8" and model.grid == 6
    dist = mean_attention_distance(model, torch.randn(2, 3, 48, 48))
    assert dist.shape == (2, 4) and float(dist.max()) <= 48 * 2**0.5  # pixels, 8 per token
    fs = run_fewshot(Run.of(cfg), out, tracking=False)
    accs = [v for k, v in fs.items() if "shot" in k]
    assert accs and all(0.0 <= v <= 1.0 for v in accs)
