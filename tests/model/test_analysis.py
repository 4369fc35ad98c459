"""The paper's Figure 7 report: filter PCs, position-embedding similarity against grid distance
(hand-built embeddings with and without spatial structure), and `vitp analyze` on an export."""
import json

import numpy as np
import pytest
import torch
from PIL import Image

from vitp import cli
from vitp.model.analysis import (COMPONENTS, filter_components, pos_embed_similarity,
                                     save_filter_grid, save_similarity_grid, similarity_mosaic,
                                     similarity_vs_distance, summary_lines, write_report)
from vitp.model.attention import mean_attention_distance
from vitp.model.vit import ViT
from vitp.model.weights import write_export
from vitp.recipes import resolve


def rbf_pos_embed(g: int, anchors: int = 12, sigma: float = 1.5) -> torch.Tensor:
    """(g*g, anchors^2) embeddings that are Gaussian bumps around each patch's grid position,
    read at a lattice of anchor points: their cosine similarity falls with grid distance."""
    ys, xs = torch.meshgrid(torch.arange(g), torch.arange(g), indexing="ij")
    pos = torch.stack([ys.flatten(), xs.flatten()], -1).double()  # (N, 2), row-major
    a = torch.linspace(-1, g, anchors, dtype=torch.float64)
    ay, ax = torch.meshgrid(a, a, indexing="ij")
    centres = torch.stack([ay.flatten(), ax.flatten()], -1)  # (A, 2)
    return torch.exp(-torch.cdist(pos, centres) ** 2 / (2 * sigma**2)).float()  # (N, A)


# ----------------------------------------------------------------------------- filters


def test_filter_components_recover_the_patterns_the_filters_are_made_of():
    g = torch.Generator().manual_seed(0)
    P, D = 4, 96
    patterns = torch.randn(2, 3, P, P, generator=g)  # two RGB patterns
    coef = torch.randn(D, 2, generator=g) * torch.tensor([5.0, 2.0])  # first pattern dominates
    w = torch.einsum("dk,kcyx->dcyx", coef, patterns) + 0.01 * torch.randn(D, 3, P, P, generator=g)
    comps, ratio = filter_components(w)
    assert comps.shape == (COMPONENTS, P, P, 3)
    assert comps.min() >= 0 and comps.max() <= 1
    np.testing.assert_allclose(comps.min(axis=(1, 2, 3)), 0, atol=1e-12)
    np.testing.assert_allclose(comps.max(axis=(1, 2, 3)), 1, atol=1e-12)
    assert ratio.shape == (min(D, 3 * P * P),) and ratio.sum() == pytest.approx(1.0)
    assert np.all(np.diff(ratio) <= 1e-12)  # sorted, largest first
    assert ratio[:2].sum() > 0.99  # two patterns + a little noise: two components carry it
    # the first component is the dominant pattern (as a picture, up to sign and display scaling)
    first = torch.from_numpy(comps[0]).permute(2, 0, 1).flatten().double()
    target = patterns[0].flatten().double()
    r = np.corrcoef(first.numpy(), target.numpy())[0, 1]
    assert abs(r) > 0.9, f"first PC vs dominant pattern: r = {r:.3f}"


def test_fewer_filters_than_components_and_wrong_input():
    comps, ratio = filter_components(torch.randn(10, 3, 2, 2))
    assert comps.shape == (10, 2, 2, 3) and ratio.shape == (10,)
    with pytest.raises(ValueError, match=r"\(D, 3, P, P\)"):
        filter_components(torch.randn(10, 4, 2, 2))


def test_filter_grid_png_lays_out_rows_of_seven(tmp_path):
    comps = np.random.default_rng(0).random((COMPONENTS, 4, 4, 3))
    path = save_filter_grid(comps, str(tmp_path / "f.png"), cols=7, cell=64, pad=4)
    with Image.open(path) as im:
        assert im.size == (4 + 7 * (64 + 4), 4 + 4 * (64 + 4))  # 7 columns, 4 rows of 64 px tiles
        px = np.asarray(im.convert("RGB"))
    # tile 8 = row 1, column 1; its pixel (0, 0) of the 16x-upscaled filter is comps[8][0, 0]
    y = x = 4 + 68
    np.testing.assert_allclose(px[y + 5, x + 5] / 255.0, comps[8][0, 0], atol=1 / 255)
    np.testing.assert_allclose(px[y + 63, x + 63] / 255.0, comps[8][3, 3], atol=1 / 255)


# --------------------------------------------------------------------- position embedding


def test_similarity_grid_puts_each_patch_map_in_its_tile(tmp_path):
    g = 3
    sim = pos_embed_similarity(torch.randn(g * g, 16, generator=torch.Generator().manual_seed(0)))
    np.testing.assert_allclose(np.diag(sim), 1.0)
    mosaic = similarity_mosaic(sim, g)
    assert mosaic.shape == (g * (g + 1) - 1,) * 2
    for i in range(g):
        for j in range(g):
            tile = mosaic[i * (g + 1):i * (g + 1) + g, j * (g + 1):j * (g + 1) + g]
            np.testing.assert_array_equal(tile, sim[i * g + j].reshape(g, g))
            assert tile[i, j] == pytest.approx(1.0)  # a patch is most similar to itself
    assert np.isnan(mosaic[g, :]).all() and np.isnan(mosaic[:, g]).all()  # gaps between tiles
    with Image.open(save_similarity_grid(sim, g, str(tmp_path / "s.png"))) as im:
        assert im.size[0] > 300 and im.size[1] > 300


def test_similarity_falls_with_distance_on_a_spatial_embedding_and_not_on_a_random_one():
    g = 8
    spatial = similarity_vs_distance(pos_embed_similarity(rbf_pos_embed(g)), g)
    assert spatial["distance_corr"] < -0.8, spatial
    assert spatial["neighbour_similarity"] > spatial["other_similarity"] + 0.3, spatial
    rand = similarity_vs_distance(pos_embed_similarity(torch.randn(g * g, 256, generator=torch.Generator().manual_seed(0))), g)
    assert abs(rand["distance_corr"]) < 0.15, rand
    assert abs(rand["neighbour_similarity"] - rand["other_similarity"]) < 0.05, rand
    # constant embeddings carry no position: the correlation is undefined, not a number
    assert similarity_vs_distance(np.ones((g * g, g * g)), g)["distance_corr"] is None
    with pytest.raises(ValueError, match="grid 3x3"):
        similarity_vs_distance(np.ones((4, 4)), 3)


# ------------------------------------------------------------------------------ report


def test_report_of_a_vit_with_a_spatial_pos_embed(tmp_path):
    torch.manual_seed(0)
    m = ViT("pico/8", image_size=64, num_classes=3, head="pretrain")  # 8x8 grid
    with torch.no_grad():  # a spatial embedding, projected to the model width
        m.pos_embed[0, 1:] = rbf_pos_embed(8) @ torch.linalg.qr(torch.randn(144, 64))[0]
    x = torch.randn(3, 3, 64, 64)
    report = write_report(m, str(tmp_path), x)
    assert report["pos_embed"]["distance_corr"] < -0.8
    assert report["patch_embed"]["components"] == COMPONENTS
    assert len(report["patch_embed"]["explained_variance"]) == COMPONENTS
    np.testing.assert_allclose(report["attention_distance"]["pixels"], mean_attention_distance(m, x).numpy(), rtol=1e-6)
    assert sorted(report["files"]) == ["attention_distance.png", "patch_embed_pcs.png", "pos_embed_similarity.png"]
    for name in report["files"]:
        with Image.open(tmp_path / name) as im:
            assert im.format == "PNG"
    assert json.loads((tmp_path / "analysis.json").read_text()) == json.loads(json.dumps(report))
    lines = summary_lines(report)
    assert len(lines) == 3 and f"r = {report['pos_embed']['distance_corr']:+.3f}" in lines[1], lines


def test_a_non_rgb_patch_embedding_is_skipped_not_fatal(tmp_path):
    m = ViT("pico/8", image_size=32, num_classes=3, in_chans=64)  # a hybrid's feature channels
    report = write_report(m, str(tmp_path))
    assert "64 input channels" in report["patch_embed"]["skipped"]
    assert "skipped" in report["attention_distance"]
    assert report["files"] == ["pos_embed_similarity.png"]
    assert summary_lines(report)[0].startswith("patch-embedding filters: skipped: ")


def test_a_hybrid_shows_its_resnet_root_filters(tmp_path):
    m = ViT("R+pico/8", image_size=32, num_classes=3)
    report = write_report(m, str(tmp_path), images=torch.randn(2, 3, 32, 32))
    assert report["patch_embed"]["filters"] == "resnet root conv"
    root = m.patch_embed.backbone.stem.conv.standardized()  # 32 filters of 7x7 RGB
    comps, ratio = filter_components(root)
    assert report["patch_embed"]["explained_variance"] == pytest.approx(ratio[:len(comps)].tolist())
    assert (tmp_path / "patch_embed_pcs.png").exists() and report["model"]["pixels_per_token"] == 8


# --------------------------------------------------------------------------- vitp analyze


@pytest.fixture
def export_dir(tmp_path):
    """An export of a random pico/8 at 32 px with the debug recipe's config (its shards absent)."""
    cfg = resolve("debug", [f"work_dir={tmp_path / 'work'}"])
    torch.manual_seed(0)
    m = ViT("pico/8", image_size=32, num_classes=10, head="pretrain")
    return write_export(str(tmp_path / "export"), m.state_dict(), cfg.to_dict(), {"step": 0})


def test_vitp_analyze_writes_the_report(tmp_path, export_dir, capsys):
    images = []
    for i in range(2):
        p = tmp_path / f"img{i}.png"
        Image.fromarray(np.random.default_rng(i).integers(0, 256, (40, 50, 3), dtype=np.uint8)).save(p)
        images += ["--image", str(p)]
    out = tmp_path / "report"
    assert cli.main(["analyze", export_dir, "--out", str(out), *images]) == 0
    printed = capsys.readouterr().out
    report = json.loads((out / "analysis.json").read_text())
    assert report["attention_distance"]["images"] == 2
    assert report["model"]["grid"] == [4, 4] and report["model"]["variant"] == "pico/8"
    for name in report["files"]:
        assert (out / name).stat().st_size > 0 and str(out / name) in printed
    assert "position embeddings: similarity vs grid distance r = " in printed
    # --images 0: no images needed, the attention figure is left out and says so
    assert cli.main(["analyze", export_dir, "--out", str(tmp_path / "r0"), "--images", "0"]) == 0
    assert "mean attention distance: skipped" in capsys.readouterr().out
    assert not (tmp_path / "r0" / "attention_distance.png").exists()


def test_vitp_analyze_errors_name_the_input_and_the_fix(tmp_path, export_dir, capsys):
    # default: images from the run's shards, which this export's run never wrote: the rest of
    # the report is still written, and the note says how to get the attention figure
    assert cli.main(["analyze", export_dir, "--out", str(tmp_path / "r")]) == 0
    out = capsys.readouterr().out
    assert "no images for the attention distances: no shards at " in out and "--image FILE" in out
    assert (tmp_path / "r" / "pos_embed_similarity.png").exists()
    assert not (tmp_path / "r" / "attention_distance.png").exists()
    assert cli.main(["analyze", export_dir, "--image", str(tmp_path / "none.jpg")]) == 2
    assert "none.jpg: no such image file" in capsys.readouterr().err
    assert cli.main(["analyze", str(tmp_path / "missing")]) == 2
    assert "missing: no such file or directory" in capsys.readouterr().err
