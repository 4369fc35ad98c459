"""Hybrid ResNet+ViT against timm's hybrids (param counts, logits from its state dicts) and the
official .npz layout against an independent numpy forward (JAX's standardisation and padding)."""
import os
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
from test_convert import ATOL, images, official_npz, ours, reference_forward  # noqa: E402
from numerics import f32_tolerance  # noqa: E402
from timm_compat import import_timm  # noqa: E402

from vitp.config import ModelConfig  # noqa: E402
from vitp.model.convert import from_official_npz, from_timm, import_weights, infer_info, to_timm  # noqa: E402
from vitp.model.flops import forward_flops, param_count  # noqa: E402
from vitp.model.resnet import StdConv2d, pad_same  # noqa: E402
from vitp.model.variants import HYBRIDS, decode_variant  # noqa: E402
from vitp.model.vit import ViT, build_vit  # noqa: E402
from vitp.model.weights import read_config  # noqa: E402
from vitp.train.export import load_model  # noqa: E402

# our name -> timm's model of the same shape (docs/hybrid_and_mpp.md, section 2)
TIMM = {"R50+B/16": "vit_base_r50_s16_224", "R50+L/32": "vit_large_r50_s32_224",
        "R26+B/32": "vit_base_r26_s32_224", "R26+S/32": "vit_small_r26_s32_224",
        "R+Ti/16": "vit_tiny_r_s16_p8_224"}


def timm_tiny(timm, layers, classes=5):
    """timm's hybrid at our test sizes (root width 32 = timm's width_factor 0.5), pico Transformer."""
    from functools import partial

    from timm.layers import StdConv2dSame
    from timm.models.resnetv2 import ResNetV2, create_resnetv2_stem
    from timm.models.vision_transformer import VisionTransformer
    from timm.models.vision_transformer_hybrid import HybridEmbed

    # as timm's `_resnetv2` builds its hybrids' backbones, at half the width
    conv = partial(StdConv2dSame, eps=1e-8)
    patch = 1 if layers else 2
    backbone = (ResNetV2(layers, num_classes=0, global_pool="", preact=False, stem_type="same", conv_layer=conv,
                         width_factor=0.5) if layers else
                create_resnetv2_stem(3, 32, stem_type="same", preact=False, conv_layer=conv))
    return VisionTransformer(img_size=32, patch_size=patch, embed_dim=64, depth=2, num_heads=4, mlp_ratio=2,
                             num_classes=classes, embed_layer=lambda **kw: HybridEmbed(backbone=backbone, **kw))


def scramble(model, seed=0):
    """Random values in every parameter (norm scales around 1, so the norms are not identities)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g) * (0.2 if p.ndim == 1 else 0.05)
            p.copy_(noise + 1 if p.ndim == 1 and name.endswith("weight") else noise)  # norm scales
    return model


@pytest.mark.parametrize("ours_name", list(TIMM))
def test_param_counts_equal_timm(ours_name):
    timm = import_timm()
    with torch.device("meta"):
        theirs = timm.create_model(TIMM[ours_name], pretrained=False, num_classes=10)
    mine = build_vit(ModelConfig(variant=ours_name, num_classes=10, head="finetune"), 224, device="meta")
    n = sum(p.numel() for p in mine.parameters())
    assert n == sum(p.numel() for p in theirs.parameters())
    assert n == param_count(ours_name, 224, 10)
    assert sorted(to_timm(mine.state_dict())) == sorted(theirs.state_dict())  # same names, one to one


SLOW = pytest.mark.slow  # full-width ResNets: seconds each


@pytest.mark.parametrize("variant, timm_name", [pytest.param("R50+B/16", "vit_base_r50_s16_224", marks=SLOW),
                                                ("R+Ti/16", "vit_tiny_r_s16_p8_224"),
                                                pytest.param("R26+S/32", "vit_small_r26_s32_224", marks=SLOW),
                                                ("R8+pico/8", None), ("R+pico/8", None)])
@pytest.mark.long_cases("R50+B/16-vit_base_r50_s16_224", reason="the rest of the grid; CI keeps R26+S/32")
def test_timm_state_dict_imports_with_the_same_logits(tmp_path, variant, timm_name):
    timm = import_timm()
    torch.manual_seed(0)
    if timm_name:
        # at 64 px (2x2 or 4x4 tokens) to keep the suite fast: the ResNet and blocks are the same
        theirs, size = timm.create_model(timm_name, pretrained=False, num_classes=5, img_size=64), 64
    else:
        theirs, size = timm_tiny(timm, HYBRIDS[variant][1]), 32
    scramble(theirs).eval()
    x = torch.randn(2, 3, size, size)
    with torch.no_grad():
        want = theirs(x)
    sd = from_timm(theirs.state_dict())
    info = infer_info(sd)
    assert (info["variant"], info["image_size"], info["stride"]) == (variant, size, decode_variant(variant).stride)
    mine = ViT(variant, image_size=size, num_classes=5, resnet_norm="timm").eval()
    mine.load_state_dict(sd)
    with torch.no_grad():
        got = mine(x)
    assert want.abs().max() > 0.1  # a real signal
    # float32: different kernels on the two sides, so a tolerance from depth and scale (tests/numerics.py):
    # R50+B/16 (fan-in 3072, 126 layers, logits ~2) 3.3e-4; measured 2.3-3.6e-5 across CPUs and threads
    tol = f32_tolerance(mine, want)
    torch.testing.assert_close(got, want, atol=tol, rtol=0)
    with torch.no_grad():  # in float64 the two are the same function to roundoff
        want64 = theirs.double()(x.double())
        torch.testing.assert_close(mine.double()(x.double()), want64, atol=1e-9, rtol=0)
    mine.float(), theirs.float()
    # through a file and `vitp import`: the export remembers timm's standardisation
    torch.save(theirs.state_dict(), tmp_path / "timm.pth")
    exported = import_weights(str(tmp_path / "timm.pth"), str(tmp_path / "imported"))
    model, cfg = load_model(exported), read_config(exported)
    assert cfg.model.resnet_norm == "timm" and cfg.model.variant == variant
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(x), want, atol=tol, rtol=0)
        torch.testing.assert_close(model.double()(x.double()), want64, atol=1e-9, rtol=0)
    theirs.load_state_dict(to_timm(mine.state_dict()))  # and back into timm, strict


def numpy_resnet(w, img, layers):
    """The official JAX ResNet written out in numpy (float64, NHWC, HWIO kernels): standardised
    kernels (w - mean) / (std + 1e-5), SAME padding, GroupNorm(32, eps 1e-6), post-activation
    bottlenecks with the stride on the 3x3 conv."""
    w = {k: v.astype(np.float64) for k, v in w.items()}

    def conv(x, name, stride=1):
        k = w[name + "/kernel"]
        k = (k - k.mean(axis=(0, 1, 2))) / (k.std(axis=(0, 1, 2)) + 1e-5)
        kh, cout = k.shape[0], k.shape[3]
        B, H, W, _ = x.shape
        oh = -(-H // stride)
        pad = max((oh - 1) * stride + kh - H, 0)
        x = np.pad(x, ((0, 0), (pad // 2, pad - pad // 2), (pad // 2, pad - pad // 2), (0, 0)))
        out = np.zeros((B, oh, oh, cout))
        for i in range(kh):
            for j in range(kh):
                out += x[:, i:i + stride * oh:stride, j:j + stride * oh:stride] @ k[i, j]
        return out

    def gn(x, name):
        B, H, W, C = x.shape
        g = x.reshape(B, H, W, 32, C // 32)
        g = (g - g.mean(axis=(1, 2, 4), keepdims=True)) / np.sqrt(g.var(axis=(1, 2, 4), keepdims=True) + 1e-6)
        return g.reshape(B, H, W, C) * w[name + "/scale"].reshape(C) + w[name + "/bias"].reshape(C)

    relu = lambda z: np.maximum(z, 0)  # noqa: E731
    x = relu(gn(conv(img, "conv_root", 2), "gn_root"))
    B, H, W, C = x.shape
    pad = max((-(-H // 2) - 1) * 2 + 3 - H, 0)
    x = np.pad(x, ((0, 0), (pad // 2, pad - pad // 2), (pad // 2, pad - pad // 2), (0, 0)), constant_values=-np.inf)
    oh = -(-H // 2)
    x = np.max([x[:, i:i + 2 * oh:2, j:j + 2 * oh:2] for i in range(3) for j in range(3)], axis=0)
    for s, n in enumerate(layers):
        for u in range(n):
            b, stride = f"block{s + 1}/unit{u + 1}/", 2 if s > 0 and u == 0 else 1
            short = gn(conv(x, b + "conv_proj", stride), b + "gn_proj") if b + "conv_proj/kernel" in w else x
            y = relu(gn(conv(x, b + "conv1"), b + "gn1"))
            y = relu(gn(conv(y, b + "conv2", stride), b + "gn2"))
            x = relu(short + gn(conv(y, b + "conv3"), b + "gn3"))
    return x


def hybrid_npz(layers, root=32, seed=0):
    """An official hybrid .npz: ResNet under its top-level names + a pico Transformer on 1x1 patches.
    GroupNorm params in the old (1, 1, 1, C) shape, as some released checkpoints keep them."""
    rng = np.random.default_rng(seed)
    r = lambda *shape, s=0.1: (rng.standard_normal(shape) * s).astype(np.float32)  # noqa: E731
    gn = lambda name, c: {f"{name}/scale": 1 + r(1, 1, 1, c), f"{name}/bias": r(1, 1, 1, c)}  # noqa: E731
    w = {"conv_root/kernel": r(7, 7, 3, root), **gn("gn_root", root)}
    cin = root
    for s, n in enumerate(layers):
        mid = root * 2**s
        for u in range(n):
            b = f"block{s + 1}/unit{u + 1}/"
            w |= {b + "conv1/kernel": r(1, 1, cin, mid), b + "conv2/kernel": r(3, 3, mid, mid),
                  b + "conv3/kernel": r(1, 1, mid, 4 * mid), **gn(b + "gn1", mid), **gn(b + "gn2", mid),
                  **gn(b + "gn3", 4 * mid)}
            if u == 0:
                w |= {b + "conv_proj/kernel": r(1, 1, cin, 4 * mid), **gn(b + "gn_proj", 4 * mid)}
            cin = 4 * mid
    return w | official_npz(patch=1, grid=4, in_chans=cin, seed=seed + 1)


def test_official_hybrid_npz_matches_independent_numpy_forward(tmp_path):
    layers = HYBRIDS["R8+pico/8"][1]
    w = hybrid_npz(layers)
    np.savez(tmp_path / "R8+pico_8.npz", **w)
    sd, info = from_official_npz(str(tmp_path / "R8+pico_8.npz"))
    assert (info["variant"], info["image_size"], info["grid"]) == ("R8+pico/8", 32, 4)
    x = images()
    ref = reference_forward(w, numpy_resnet(w, x, layers))  # the Transformer on the feature map
    m = ViT("R8+pico/8", image_size=32, num_classes=7, head="pretrain", representation_size=48).eval()
    m.load_state_dict(sd)
    with torch.no_grad():
        got = m(ours(x)).double().numpy()
    assert np.abs(ref).max() > 0.1
    np.testing.assert_allclose(got, ref, atol=ATOL, rtol=0)
    # `vitp import` at another resolution resamples the position embedding to the hybrid's grid
    out = import_weights(str(tmp_path / "R8+pico_8.npz"), str(tmp_path / "i64"), image_size=64)
    model, cfg = load_model(out), read_config(out)
    assert (cfg.model.resnet_norm, model.grid, tuple(model.pos_embed.shape)) == ("bit", 8, (1, 65, 64))
    assert model(torch.randn(1, 3, 64, 64)).shape == (1, 7)


def test_standardisation_and_padding_follow_each_source():
    torch.manual_seed(0)
    conv = StdConv2d(8, 16, 3, 2, norm="bit")
    w = conv.weight.detach().double().numpy()
    m, s = w.mean(axis=(1, 2, 3), keepdims=True), w.std(axis=(1, 2, 3), keepdims=True)
    np.testing.assert_allclose(conv.standardized().detach().numpy(), (w - m) / (s + 1e-5), atol=1e-6)
    conv.norm = "timm"
    np.testing.assert_allclose(conv.standardized().detach().numpy(), (w - m) / np.sqrt(s**2 + 1e-8), atol=1e-6)
    # TF 'SAME': 7x7/2 on 224 pads 2 left and 3 right; 3x3/2 on an even size pads right only
    assert pad_same(torch.zeros(1, 1, 224, 224), 7, 2).shape[-1] == 229
    z = pad_same(torch.ones(1, 1, 4, 4), 3, 2, value=-1.0)
    assert z.shape[-2:] == (5, 5) and z[0, 0, 0, 0] == 1 and z[0, 0, -1, -1] == -1


@pytest.mark.parametrize("variant", ["R8+pico/8", "R+pico/8"])
def test_flops_counted_by_torch_agree(variant):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    model = ViT(variant, image_size=32, num_classes=10).eval()
    with FlopCounterMode(display=False) as fc, torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        model(torch.randn(1, 3, 32, 32))
    assert fc.get_total_flops() == pytest.approx(forward_flops(variant, 32, 10), rel=1e-6)


def test_hybrid_names_and_strides():
    assert decode_variant("R50+B/16").stride == 16 and decode_variant("R50+L/32").stride == 32
    assert decode_variant("R26+S/32").stride == 32 and decode_variant("R+Ti/16").stride == 32  # root /4 x 8
    assert decode_variant("R50+B/16").feature_chans == 1024 and decode_variant("R+Ti/16").feature_chans == 64
    with pytest.raises(ValueError, match="is not divisible by R50\\+B/16's token size 16"):
        ViT("R50+B/16", image_size=200)
