"""Mixup, CutMix and label smoothing on a micro-batch: the targets' mass sums to one and each image is
mixed in exactly the proportions its target says; the objective's draws repeat for the same step."""
import numpy as np
import pytest
import torch

from vitp.recipes import with_overrides
from vitp.train.mixing import Mixing, smooth_targets
from vitp.train.objective import Classify, objective_for


def _batch(n=8, k=5, side=12):
    """Image i is the constant i + 1 (so every pixel tells which image it came from); label i % k."""
    x = torch.arange(1, n + 1, dtype=torch.float32).view(n, 1, 1, 1).expand(n, 3, side, side).contiguous()
    return x, torch.arange(n) % k


def test_smoothing_spreads_the_given_mass_and_keeps_one():
    t = smooth_targets(torch.tensor([0, 3]), 4, 0.2)
    assert torch.allclose(t.sum(1), torch.ones(2))
    assert torch.allclose(t[0], torch.tensor([0.85, 0.05, 0.05, 0.05])) and t[1, 3] == pytest.approx(0.85)


def test_mixup_mixes_each_image_with_its_neighbour_as_the_targets_say():
    x, y = _batch()
    for seed in range(5):
        mixed, t, lam = Mixing(5, mixup_alpha=0.4)(x, y, np.random.default_rng(seed))
        assert 0.0 < lam < 1.0
        assert torch.allclose(mixed, lam * x + (1 - lam) * x.roll(1, 0))
        assert torch.allclose(t.sum(1), torch.ones(len(y)))
        for i in range(len(y)):  # the label of the image and of its partner carry lambda and 1 - lambda
            want = torch.zeros(5)
            want[y[i]] += lam
            want[y[i - 1]] += 1 - lam
            assert torch.allclose(t[i], want)


def test_cutmix_pastes_a_box_whose_area_is_the_partners_label_mass():
    x, y = _batch(side=16)
    seen_clipped = False
    for seed in range(30):
        mixed, t, lam = Mixing(5, cutmix_alpha=1.0, smoothing=0.1)(x, y, np.random.default_rng(seed))
        assert torch.allclose(t.sum(1), torch.ones(len(y)))
        for i in range(len(y)):
            own = (mixed[i] == x[i]).float().mean().item()
            partner = (mixed[i] == x[i - 1]).float().mean().item()
            assert own + partner == pytest.approx(1.0) and own == pytest.approx(lam)  # box area, clipped
            soft = smooth_targets(y, 5, 0.1)
            want = soft[i] * lam + soft[i - 1] * (1 - lam)
            assert torch.allclose(t[i], want)
        seen_clipped |= 0.0 < lam < 1.0
    assert seen_clipped


def test_with_both_each_micro_batch_gets_one_of_them():
    x, y = _batch(side=16)
    kinds = set()
    for seed in range(40):
        mixed, _, lam = Mixing(5, mixup_alpha=0.8, cutmix_alpha=1.0)(x, y, np.random.default_rng(seed))
        if torch.allclose(mixed, lam * x + (1 - lam) * x.roll(1, 0)) and not torch.equal(mixed, x):
            kinds.add("mixup")
        elif bool(((mixed == x) | (mixed == x.roll(1, 0))).all()):
            kinds.add("cutmix")
    assert kinds == {"mixup", "cutmix"}


class _Linear(torch.nn.Module):
    def __init__(self, k=5):
        super().__init__()
        self.fc = torch.nn.Linear(3, k)

    def forward(self, x):
        return self.fc(x.mean((2, 3)))


def test_the_objective_repeats_its_draws_for_the_same_step_and_rank():
    cfg = with_overrides("debug", ["train.mixup_alpha=0.5", "train.cutmix_alpha=1.0", "model.num_classes=5",
                                   "train.label_smoothing=0.1"])
    obj, model = objective_for(cfg), _Linear()
    x, y = _batch(side=16)
    losses = {}
    for step, rank in [(3, 0), (3, 1), (4, 0), (3, 0)]:
        obj.at_step(step, rank)
        losses.setdefault((step, rank), []).append(obj.loss(model, x, y).item())
    assert losses[(3, 0)][0] == losses[(3, 0)][1]
    assert len({losses[(3, 0)][0], losses[(3, 1)][0], losses[(4, 0)][0]}) == 3


def test_sigmoid_loss_is_a_per_class_binary_cross_entropy_summed_and_top1_counts_the_argmax():
    model, (x, y) = _Linear(), _batch()
    logits = model(x)
    obj = Classify("sigmoid")
    want = torch.nn.functional.binary_cross_entropy_with_logits(
        logits, torch.nn.functional.one_hot(y, 5).float(), reduction="none").sum(1)
    assert obj.loss(model, x, y).item() == pytest.approx(want.mean().item(), rel=1e-6)
    sums = obj.sums(model, x, y)
    assert sums["loss_sum"] == pytest.approx(want.sum().item(), rel=1e-6)
    assert sums["correct"] == (logits.argmax(1) == y).sum().item() and sums["count"] == len(y)
