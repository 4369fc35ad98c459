"""Layer-wise LR decay through DeepSpeed's parameter groups: every parameter's LR is the base schedule's
times layer_decay^(L + 1 - layer) (embedding 0, block i i + 1, the rest L + 1) times the head multiplier,
under ZeRO 0, 2 and 3 on two gloo ranks; without it, the two weight-decay groups are as before."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import augreg_workers as workers  # noqa: E402

from vitp.model.vit import ViT  # noqa: E402
from vitp.train.engine import lr_scales, param_groups  # noqa: E402
from vitp.train.local import launch  # noqa: E402


def test_the_scales_follow_the_formula():
    m = ViT("mu/4", image_size=16, num_classes=5, head="pretrain")
    depth = len(m.blocks)
    s = lr_scales(m, 0.5, head_lr_mult=3.0)
    assert s["pos_embed"] == s["cls_token"] == s["patch_embed.proj.weight"] == 0.5 ** (depth + 1)
    for i in range(depth):
        assert s[f"blocks.{i}.attn.qkv.weight"] == s[f"blocks.{i}.norm2.bias"] == 0.5 ** (depth - i)
    assert s["norm.weight"] == 1.0 and s["head.weight"] == s["pre_logits.0.bias"] == 3.0
    assert set(s) == {n for n, _ in m.named_parameters()}


def test_without_layer_decay_the_groups_are_the_two_weight_decay_groups():
    m = ViT("mu/4", image_size=16, num_classes=5)
    groups = param_groups(m, 0.1, lr=1.0)
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0] and all("lr" not in g for g in groups)
    decayed = param_groups(m, 0.1, lr=1.0, layer_decay=0.7)
    assert decayed[0]["lr_scale"] == 1.0 and sum(len(g["params"]) for g in decayed) == len(list(m.parameters()))
    by_id = {id(p): g for g in decayed for p in g["params"]}
    for name, p in m.named_parameters():
        assert by_id[id(p)]["weight_decay"] == (0.0 if p.ndim <= 1 or name in ("pos_embed", "cls_token") else 0.1)


@pytest.mark.slow
@pytest.mark.parametrize("zero", [0, 2, 3])
def test_every_parameter_gets_the_lr_the_formula_gives(zero):
    extra = ["optim.layer_decay=0.6", "optim.head_lr_mult=2.0", "model.head=pretrain"]
    results = launch(workers.group_lrs_after_steps, 2, zero, 3, extra)
    m = ViT("mu/4", image_size=16, num_classes=5, head="pretrain")
    scales = lr_scales(m, 0.6, head_lr_mult=2.0)
    for res in results:
        assert set(res["lrs"]) == set(scales)
        for name, lr in res["lrs"].items():
            assert lr == pytest.approx(res["base"] * scales[name], rel=1e-9), name
        assert res["reported"] == pytest.approx(res["base"], rel=1e-9)  # train/lr: the scale-1 group's
