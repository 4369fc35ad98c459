"""Attention rollout and mean attention distance: exact cases on hand-built maps, and a tiny ViT
trained on a task where only one image region carries the class putting its rollout there."""
import math

import numpy as np
import pytest
import torch
from PIL import Image

from vitp.model.vit import ViT
from vitp.model.attention import (attention_distance_from_maps, attention_rollout,
                                      mean_attention_distance, plot_attention_distance,
                                      rollout_from_maps, save_rollout_png, write_rollout_pngs, VIEW_SIZE)


def test_rollout_sums_to_one_over_patches():
    torch.manual_seed(0)
    m = ViT("pico/8", image_size=32, num_classes=3, head="pretrain")
    r = attention_rollout(m, torch.randn(5, 3, 32, 32))
    assert r.shape == (5, 4, 4)
    assert (r >= 0).all()
    torch.testing.assert_close(r.sum(dim=(1, 2)), torch.ones(5))


def test_rollout_of_hand_built_maps():
    # one layer where the class token attends only to patch 5: rollout puts all mass there
    T = 1 + 9
    a = torch.zeros(1, 2, T, T)
    a[..., :, :] = torch.eye(T)
    a[:, :, 0, :] = 0
    a[:, :, 0, 1 + 5] = 1.0
    r = rollout_from_maps([a], 3)
    expected = torch.zeros(9)
    expected[5] = 1
    torch.testing.assert_close(r.flatten(), expected)
    # two layers: layer 2's class token reads patch 0, which (layer 1) reads patch 8 half the time
    a1 = torch.eye(T).repeat(1, 1, 1, 1)
    a1[0, 0, 1, :] = 0
    a1[0, 0, 1, 1] = 0.5
    a1[0, 0, 1, 9] = 0.5
    a2 = torch.zeros(1, 1, T, T)
    a2[0, 0] = torch.eye(T)
    a2[0, 0, 0, :] = 0
    a2[0, 0, 0, 1] = 1.0
    r = rollout_from_maps([a1, a2], 3).flatten()
    # rows after +I and renormalising: layer2 cls -> (cls .5, p0 .5); layer1 p0 -> (p0 .75, p8 .25)
    assert r[0] == pytest.approx(0.75) and r[8] == pytest.approx(0.25)


def test_attention_distance_exact_cases():
    g, P = 4, 8
    N = g * g
    T = N + 1
    self_only = torch.eye(T).expand(2, 3, T, T)
    d = attention_distance_from_maps([self_only, self_only], g, P)
    assert d.shape == (2, 3)
    assert torch.count_nonzero(d) == 0
    # each query attends to its horizontal neighbour: exactly one patch (P pixels) away
    right = torch.zeros(1, 1, T, T)
    right[0, 0, 0, 0] = 1
    for i in range(N):
        row, col = divmod(i, g)
        j = row * g + (col + 1 if col + 1 < g else col - 1)
        right[0, 0, 1 + i, 1 + j] = 1
    assert attention_distance_from_maps([right], g, P).item() == pytest.approx(P)
    # uniform attention over patches: the mean pairwise centre distance, computed by brute force
    uniform = torch.full((1, 1, T, T), 1.0 / T)
    pts = [(r * P, c * P) for r in range(g) for c in range(g)]
    brute = np.mean([math.dist(a, b) for a in pts for b in pts])
    assert attention_distance_from_maps([uniform], g, P).item() == pytest.approx(brute, rel=1e-6)


def test_mean_attention_distance_in_range():
    torch.manual_seed(0)
    m = ViT("pico/8", image_size=32, num_classes=3)
    d = mean_attention_distance(m, torch.randn(4, 3, 32, 32))
    assert d.shape == (2, 4)
    diagonal = math.hypot(32, 32)
    assert (d > 0).all() and (d <= diagonal).all()


# ------------------------------------------------------------------------- trained model

S, Q = 32, 16  # image size, quadrant size


def stripes_task(n: int, g: torch.Generator):
    """4 classes of stripe patterns (horizontal, vertical, diagonal, checker). The top-left
    quadrant shows the image's class; the other three show patterns of random classes, so only
    that quadrant carries the label. Returns normalised images (n, 3, S, S) and labels (n,)."""
    y = torch.randint(0, 4, (n,), generator=g)
    yy, xx = torch.meshgrid(torch.arange(Q), torch.arange(Q), indexing="ij")
    pats = torch.stack([yy // 2 % 2, xx // 2 % 2, (yy + xx) // 2 % 2, (yy // 2 + xx // 2) % 2])
    pats = pats.float() * 2 - 1  # (4, Q, Q) in {-1, 1}
    imgs = torch.zeros(n, 3, S, S)
    for k, (r, c) in enumerate([(0, 0), (0, Q), (Q, 0), (Q, Q)]):
        lab = y if k == 0 else torch.randint(0, 4, (n,), generator=g)
        imgs[:, :, r:r + Q, c:c + Q] = pats[lab][:, None]
    return imgs + 0.3 * torch.randn(imgs.shape, generator=g), y


def quadrant_mass(r: torch.Tensor) -> list[float]:
    h = r.shape[1] // 2
    return [r[:, a:a + h, b:b + h].sum(dim=(1, 2)).mean().item() for a in (0, h) for b in (0, h)]


@pytest.mark.slow
def test_rollout_highlights_the_region_that_carries_the_class(tmp_path):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    m = ViT("mu/4", image_size=S, num_classes=4, head="finetune")  # 8x8 grid of 4 px patches
    x_eval, y_eval = stripes_task(256, torch.Generator().manual_seed(1))
    before = quadrant_mass(attention_rollout(m, x_eval))
    opt = torch.optim.AdamW(m.parameters(), lr=2e-3, weight_decay=0.0)
    for _ in range(120):
        x, y = stripes_task(32, g)
        loss = torch.nn.functional.cross_entropy(m(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        acc = (m.eval()(x_eval).argmax(-1) == y_eval).float().mean().item()
    after = quadrant_mass(attention_rollout(m, x_eval))
    assert acc > 0.9, f"the model did not learn the task (top-1 {acc:.2f})"
    assert before[0] < 0.35  # untrained: about a quarter of the mass per quadrant
    assert after[0] > 0.5 and after[0] > 2 * max(after[1:]), f"quadrant mass {after}"

    # the pictures: a side-by-side PNG and the per-layer scatter
    img = ((x_eval[0].permute(1, 2, 0).clamp(-1, 1) + 1) * 127.5).to(torch.uint8).numpy()
    png = save_rollout_png(img, attention_rollout(m, x_eval[:1])[0], str(tmp_path / "rollout.png"))
    with Image.open(png) as im:
        assert im.size == (2 * VIEW_SIZE, VIEW_SIZE)  # readable, whatever the model's input size
        overlay = np.asarray(im)[:, VIEW_SIZE:].astype(float)
    # the overlay is brightest-coloured (inferno: high red) in the signal quadrant
    q = VIEW_SIZE * Q // S
    assert overlay[:q, :q, 0].mean() > overlay[q:, q:, 0].mean()
    plot = plot_attention_distance(mean_attention_distance(m, x_eval[:16]), str(tmp_path / "dist.png"))
    with Image.open(plot) as im:
        assert im.size[0] > 100


def test_picture_inputs_are_checked(tmp_path):
    with pytest.raises(ValueError, match="uint8"):
        save_rollout_png(np.zeros((8, 8, 3), np.float32), np.ones((2, 2)), str(tmp_path / "a.png"))
    with pytest.raises(ValueError, match="layers, heads"):
        plot_attention_distance(np.zeros(3), str(tmp_path / "b.png"))


def test_write_rollout_pngs_names_label_and_prediction(tmp_path):
    torch.manual_seed(0)
    m = ViT("pico/8", image_size=32, num_classes=3, head="finetune").train()
    images = np.random.default_rng(0).integers(0, 256, (2, 32, 32, 3), dtype=np.uint8)
    paths = write_rollout_pngs(m, images, [2, 0], str(tmp_path))
    assert [p.rsplit("/", 1)[1] for p in paths] == ["rollout_0_label2_pred0.png", "rollout_1_label0_pred0.png"]
    for p in paths:  # zero-init head: every logit is 0, argmax 0
        with Image.open(p) as im:
            assert im.size == (2 * VIEW_SIZE, VIEW_SIZE)
    assert m.training  # the caller's mode is left as it was
