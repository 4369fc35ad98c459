"""Stochastic depth: the identity in evaluation; in training each sample's residual branch is kept or
dropped whole, at the block's rate (linear over depth), the kept ones scaled so the mean is unchanged."""
import math

import pytest
import torch

from vitp.model.layers import Block, drop_path, drop_path_rates
from vitp.model.vit import ViT


def test_rates_rise_linearly_from_zero_to_the_last_block():
    assert drop_path_rates(0.2, 5) == pytest.approx([0.0, 0.05, 0.1, 0.15, 0.2])
    assert drop_path_rates(0.1, 1) == [0.1] and drop_path_rates(0.0, 12) == [0.0] * 12
    m = ViT("mu/4", image_size=16, num_classes=3, drop_path=0.3)
    assert [b.drop_path for b in m.blocks] == pytest.approx(drop_path_rates(0.3, m.spec.depth))


def test_whole_samples_dropped_at_the_rate_and_the_rest_scaled():
    torch.manual_seed(0)
    n, rate = 20_000, 0.3
    out = drop_path(torch.ones(n, 5, 7), rate, training=True)
    per_sample = out.flatten(1)
    assert torch.all(per_sample == per_sample[:, :1])  # all of a sample's values dropped or kept together
    kept = per_sample[:, 0] != 0
    assert torch.allclose(per_sample[kept], torch.full_like(per_sample[kept], 1 / (1 - rate)))
    sigma = math.sqrt(rate * (1 - rate) / n)
    assert abs((1 - kept.float().mean().item()) - rate) < 5 * sigma
    x = torch.randn(4, 3)
    assert drop_path(x, rate, training=False) is x and drop_path(x, 0.0, training=True) is x


def test_a_block_drops_its_residual_branch_per_sample():
    """With the MLP branch silenced, a block's output minus its input is, per sample, either
    nothing (dropped) or the attention branch / (1 - rate) (kept)."""
    torch.manual_seed(1)
    rate = 0.5
    blk = Block(16, 32, 2, drop_path=rate)
    torch.nn.init.zeros_(blk.mlp.fc2.weight)
    torch.nn.init.zeros_(blk.mlp.fc2.bias)
    x = torch.randn(400, 5, 16)
    branch = blk.attn(blk.norm1(x)).detach()
    delta = (blk.train()(x) - x).detach()
    dropped = delta.flatten(1).abs().amax(1) == 0
    assert torch.allclose(delta[~dropped], branch[~dropped] / (1 - rate), atol=1e-5)
    assert 0.35 < dropped.float().mean().item() < 0.65
    assert torch.allclose(blk.eval()(x) - x, branch, atol=1e-6)  # eval: the plain residual


def test_a_model_with_drop_path_is_the_same_model_in_evaluation_and_loads_the_same_weights():
    torch.manual_seed(2)
    plain = ViT("mu/4", image_size=16, num_classes=3).eval()
    dropped = ViT("mu/4", image_size=16, num_classes=3, drop_path=0.4).eval()
    assert plain.state_dict().keys() == dropped.state_dict().keys()
    dropped.load_state_dict(plain.state_dict(), strict=True)
    x = torch.randn(6, 3, 16, 16)
    assert torch.equal(plain.forward_features(x), dropped.forward_features(x))
    dropped.train()  # (the fine-tuning head is zero-initialised: compare the features)
    assert not torch.equal(plain.forward_features(x), dropped.forward_features(x))
