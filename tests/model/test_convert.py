"""Weight conversion: official .npz against an independent numpy forward, HF against the real
transformers ViT, ours <-> timm naming, and `import_weights` export dirs that load_model reads."""
import json

import numpy as np
import pytest
import torch
from scipy.special import erf

from vitp.model.convert import (IMPORT_FORMATS, detect_format, export_timm, from_hf,
                                    from_official_npz, from_timm, import_weights, to_timm)
from vitp.model.vit import ViT
from vitp.model.weights import read_config
from vitp.train.export import load_model

# float32 against a float64 reference or another implementation, on the depth-2 pico models used here:
# tests/numerics.py's derived tolerance, 2 * eps32 * sqrt(fan-in 192 * 14 layers) * |y| ~2 = 9e-6,
# rounded up (measured 0 to 5e-7 across CPUs). Deep models take f32_tolerance(model, y) instead.
ATOL = 1e-5


# ----------------------------------------------------------------------------- official .npz


def official_npz(depth=2, width=64, mlp=128, heads=4, patch=8, grid=4, classes=7, rep=48, seed=0,
                 in_chans=3):
    """Random weights in the google-research/vision_transformer key layout and shapes (a hybrid's
    embedding reads `in_chans` ResNet channels)."""
    rng = np.random.default_rng(seed)
    d = width // heads

    def r(*shape, s=0.1):
        return (rng.standard_normal(shape) * s).astype(np.float32)

    w = {
        "embedding/kernel": r(patch, patch, in_chans, width, s=0.05),  # HWIO
        "embedding/bias": r(width),
        "cls": r(1, 1, width),
        "Transformer/posembed_input/pos_embedding": r(1, grid * grid + 1, width),
        "Transformer/encoder_norm/scale": 1 + r(width),
        "Transformer/encoder_norm/bias": r(width),
        "pre_logits/kernel": r(width, rep),
        "pre_logits/bias": r(rep),
        "head/kernel": r(rep, classes),
        "head/bias": r(classes),
    }
    for i in range(depth):
        b = f"Transformer/encoderblock_{i}/"
        mha = b + "MultiHeadDotProductAttention_1/"
        for n in ("query", "key", "value"):
            w[f"{mha}{n}/kernel"] = r(width, heads, d)
            w[f"{mha}{n}/bias"] = r(heads, d)
        w[mha + "out/kernel"] = r(heads, d, width)
        w[mha + "out/bias"] = r(width)
        for ln in ("LayerNorm_0", "LayerNorm_2"):
            w[f"{b}{ln}/scale"] = 1 + r(width)
            w[f"{b}{ln}/bias"] = r(width)
        w[b + "MlpBlock_3/Dense_0/kernel"] = r(width, mlp)
        w[b + "MlpBlock_3/Dense_0/bias"] = r(mlp)
        w[b + "MlpBlock_3/Dense_1/kernel"] = r(mlp, width)
        w[b + "MlpBlock_3/Dense_1/bias"] = r(width)
    return w


def reference_forward(w, img):
    """The official ViT written out in numpy from the .npz layout (float64): patches as a
    reshape + matmul with the HWIO kernel, attention as einsums over the (D, H, d) kernels."""
    w = {k: v.astype(np.float64) for k, v in w.items()}
    B, H, W, C = img.shape
    P, D = w["embedding/kernel"].shape[0], w["embedding/kernel"].shape[-1]
    gh, gw = H // P, W // P
    x = img.reshape(B, gh, P, gw, P, C).transpose(0, 1, 3, 2, 4, 5).reshape(B, gh * gw, P * P * C)
    x = x @ w["embedding/kernel"].reshape(P * P * C, D) + w["embedding/bias"]  # (B, N, D)
    x = np.concatenate([np.broadcast_to(w["cls"], (B, 1, D)), x], axis=1)
    x = x + w["Transformer/posembed_input/pos_embedding"]

    def ln(z, pre):
        mu, var = z.mean(-1, keepdims=True), z.var(-1, keepdims=True)
        return (z - mu) / np.sqrt(var + 1e-6) * w[pre + "/scale"] + w[pre + "/bias"]

    i = 0
    while f"Transformer/encoderblock_{i}/LayerNorm_0/scale" in w:
        b = f"Transformer/encoderblock_{i}/"
        m = b + "MultiHeadDotProductAttention_1/"
        y = ln(x, b + "LayerNorm_0")
        q, k, v = (np.einsum("bnd,dhk->bnhk", y, w[f"{m}{n}/kernel"]) + w[f"{m}{n}/bias"]
                   for n in ("query", "key", "value"))
        logits = np.einsum("bqhk,bshk->bhqs", q, k) / np.sqrt(q.shape[-1])
        a = np.exp(logits - logits.max(-1, keepdims=True))
        a /= a.sum(-1, keepdims=True)
        o = np.einsum("bhqs,bshk->bqhk", a, v)
        x = x + np.einsum("bqhk,hkd->bqd", o, w[m + "out/kernel"]) + w[m + "out/bias"]
        y = ln(x, b + "LayerNorm_2")
        h = y @ w[b + "MlpBlock_3/Dense_0/kernel"] + w[b + "MlpBlock_3/Dense_0/bias"]
        h = 0.5 * h * (1 + erf(h / np.sqrt(2)))  # exact GELU, as vitp.model.ViT
        x = x + h @ w[b + "MlpBlock_3/Dense_1/kernel"] + w[b + "MlpBlock_3/Dense_1/bias"]
        i += 1
    x = ln(x, "Transformer/encoder_norm")[:, 0]
    x = np.tanh(x @ w["pre_logits/kernel"] + w["pre_logits/bias"])
    return x @ w["head/kernel"] + w["head/bias"]


def images(B=3, size=32, seed=1):
    return np.random.default_rng(seed).uniform(-1, 1, (B, size, size, 3))  # NHWC


def ours(x_nhwc):
    return torch.from_numpy(x_nhwc).float().permute(0, 3, 1, 2).contiguous()


def test_official_npz_matches_independent_numpy_forward(tmp_path):
    w = official_npz()
    np.savez(tmp_path / "vit.npz", **w)
    sd, info = from_official_npz(str(tmp_path / "vit.npz"))
    assert info["variant"] == "pico/8" and info["heads"] == 4 and info["image_size"] == 32
    assert info["num_classes"] == 7 and info["representation_size"] == 48 and info["head"] == "pretrain"
    m = ViT("pico/8", image_size=32, num_classes=7, head="pretrain", representation_size=48)
    m.load_state_dict(sd)
    x = images()
    ref = reference_forward(w, x)
    with torch.no_grad():
        got = m.eval()(ours(x)).double().numpy()
    assert np.abs(ref).max() > 0.1  # a real signal, not all-zero logits
    np.testing.assert_allclose(got, ref, atol=ATOL, rtol=0)


def test_official_npz_prefixes_and_big_vision_layout():
    w = official_npz(seed=3)
    sd, _ = from_official_npz(w)
    sd_prefixed, _ = from_official_npz({"opt/target/" + k: v for k, v in w.items()})
    rename = {"MultiHeadDotProductAttention_1": "MultiHeadDotProductAttention_0",
              "LayerNorm_2": "LayerNorm_1", "MlpBlock_3": "MlpBlock_0",
              "Transformer/posembed_input/pos_embedding": "pos_embedding"}
    bv = {}
    for k, v in w.items():
        for a, b in rename.items():
            k = k.replace(a, b)
        bv["params/" + k] = v
    sd_bv, info = from_official_npz(bv)
    assert info["format"] == "npz-big_vision"
    for other in (sd_prefixed, sd_bv):
        assert other.keys() == sd.keys()
        for k in sd:
            assert torch.equal(sd[k], other[k]), k


def test_import_npz_writes_an_export_dir_load_model_reads(tmp_path):
    w = official_npz(seed=4)
    np.savez(tmp_path / "ViT-pico_8.npz", **w)
    out = import_weights(str(tmp_path / "ViT-pico_8.npz"), str(tmp_path / "imported"))
    cfg = read_config(out)
    assert (cfg.model.variant, cfg.model.num_classes, cfg.model.head, cfg.model.representation_size,
            cfg.data.image_size) == ("pico/8", 7, "pretrain", 48, 32)
    x = images(seed=5)
    with torch.no_grad():
        got = load_model(out)(ours(x)).double().numpy()
    np.testing.assert_allclose(got, reference_forward(w, x), atol=ATOL, rtol=0)

    # a higher resolution resamples the grid; a new class count gives a zero head
    out48 = import_weights(str(tmp_path / "ViT-pico_8.npz"), str(tmp_path / "i48"), image_size=48,
                           num_classes=3)
    m48 = load_model(out48)
    assert m48.pos_embed.shape == (1, 37, 64) and m48.image_size == 48
    assert torch.count_nonzero(m48.head.weight) == 0 and m48.head.weight.shape == (3, 48)
    notes = json.load(open(f"{out48}/config.json"))["_export"]["notes"]
    assert any("resampled" in n for n in notes)


def test_npz_with_unknown_shape_names_the_variant_table():
    w = official_npz(width=48, heads=4, mlp=96)
    with pytest.raises(ValueError, match="VARIANTS"):
        from_official_npz(w)


# ----------------------------------------------------------------------------- Hugging Face

import transformers  # noqa: E402  (a dev dependency: compared against the real HF ViT)


def hf_config(num_labels=5):
    return transformers.ViTConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        image_size=32, patch_size=8, num_channels=3, layer_norm_eps=1e-6, num_labels=num_labels,
        hidden_act="gelu", qkv_bias=True)


def perturb(model, seed=0):
    """Random init sets LayerNorms to 1/0 and the head to small values: move every parameter
    so that a swapped norm or a transposed weight cannot go unnoticed."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model.eval()


def test_hf_image_classification_same_logits(tmp_path):
    torch.manual_seed(0)
    hf = perturb(transformers.ViTForImageClassification(hf_config()))
    sd = from_hf(hf.state_dict())
    m = ViT("pico/8", image_size=32, num_classes=5, head="finetune")
    m.load_state_dict(sd)
    x = ours(images(seed=2))
    with torch.no_grad():
        ref = hf(pixel_values=x).logits
        got = m.eval()(x)
    assert ref.abs().max() > 0.05
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)

    # a save_pretrained directory (vit.-prefixed safetensors + HF config.json) imports too
    hf.save_pretrained(tmp_path / "hf")
    out = import_weights(str(tmp_path / "hf"), str(tmp_path / "imported"))
    assert read_config(out).model.head == "finetune"
    with torch.no_grad():
        torch.testing.assert_close(load_model(out)(x), ref, atol=ATOL, rtol=0)


def test_hf_vitmodel_pooler_is_our_pre_logits():
    torch.manual_seed(1)
    hf = perturb(transformers.ViTModel(hf_config(), add_pooling_layer=True), seed=1)
    ours_sd = from_hf(hf.state_dict())  # ViTModel keys carry no "vit." prefix
    assert "head.weight" not in ours_sd and "pre_logits.0.weight" in ours_sd
    m = ViT("pico/8", image_size=32, num_classes=3, head="pretrain")
    ours_sd["head.weight"], ours_sd["head.bias"] = m.head.weight.detach(), m.head.bias.detach()
    m.load_state_dict(ours_sd)
    x = ours(images(seed=4))
    with torch.no_grad():
        out = hf(pixel_values=x)
        feats = m.eval().forward_features(x)
        torch.testing.assert_close(feats, out.last_hidden_state, atol=ATOL, rtol=0)
        torch.testing.assert_close(m.forward_head(feats, pre_logits=True), out.pooler_output,
                                   atol=ATOL, rtol=0)


def test_our_export_as_a_hugging_face_dir_gives_transformers_the_same_logits(tmp_path):
    """`vitp export --format hf`: a fine-tuned ViT as ViTForImageClassification (from_pretrained
    reads it) computes our function: float64 to roundoff, float32 within ATOL; the naming round-trips
    through from_hf exactly; heads HF's ViT lacks are refused in one line."""
    from vitp.model.convert_hf import export_hf
    from vitp.model.convert_hf import to_hf
    from vitp.model.vit import build_vit
    from vitp.model.weights import write_export
    from vitp.recipes import resolve

    cfg = resolve("debug_finetune", check_paths=False)  # pico/8 at 48 px, fine-tuning head, 10 classes
    torch.manual_seed(3)
    m = perturb(build_vit(cfg.model, cfg.data.image_size))
    sd = m.state_dict()
    back = from_hf(to_hf(sd))
    assert back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd)

    exp = write_export(str(tmp_path / "export"), sd, cfg.to_dict(), {})
    out = export_hf(exp, str(tmp_path / "hf"))
    hf = transformers.ViTForImageClassification.from_pretrained(out).eval()
    assert hf.config.num_labels == cfg.model.num_classes and hf.config.image_size == cfg.data.image_size
    x = ours(images(size=cfg.data.image_size, seed=5))
    with torch.no_grad():
        ref = m(x)
        assert ref.abs().max() > 0.05
        torch.testing.assert_close(hf(pixel_values=x).logits, ref, atol=ATOL, rtol=0)
        torch.testing.assert_close(hf.double()(pixel_values=x.double()).logits, m.double()(x.double()),
                                   atol=1e-9, rtol=0)

    pretrain = resolve("debug", check_paths=False)  # the tanh pre-logits head
    exp = write_export(str(tmp_path / "pretrain"), build_vit(pretrain.model, 32).state_dict(), pretrain.to_dict(), {})
    with pytest.raises(ValueError, match="has no counterpart for the pre-training head"):
        export_hf(exp, str(tmp_path / "hf2"))


def test_an_export_names_the_classes_of_the_shards_it_trained_on_and_hugging_face_gets_them(tmp_path):
    """class_names: the training shards' classes.json by label, None where it is gone or does not
    match the head; an export that records them gives HF's config its id2label."""
    from vitp.model.convert_hf import export_hf
    from vitp.model.vit import build_vit
    from vitp.model.weights import source_info, write_export
    from vitp.recipes import resolve
    from vitp.train.export import class_names

    cfg = resolve("debug_finetune", [f"data.shards={tmp_path / 'shards'}"], check_paths=False)  # 10 classes
    assert class_names(cfg.to_dict()) is None  # no shards (any more)
    names = [f"kind-{i}" for i in range(10)]
    (tmp_path / "shards").mkdir()
    (tmp_path / "shards" / "classes.json").write_text(json.dumps({n: i for i, n in reversed(list(enumerate(names)))}))
    assert class_names(cfg.to_dict()) == names
    assert class_names(resolve("debug_finetune", [f"data.shards={tmp_path / 'shards'}", "model.num_classes=9"],
                               check_paths=False).to_dict()) is None  # another head: not these names
    exp = write_export(str(tmp_path / "export"), build_vit(cfg.model, cfg.data.image_size).state_dict(),
                       cfg.to_dict(), {"classes": names})
    assert source_info(exp).classes == names
    hf = json.loads((tmp_path / "hf" / "config.json").read_text()) if export_hf(exp, str(tmp_path / "hf")) else {}
    assert hf["id2label"] == {str(i): n for i, n in enumerate(names)} and hf["label2id"]["kind-3"] == 3


def test_hf_unknown_keys_are_named():
    with pytest.raises(ValueError, match="decoder"):
        from_hf({"decoder.0.weight": torch.zeros(1)})


# ----------------------------------------------------------------------------- timm naming


def test_ours_to_timm_and_back_same_logits(tmp_path):
    torch.manual_seed(0)
    m = perturb(ViT("pico/8", image_size=32, num_classes=6, head="pretrain", representation_size=40))
    x = ours(images(seed=6))
    with torch.no_grad():
        ref = m(x)
    t = to_timm(m.state_dict())
    assert "pre_logits.fc.weight" in t and "blocks.1.attn.qkv.weight" in t and "head.weight" in t
    assert not any(k.startswith("pre_logits.0") for k in t)
    assert detect_format(t) == "timm"
    back = ViT("pico/8", image_size=32, num_classes=6, head="pretrain", representation_size=40)
    back.load_state_dict(from_timm(t))
    with torch.no_grad():
        torch.testing.assert_close(back.eval()(x), ref, atol=ATOL, rtol=0)

    # file level: timm's own ViT has no pre-logits layer (its loader drops one and the classifier would
    # read other features), so a pre-training head leaves for timm headless only
    from safetensors.torch import save_file

    exp = tmp_path / "export"
    exp.mkdir()
    save_file(m.state_dict(), str(exp / "model.safetensors"))
    with pytest.raises(ValueError, match="no layer for the pre-training head's tanh pre-logits: add --headless"):
        export_timm(str(exp), str(tmp_path / "timm" / "vit.safetensors"))
    assert not (tmp_path / "timm").exists()


def test_a_fine_tuned_export_is_timms_own_vision_transformer_with_the_same_logits(tmp_path):
    """`vitp export --format timm`'s file of a fine-tuning-head model loads strictly into timm's
    VisionTransformer built from the variant's numbers (not our naming checked against itself),
    which computes our logits; the same file imports back to a model with them."""
    import os
    import sys

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from safetensors.torch import load_file, save_file
    from timm_compat import import_timm

    from vitp.model.variants import decode_variant

    import_timm()
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    m = perturb(ViT("pico/8", image_size=32, num_classes=6))
    x = ours(images(seed=7))
    with torch.no_grad():
        ref = m(x)
    exp = tmp_path / "export"
    exp.mkdir()
    save_file(m.state_dict(), str(exp / "model.safetensors"))
    timm_file = export_timm(str(exp), str(tmp_path / "timm" / "vit.safetensors"))
    spec = decode_variant("pico/8")
    theirs = VisionTransformer(img_size=32, patch_size=spec.patch, embed_dim=spec.width, depth=spec.depth,
                               num_heads=spec.heads, mlp_ratio=spec.mlp_dim / spec.width, num_classes=6).eval()
    theirs.load_state_dict(load_file(timm_file), strict=True)  # every key, every shape
    with torch.no_grad():
        torch.testing.assert_close(theirs(x), ref, atol=ATOL, rtol=0)  # two implementations: ATOL above
        back = load_model(import_weights(timm_file, str(tmp_path / "back")))(x)
    assert torch.equal(back, ref)  # renamed weights into our own model: the same kernels, bit for bit


def test_a_pre_trained_backbone_leaves_headless_for_timm_and_hugging_face(tmp_path):
    """--headless: timm's own VisionTransformer with num_classes=0 loads the file strictly and gives
    our class token's features; HF's ViTModel gives them as last_hidden_state and, as pooler_output,
    the features our classifier reads: the tanh pre-logits of a pre-training head, the class token
    of a fine-tuned one (an identity pooler). Both directories take images as evaluation does."""
    import os
    import sys

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from safetensors.torch import load_file
    from timm_compat import import_timm

    from vitp.model.convert_hf import export_hf
    from vitp.model.variants import decode_variant
    from vitp.model.vit import build_vit
    from vitp.model.weights import write_export
    from vitp.recipes import resolve

    import_timm()
    from timm.models.vision_transformer import VisionTransformer

    for recipe in ("debug", "debug_finetune"):  # the pre-training head (pre-logits 2x wider), fine-tuned
        cfg = resolve(recipe, ["model.representation_size=128"] if recipe == "debug" else [], check_paths=False)
        torch.manual_seed(4)
        m = perturb(build_vit(cfg.model, cfg.data.image_size))
        exp = write_export(str(tmp_path / recipe), m.state_dict(), cfg.to_dict(), {})
        x = ours(images(size=cfg.data.image_size, seed=8))
        with torch.no_grad():
            feats = m.forward_features(x)
            pre = m.forward_head(feats, pre_logits=True)
        assert pre.shape[1] == (128 if recipe == "debug" else feats.shape[2])

        timm_file = export_timm(exp, str(tmp_path / f"{recipe}-timm.safetensors"), headless=True)
        spec = decode_variant(cfg.model.variant)
        theirs = VisionTransformer(img_size=cfg.data.image_size, patch_size=spec.patch, embed_dim=spec.width,
                                   depth=spec.depth, num_heads=spec.heads, mlp_ratio=spec.mlp_dim / spec.width,
                                   num_classes=0).eval()
        theirs.load_state_dict(load_file(timm_file), strict=True)  # every key, every shape, no head
        hf_dir = export_hf(exp, str(tmp_path / f"{recipe}-hf"), headless=True)
        hf = transformers.ViTModel.from_pretrained(hf_dir).eval()
        with torch.no_grad():
            torch.testing.assert_close(theirs(x), feats[:, 0], atol=ATOL, rtol=0)
            out = hf(pixel_values=x)
            torch.testing.assert_close(out.last_hidden_state, feats, atol=ATOL, rtol=0)
            torch.testing.assert_close(out.pooler_output, pre, atol=ATOL, rtol=0)
        prep = json.loads((tmp_path / f"{recipe}-hf" / "preprocessor_config.json").read_text())
        assert prep["crop_size"] == {"height": cfg.data.image_size, "width": cfg.data.image_size}
        assert prep["image_mean"] == list(cfg.data.mean) and prep["image_std"] == list(cfg.data.std)


def test_timm_features_we_lack_are_rejected():
    sd = to_timm(ViT("mu/4", image_size=16, num_classes=2).state_dict())
    sd["fc_norm.weight"] = torch.ones(32)
    with pytest.raises(ValueError, match="fc_norm"):
        from_timm(sd)


# ----------------------------------------------------------------------------- --format values


def _source_in(fmt, tmp_path):
    """(weights path in format `fmt`, images, the logits the imported model must give)."""
    x = images(seed=7)
    if fmt == "npz":
        w = official_npz(seed=8)
        np.savez(tmp_path / "vit.npz", **w)
        return str(tmp_path / "vit.npz"), ours(x), torch.from_numpy(reference_forward(w, x)).float()
    if fmt == "hf":
        torch.manual_seed(2)
        hf = perturb(transformers.ViTForImageClassification(hf_config()), seed=2)
        hf.save_pretrained(tmp_path / "hf")
        with torch.no_grad():
            return str(tmp_path / "hf"), ours(x), hf(pixel_values=ours(x)).logits
    torch.manual_seed(3)
    m = perturb(ViT("pico/8", image_size=32, num_classes=6, head="pretrain", representation_size=40), seed=3)
    with torch.no_grad():
        ref = m(ours(x))
    if fmt == "timm":
        from safetensors.torch import save_file

        save_file(to_timm(m.state_dict()), str(tmp_path / "timm.safetensors"))
        return str(tmp_path / "timm.safetensors"), ours(x), ref
    from vitp.config import ExperimentConfig
    from vitp.model.weights import write_export

    out = write_export(str(tmp_path / "ours"), m.state_dict(), ExperimentConfig().to_dict(), {"step": 1})
    return out, ours(x), ref


@pytest.mark.parametrize("fmt", [f for f in IMPORT_FORMATS if f != "auto"])
def test_each_explicit_format_imports(tmp_path, fmt):
    """`vitp import --format FMT` for every named format: the importer accepts exactly the
    names the CLI offers, and the imported model gives the source's logits."""
    src, x, ref = _source_in(fmt, tmp_path)
    out = import_weights(src, str(tmp_path / "imported"), fmt=fmt)
    assert json.load(open(f"{out}/config.json"))["_export"]["format"].startswith(fmt)
    with torch.no_grad():
        torch.testing.assert_close(load_model(out)(x), ref, atol=ATOL, rtol=0)


def test_unknown_format_names_the_choices(tmp_path):
    src, _, _ = _source_in("timm", tmp_path)
    with pytest.raises(ValueError, match="auto, npz, timm, hf, ours"):
        import_weights(src, str(tmp_path / "out"), fmt="official")
