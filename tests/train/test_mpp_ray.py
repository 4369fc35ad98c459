"""Masked patch prediction through Ray Train + DeepSpeed on 2 CPU workers, from an unlabelled
corpus (a folder of images, no classes): the loss falls far below the 512-colour chance level, and
the checkpoint fine-tunes like any other."""
import math

import numpy as np
import pytest
from PIL import Image

from vitp.config import Run, validate
from vitp.recipes import resolve, with_overrides

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.e2e]

STEPS = 100  # the loss must be below half of ln 512 by then (measured 2.42, docs/hybrid_and_mpp.md)


@pytest.mark.long(reason="a whole Ray Train run of one feature; CI has the CLI chain's pre-training, "
                         "fine-tuning, few-shot")
def test_mpp_pretrains_from_an_unlabelled_folder_and_fine_tunes(tmp_path, digits_shards):
    import torch

    from vitp.data.commands import ensure_shards, run_preprocess
    from vitp.data.ingest import normalize, peek_rows
    from vitp.model.mpp import colour_targets
    from vitp.data.synth import render
    from vitp.tracking.store import get_client
    from vitp.train.trainer import run_training
    from vitp.train.transfer import finetune_config

    folder = tmp_path / "photos"  # no class structure: files at two depths, names say nothing
    for i in range(600):
        sub = folder / f"batch{i % 3}" if i % 2 else folder
        sub.mkdir(parents=True, exist_ok=True)
        Image.fromarray(render(0, i % 20, i, 32)).save(sub / f"img{i:04d}.png")

    pre = resolve("debug", [f"work_dir={tmp_path}", "data.source=unlabelled", f"data.path={folder}",
                            "data.storage_size=32", "train.objective=mpp", f"train.steps={STEPS}",
                            "train.log_every=10", f"train.eval_every={STEPS}", "train.checkpoint_every=0",
                            "optim.lr=0.004", "parallel.global_batch=64", "parallel.micro_batch=32"])
    assert pre.run_name.endswith("-mpp")
    run_preprocess(Run.of(pre), log=lambda s: None)
    summary = run_training(Run.of(pre))
    client = get_client(Run.of(pre).tracking_uri)
    loss = [m.value for m in sorted(client.get_metric_history(summary.mlflow_run_id, "train/loss"),
                                    key=lambda m: m.step)]
    print(f"mpp train/loss every 10 steps: {[round(v, 2) for v in loss]} (ln 512 = {math.log(512):.2f})")
    assert len(loss) == STEPS // 10
    assert loss[-1] < 0.5 * math.log(512), loss
    # colour top-1 of the masked val patches, against always answering the most common colour
    val = client.get_metric_history(summary.mlflow_run_id, "val/top1")[-1].value
    rows = peek_rows(Run.of(pre), "val", 1000)["image"]  # (n, 32, 32, 3) uint8, the val split
    x = normalize(torch.from_numpy(rows), pre.data.mean, pre.data.std)  # as the model sees them
    colours = colour_targets(x, 8, pre.data.mean, pre.data.std).flatten()
    majority = colours.bincount().max().item() / colours.numel()
    print(f"masked-colour top-1 {val:.3f}, most common colour's share {majority:.3f}")
    assert val > majority + 0.05, (val, majority)

    digits = with_overrides("debug_finetune", [f"work_dir={tmp_path}", f"data.shards={digits_shards}"])
    cfg, tags = finetune_config(digits, summary.checkpoint)
    cfg = validate(cfg)
    assert cfg.train.objective == "classify" and cfg.model.head == "finetune"
    ensure_shards(Run.of(cfg), log=lambda s: None)  # the session's digits shards: nothing to do
    ft = run_training(Run.of(cfg), extra_tags=tags)
    top1 = client.get_metric_history(ft.mlflow_run_id, "val/top1")[-1].value
    assert np.isfinite(top1) and top1 > 0.2, top1  # digits, chance 0.1
