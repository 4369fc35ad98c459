"""ZeRO-3 builds the ViT partitioned (deepspeed.zero.Init): each rank holds its share from the
start, the initialisation is the official scheme, and `train.init_from` weights load into it.

Real DeepSpeed on two spawned gloo ranks (vitp.train.local.launch), compared with the plain
full build (`build_vit` after the same seed).
"""
import os
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import zero_init_workers as workers  # noqa: E402

from vitp.model.vit import build_vit  # noqa: E402
from vitp.train.local import launch  # noqa: E402
from vitp.train.loop import seed_everything  # noqa: E402

pytestmark = pytest.mark.slow
VARIANT = "S/8"  # 12 blocks of width 384 at 32 px: 21.3M parameters, big enough for statistics


def full_build(cfg, dtype=torch.float32):
    """An unpartitioned build as DeepSpeed gets it below ZeRO-3 (fp32, cast to `dtype`)."""
    seed_everything(cfg.train.seed)
    model = build_vit(cfg.model, cfg.data.image_size)
    return {n: p.detach().to(dtype).float().numpy() for n, p in model.named_parameters()}


def check_shares(results):
    """Right after construction every rank holds 1/world of every parameter, no more."""
    for res in results:
        for name, (held, whole) in res["shares"].items():
            assert held == -(-whole // len(results)), f"{name}: a rank holds {held} of {whole}"


def test_partitioned_build_is_the_full_build_in_fp32():
    cfg = workers.cfg_for(VARIANT, "fp32")
    results = launch(workers.partitioned_build, 2, VARIANT, "fp32")
    check_shares(results)
    got, want = results[0]["full"], full_build(cfg)
    assert got.keys() == want.keys()
    for name in want:  # the same random draws in the same order: bit for bit
        assert np.array_equal(got[name], want[name]), f"{name} differs by {np.abs(got[name] - want[name]).max()}"
    seed_everything(0)
    model = build_vit(cfg.model, cfg.data.image_size)
    decay = sorted(n for n, p in model.named_parameters() if p.ndim > 1 and n not in ("pos_embed", "cls_token"))
    assert results[0]["decay"] == decay, "weight decay must fall on the same matrices when partitioned"


@pytest.mark.long(reason="partitioned construction beyond the fp32 build, which CI checks")
def test_partitioned_build_in_bf16_is_the_full_build_rounded():
    cfg = workers.cfg_for(VARIANT, "bf16")
    results = launch(workers.partitioned_build, 2, VARIANT, "bf16")
    check_shares(results)
    got, want = results[0]["full"], full_build(cfg, torch.bfloat16)
    for name in want:  # drawn in fp32 and rounded once, as DeepSpeed casts a full build
        assert np.array_equal(got[name], want[name]), f"{name} differs by {np.abs(got[name] - want[name]).max()}"
    want = full_build(cfg)  # the official fp32 init: every group's statistics within sampling error
    for name in ("head.weight", "head.bias", "cls_token"):
        assert not got[name].any(), f"{name} must be exactly zero"
    groups = {"qkv": "attn.qkv.weight", "proj": "attn.proj.weight", "fc1": "mlp.fc1.weight",
              "fc2": "mlp.fc2.weight", "fc_bias": "mlp.fc1.bias", "patch": "patch_embed.proj.weight",
              "pos": "pos_embed", "norm": "norm1.weight"}
    for group, suffix in groups.items():
        a = np.concatenate([got[n].ravel() for n in got if n.endswith(suffix)]).astype(np.float64)
        b = np.concatenate([want[n].ravel() for n in want if n.endswith(suffix)]).astype(np.float64)
        se = b.std() / np.sqrt(b.size)  # standard error of the mean; bf16 rounds 2^-9 relative
        assert abs(a.mean() - b.mean()) <= 5 * se + 1e-12, (group, a.mean(), b.mean(), se)
        assert abs(a.std() - b.std()) <= 0.01 * b.std() + 1e-12, (group, a.std(), b.std())


def test_init_from_weights_load_into_a_partitioned_model(tmp_path):
    from safetensors.torch import save_file

    cfg = workers.cfg_for(VARIANT, "fp32", ["model.head=pretrain"])
    torch.manual_seed(7)
    source = build_vit(cfg.model, cfg.data.image_size)
    with torch.no_grad():
        for p in source.parameters():
            p.normal_()  # nothing like an initialisation, so a load cannot pass by accident
    path = str(tmp_path / "weights.safetensors")
    save_file({n: p.detach().contiguous() for n, p in source.named_parameters()}, path)
    want = {n: p.detach().numpy() for n, p in source.named_parameters()}

    got = launch(workers.partitioned_build, 2, VARIANT, "fp32", ["model.head=pretrain", f"train.init_from={path}"])
    check_shares(got)
    for name in want:  # a pre-training head is kept
        assert np.array_equal(got[0]["full"][name], want[name]), name
    ft = launch(workers.partitioned_build, 2, VARIANT, "fp32", ["model.head=finetune", f"train.init_from={path}"])[0]["full"]
    assert not ft["head.weight"].any() and not ft["head.bias"].any(), "a fine-tuning head starts at zero"
    assert "pre_logits.0.weight" not in ft
    assert np.array_equal(ft["blocks.3.mlp.fc2.weight"], want["blocks.3.mlp.fc2.weight"])


HYBRID = ["data.image_size=64", "data.storage_size=64"]  # R26+S/32: a 2x2 grid of 32-px tokens


@pytest.mark.long(reason="partitioned construction beyond the fp32 build, which CI checks")
def test_partitioned_hybrid_is_the_full_build():
    """A hybrid's ResNet goes into the embedding group: partitioned, initialised and gathered like
    the Transformer (its convolutions are big enough to be split between the ranks)."""
    cfg = workers.cfg_for("R26+S/32", "fp32", HYBRID)
    results = launch(workers.partitioned_build, 2, "R26+S/32", "fp32", HYBRID)
    check_shares(results)
    got, want = results[0]["full"], full_build(cfg)
    assert any(n.startswith("patch_embed.backbone.stages.") and held < whole
               for n, (held, whole) in results[0]["shares"].items())
    for name in want:
        assert np.array_equal(got[name], want[name]), f"{name} differs"


@pytest.mark.long(reason="partitioned construction beyond the fp32 build, which CI checks")
def test_masked_patch_prediction_trains_a_partitioned_model():
    """The [mask] embedding and the colour head take part under ZeRO-3: the loss starts at ln 512
    (zero head) and falls on a fixed batch, and the [mask] embedding moves."""
    results = launch(workers.partitioned_mpp_steps, 2, "R26+S/32", HYBRID)
    r = results[0]
    assert "mpp.head.weight" in r["partitioned"]  # 384 x 512: split between the ranks
    assert abs(r["losses"][0] - np.log(512)) < 1e-4 and r["losses"][-1] < r["losses"][0], r["losses"]
    assert not np.array_equal(r["before"], r["after"])

