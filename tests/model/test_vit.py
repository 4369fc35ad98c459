"""The ViT family against docs/paper.md: params, FLOPs, attention, pos-embed resampling, heads."""
import math

import pytest
import torch
import torch.nn.functional as F

from vitp.config import ModelConfig
from vitp.model.flops import forward_flops, param_count, training_flops
from vitp.model.variants import PAPER_VARIANTS
from vitp.model.loading import adapt_state_dict, resample_pos_embed
from vitp.model.vit import ViT, build_vit

# docs/paper.md: params with a 1000-class linear head at 224 (timm's vit_*_224), in millions,
# and the precision the table states them to.
PAPER_PARAMS = {"Ti/16": (5.7, 0.05), "S/16": (22.1, 0.05), "B/16": (86.57, 0.005),
                "L/16": (304.33, 0.005), "H/14": (632.05, 0.005)}


@pytest.mark.parametrize("variant", list(PAPER_PARAMS))
def test_param_counts_match_paper(variant):
    model = build_vit(ModelConfig(variant=variant, head="finetune"), 224, device="meta")
    n = sum(p.numel() for p in model.parameters())
    expected, tol = PAPER_PARAMS[variant]
    assert abs(n / 1e6 - expected) <= tol, f"{variant}: {n / 1e6:.3f}M vs paper {expected}M"
    assert n == param_count(variant)  # analytic count agrees with the module


@pytest.mark.parametrize("variant, size, gflops", [
    ("B/16", 224, 35.2), ("L/16", 224, 123.2), ("H/14", 224, 334.8), ("B/16", 384, 111.1),
    ("L/16", 384, 382.4),
])
def test_forward_flops_match_paper(variant, size, gflops):
    got = forward_flops(variant, size) / 1e9
    assert abs(got - gflops) / gflops < 0.01, f"{variant}@{size}: {got:.2f} vs {gflops}"
    assert training_flops(variant, size) == pytest.approx(3 * got * 1e9)


def test_training_flops_reproduce_table6():
    # docs/paper.md: H/14, 14 epochs of JFT-300M = 4,262 exaFLOPs (about 4.2e21 at 3 x forward)
    total = training_flops("H/14") * 14 * 300e6
    assert 3.9e21 < total < 4.6e21


def test_flops_counted_by_torch_agree():
    # FlopCounterMode counts matmul/conv/sdpa FLOPs of a real forward: same definition as ours.
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    model = ViT("mu/4", image_size=32, num_classes=10).eval()
    # the math backend runs attention as matmuls the counter sees (the fused CPU kernel it skips)
    with FlopCounterMode(display=False) as fc, torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        model(torch.randn(1, 3, 32, 32))
    assert fc.get_total_flops() == pytest.approx(forward_flops("mu/4", 32, 10), rel=1e-6)


def test_sdpa_equals_explicit_attention():
    torch.manual_seed(0)
    model = ViT("pico/8", image_size=32, num_classes=5).eval()
    attn = model.blocks[0].attn
    x = torch.randn(3, 17, 64)
    B, N, D = x.shape
    q, k, v = attn.qkv(x).reshape(B, N, 3, attn.heads, attn.head_dim).permute(2, 0, 3, 1, 4)
    w = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(attn.head_dim), dim=-1)  # (B, H, N, N)
    explicit = attn.proj((w @ v).transpose(1, 2).reshape(B, N, D))
    torch.testing.assert_close(attn(x), explicit, atol=1e-5, rtol=0)
    torch.testing.assert_close(attn.attention_weights(x), w, atol=1e-6, rtol=0)


def test_finetune_head_is_zero_and_logits_exactly_zero():
    torch.manual_seed(0)
    model = ViT("pico/8", image_size=32, num_classes=7, head="finetune")
    assert torch.count_nonzero(model.head.weight) == 0
    out = model(torch.randn(4, 3, 32, 32))
    assert out.shape == (4, 7) and torch.equal(out, torch.zeros_like(out))
    assert isinstance(model.pre_logits, torch.nn.Identity)


def test_pretrain_head_has_tanh_prelogits():
    model = ViT("pico/8", image_size=32, num_classes=7, head="pretrain", representation_size=48)
    feats = model.forward_head(model.forward_features(torch.randn(2, 3, 32, 32)), pre_logits=True)
    assert feats.shape == (2, 48) and feats.abs().max() <= 1.0
    assert model.head.in_features == 48


def test_init_follows_official_code():
    torch.manual_seed(0)
    model = ViT("S/16", image_size=64, num_classes=10)
    assert torch.count_nonzero(model.cls_token) == 0
    assert 0.015 < model.pos_embed.std().item() < 0.025  # N(0, 0.02)
    fc1 = model.blocks[0].mlp.fc1
    bound = math.sqrt(6 / (fc1.in_features + fc1.out_features))  # xavier uniform
    assert fc1.weight.abs().max() <= bound and fc1.weight.abs().max() > 0.9 * bound
    assert fc1.bias.abs().max() < 1e-5  # N(0, 1e-6)
    w = model.patch_embed.proj.weight  # lecun normal: std sqrt(1/fan_in)
    assert w.std().item() == pytest.approx(math.sqrt(1 / w[0].numel()), rel=0.05)


def test_resample_same_grid_is_identity():
    pe = torch.randn(1, 1 + 14 * 14, 32)
    torch.testing.assert_close(resample_pos_embed(pe, 14), pe, atol=1e-6, rtol=0)


def test_resample_keeps_class_token_and_is_bilinear():
    pe = torch.randn(1, 1 + 4 * 4, 8)
    out = resample_pos_embed(pe, 8)
    assert out.shape == (1, 1 + 64, 8)
    assert torch.equal(out[:, 0], pe[:, 0])
    # a grid that is linear in (row, col) stays linear in the interior after bilinear resizing
    rows = torch.arange(4.0).repeat_interleave(4)
    lin = torch.zeros(1, 17, 8)
    lin[0, 1:, 0] = rows
    up = resample_pos_embed(lin, 8)[0, 1:, 0].reshape(8, 8)
    interior = up[1:-1, 0]
    assert torch.allclose(interior.diff(), torch.full_like(interior.diff(), 0.5))


def test_weights_from_224_run_at_384_and_change_output():
    torch.manual_seed(0)
    src = ViT("mu/16", image_size=224, num_classes=10, head="pretrain")
    torch.nn.init.normal_(src.head.weight)  # a "trained" head so outputs are non-zero
    dst = ViT("mu/16", image_size=384, num_classes=10, head="pretrain")
    dst.load_state_dict(adapt_state_dict(dst, src.state_dict()))
    x = torch.rand(2, 3, 384, 384)
    out = dst(x)
    assert out.shape == (2, 10) and torch.isfinite(out).all()
    # different from the 224 model on the downsized image: the grid really changed
    ref = src(F.interpolate(x, size=224, mode="bilinear"))
    assert not torch.allclose(out, ref)
    # and the fine-tune head replaces the pre-training one with zeros
    ft = ViT("mu/16", image_size=384, num_classes=3, head="finetune")
    ft.load_state_dict(adapt_state_dict(ft, src.state_dict()))
    assert torch.equal(ft(x), torch.zeros(2, 3))


def test_wrong_resolution_input_names_the_fix():
    model = ViT("mu/8", image_size=32, num_classes=2)
    with pytest.raises(ValueError, match="adapt_state_dict"):
        model(torch.randn(1, 3, 48, 48))
    with pytest.raises(ValueError, match="multiple of 8"):
        ViT("mu/8", image_size=30)


def test_grad_checkpointing_same_gradients():
    torch.manual_seed(0)
    a = ViT("pico/8", image_size=32, num_classes=4, head="pretrain")
    torch.nn.init.normal_(a.head.weight)
    b = ViT("pico/8", image_size=32, num_classes=4, head="pretrain", grad_checkpointing=True)
    b.load_state_dict(a.state_dict())
    x = torch.randn(2, 3, 32, 32)
    a(x).square().sum().backward()
    b(x).square().sum().backward()
    for (n, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        torch.testing.assert_close(pa.grad, pb.grad, atol=1e-6, rtol=1e-5, msg=n)


def _small(variant: str) -> tuple[str, int]:
    """The variant's depth/width at a small resolution (2 patches a side)."""
    patch = int(variant.split("/")[1])
    return variant, 2 * patch


@pytest.mark.parametrize("variant", ["mu/4", "pico/8", "Ti/16", "S/16", "B/32", "B/16", "B/8"])
def test_forward_backward_finite(variant):
    v, size = _small(variant)
    torch.manual_seed(0)
    model = ViT(v, image_size=size, num_classes=5, head="pretrain")
    torch.nn.init.normal_(model.head.weight, std=0.02)
    out = model(torch.randn(2, 3, size, size))
    loss = F.cross_entropy(out, torch.tensor([0, 3]))
    loss.backward()
    assert torch.isfinite(loss)
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert model.patch_embed.proj.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("variant", [v for v in PAPER_VARIANTS if v.split("/")[0] in ("L", "H")])
def test_large_variants_forward_on_meta(variant):
    v, size = _small(variant)
    model = build_vit(ModelConfig(variant=v, num_classes=1000), 224 if v != "H/14" else 224,
                      device="meta")
    out = model(torch.empty(2, 3, 224, 224, device="meta"))
    assert out.shape == (2, 1000) and out.device.type == "meta"


def test_no_weight_decay_names():
    model = ViT("mu/4", image_size=8, num_classes=2)
    nwd = model.no_weight_decay()
    assert {"pos_embed", "cls_token", "head.bias", "norm.weight", "blocks.0.attn.qkv.bias"} <= nwd
    assert "blocks.0.attn.qkv.weight" not in nwd and "head.weight" not in nwd
