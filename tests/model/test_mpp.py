"""Masked patch prediction: the corruption rule, the 3-bit colour targets, a model that learns
them, and MPP weights going downstream (the [mask] embedding and colour head dropped)."""
import math

import pytest
import torch

from vitp.model.loading import adapt_state_dict
from vitp.model.mpp import NUM_COLOURS, colour_targets, corrupt
from vitp.model.vit import ViT
from vitp.train.objective import MaskedPatchPrediction

HALF = (0.5, 0.5, 0.5)


def test_corruption_is_half_the_patches_split_80_10_10():
    g = torch.Generator().manual_seed(0)
    B, N, D = 64, 196, 8
    tokens = torch.randn(B, N, D, generator=g)
    mask = torch.full((1, 1, D), 7.0)
    out, corrupted = corrupt(tokens, mask, generator=g)
    assert (corrupted.sum(1) == 98).all()  # exactly half of each image's patches
    masked = (out == 7.0).all(-1)
    kept = (out == tokens).all(-1)
    assert not (masked & ~corrupted).any() and kept[~corrupted].all()  # the rest is untouched
    # a replaced patch holds some other patch's embedding of the batch
    replaced = corrupted & ~masked & ~kept
    flat = tokens.reshape(-1, D)
    assert all((flat == out[b, n]).all(-1).any() for b, n in replaced.nonzero()[:50].tolist())
    n = corrupted.sum().item()
    fractions = [masked.sum().item() / n, replaced.sum().item() / n, (kept & corrupted).sum().item() / n]
    # 6272 corrupted patches: the binomial std of a 10% share is 0.4 points
    assert abs(fractions[0] - 0.8) < 0.02 and abs(fractions[1] - 0.1) < 0.02 and abs(fractions[2] - 0.1) < 0.02


def test_colour_targets_are_the_3_bit_mean_colour_of_each_token():
    # a 2x2 grid of 8-pixel tokens, each token one flat colour (in [0, 1]) plus zero-mean noise
    colours = torch.tensor([[0.05, 0.30, 0.99], [0.51, 0.49, 0.0], [1.0, 0.126, 0.874], [0.2, 0.7, 0.4]])
    img = torch.zeros(3, 16, 16)
    for i, c in enumerate(colours):
        r, q = divmod(i, 2)
        noise = torch.tensor([0.01, -0.01]).repeat(32).view(8, 8)  # sums to zero over the token
        img[:, r * 8:(r + 1) * 8, q * 8:(q + 1) * 8] = c.view(3, 1, 1) + noise
    want = [int(min(c[0] * 8, 7)) * 64 + int(min(c[1] * 8, 7)) * 8 + int(min(c[2] * 8, 7)) for c in colours.tolist()]
    got = colour_targets(img.unsqueeze(0) * 2 - 1, 8, HALF, HALF)  # normalised as the shards are
    assert got.tolist() == [want] and got.max() < NUM_COLOURS


@pytest.mark.long(reason="a whole Ray Train run of one feature; CI has the CLI chain's pre-training, "
                         "fine-tuning, few-shot")
@pytest.mark.slow  # trains a hybrid for a few seconds
@pytest.mark.parametrize("variant", ["R+pico/8"])  # plain pico/8: tests/train/test_mpp_ray.py
def test_a_model_learns_the_colours_of_masked_patches(variant):
    """The loss starts at ln 512 (zero head) and a few hundred Adam steps on a small fixed set of
    smooth images take it far below: masked colours are predicted from their neighbours."""
    g = torch.Generator().manual_seed(0)
    coarse = torch.rand(32, 3, 2, 2, generator=g)
    images = torch.nn.functional.interpolate(coarse, size=32, mode="bilinear", align_corners=False) * 2 - 1
    torch.manual_seed(0)
    model = ViT(variant, image_size=32, num_classes=10, mpp=True)
    obj = MaskedPatchPrediction(HALF, HALF)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    first = obj.loss(model, images, None).item()
    for _ in range(150):
        loss = obj.loss(model, images, None)
        opt.zero_grad()
        loss.backward()
        opt.step()
    final = obj.sums(model.eval(), images, None)
    assert first == pytest.approx(math.log(512), abs=1e-3)
    assert final["loss_sum"] / final["count"] < 0.5 * math.log(512), final


def test_mpp_weights_go_downstream_without_their_head():
    src = ViT("pico/8", image_size=32, num_classes=10, head="pretrain", mpp=True)
    assert {"mpp.mask_token", "mpp.head.weight"} <= set(src.state_dict())
    assert "mpp.mask_token" in src.no_weight_decay()
    ft = ViT("pico/8", image_size=48, num_classes=5)
    ft.load_state_dict(adapt_state_dict(ft, src.state_dict()))  # strict: no mpp.* left over
    torch.testing.assert_close(ft.blocks[0].attn.qkv.weight, src.blocks[0].attn.qkv.weight)
    with pytest.raises(ValueError, match="no masked-patch-prediction head"):
        ft(torch.randn(1, 3, 48, 48), mpp=True)
