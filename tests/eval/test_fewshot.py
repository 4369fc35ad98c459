"""Few-shot linear evaluation: the solver on synthetic features (separable -> 100%, random ->
chance, same predictions as sklearn's Ridge in both primal and dual form), Ray Data features
equal to a direct forward, digits few-shot for a trained vs a random model, the MLflow run."""
import dataclasses
import json

import numpy as np
import pytest
import torch

from vitp.config import ExperimentConfig, ModelConfig, Run
from vitp.eval.features import extract_features
from vitp.eval.fewshot import run_fewshot
from vitp.eval.solver import BIAS_FEATURE, fewshot_accuracy, lsr_accuracy

# ------------------------------------------------------------------------------- solver


def test_separable_features_give_100_percent_at_every_shot():
    rng = np.random.default_rng(0)
    K, D = 10, 32
    centres = rng.standard_normal((K, D)) * 4  # far apart relative to the noise

    def sample(n):
        y = rng.integers(0, K, n)
        return centres[y] + 0.3 * rng.standard_normal((n, D)), y

    (tx, ty), (vx, vy) = sample(500), sample(1000)
    acc = fewshot_accuracy(tx, ty, vx, vy)
    assert acc == {1: 1.0, 5: 1.0, 10: 1.0, 25: 1.0}


def test_random_features_are_near_chance():
    rng = np.random.default_rng(1)
    K = 10
    tx, vx = rng.standard_normal((500, 64)), rng.standard_normal((2000, 64))
    ty, vy = rng.integers(0, K, 500), rng.integers(0, K, 2000)
    acc = fewshot_accuracy(tx, ty, vx, vy)
    assert all(abs(a - 1 / K) < 0.05 for a in acc.values()), acc


@pytest.mark.parametrize("n", [8, 200])  # n < D+1: dual system; n > D+1: primal
def test_solver_matches_sklearn_ridge(n):
    from sklearn.linear_model import Ridge

    rng = np.random.default_rng(2)
    K, D = 4, 30
    x, y = rng.standard_normal((n, D)), np.arange(n) % K
    t = rng.standard_normal((300, D))
    # the same standardisation + bias column, then sklearn's ridge without its own intercept
    mean, std = x.mean(0), x.std(0) + 1e-5
    xs = np.pad((x - mean) / std, ((0, 0), (0, 1)), constant_values=BIAS_FEATURE)
    ts = np.pad((t - mean) / std, ((0, 0), (0, 1)), constant_values=BIAS_FEATURE)
    pred = Ridge(alpha=1024.0, fit_intercept=False).fit(xs, 2 * np.eye(K)[y] - 1).predict(ts).argmax(1)
    # scored against sklearn's predictions as labels: identical predictions give exactly 100%
    assert lsr_accuracy(x, y, t, pred, K, l2=1024.0) == 1.0


def test_missing_class_is_named():
    with pytest.raises(ValueError, match=r"classes \[2\]"):
        fewshot_accuracy(np.zeros((4, 3)), np.array([0, 1, 0, 1]), np.zeros((2, 3)), np.array([2, 0]))


# ------------------------------------------------------------------- digits and Ray Data


@pytest.fixture(scope="module")
def digits_cfg(tmp_path_factory, digits_shards):
    """sklearn digits preprocessed into shards (train / val by key hash), as debug_finetune."""
    from vitp.recipes import resolve

    return resolve("debug_finetune", [f"work_dir={tmp_path_factory.mktemp('fewshot')}",
                                      f"data.shards={digits_shards}"])


def direct_features(model, cfg, split):
    """Reference: the same eval rows forwarded in this process, no actors."""
    from vitp.data.ingest import build_eval_dataset, normalize

    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, image_size=model.image_size))
    feats, labels, keys = [], [], []
    for b in build_eval_dataset(Run.of(cfg), split).iter_batches(batch_size=256, batch_format="numpy"):
        with torch.no_grad():
            x = normalize(torch.from_numpy(np.ascontiguousarray(b["image"])))
            feats.append(model.forward_head(model.forward_features(x), pre_logits=True).numpy())
        labels.append(b["label"])
        keys.append(b["key"].astype(str))
    keys = np.concatenate(keys)
    order = np.argsort(keys, kind="stable")
    return np.concatenate(feats)[order], np.concatenate(labels)[order], keys[order]


def save_export(model, cfg_model: ModelConfig, image_size: int, out, extra=None):
    """An export dir as vitp.train.export writes it: model.safetensors + config.json."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    save_file(model.state_dict(), str(out / "model.safetensors"))
    cfg = ExperimentConfig(recipe="fewshot_test", model=cfg_model)
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, image_size=image_size))
    (out / "config.json").write_text(json.dumps({**cfg.to_dict(), "_export": extra or {"step": 7}}))
    return str(out)


@pytest.mark.long(reason="a whole Ray Train run of one feature; CI has the CLI chain's pre-training, "
                         "fine-tuning, few-shot")
@pytest.mark.ray
def test_ray_data_features_equal_direct_forward(digits_cfg, tmp_path):
    from vitp.model.vit import build_vit

    torch.manual_seed(0)
    mcfg = ModelConfig(variant="pico/8", num_classes=10, head="pretrain")
    model = build_vit(mcfg, 32).eval()
    ref_x, ref_y, ref_k = direct_features(model, digits_cfg, "val")
    # in-memory model (object ref to the actors) and an export dir (each actor loads it)
    got = extract_features(model, Run.of(digits_cfg), "val", return_keys=True)
    export = save_export(model, mcfg, 32, tmp_path / "export")
    got_path = extract_features(export, Run.of(digits_cfg), "val", concurrency=2, return_keys=True)
    for x, y, k in (got, got_path):
        assert x.shape == (len(ref_y), 64) and x.dtype == np.float32
        assert (k == ref_k).all() and (y == ref_y).all()
        np.testing.assert_allclose(x, ref_x, atol=1e-5, rtol=0)


def train_on(model, images_uint8, labels, steps, seed=0):
    """Plain-torch supervised training (AdamW, flips): the cheap 'pre-trained' model."""
    from vitp.data.ingest import normalize

    x_all, y_all = torch.from_numpy(images_uint8), torch.from_numpy(labels)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    g = torch.Generator().manual_seed(seed)
    model.train()
    for step in range(steps):
        idx = torch.randint(0, len(y_all), (32,), generator=g)
        x = normalize(x_all[idx]).contiguous()
        loss = torch.nn.functional.cross_entropy(model(x), y_all[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


@pytest.mark.long(reason="a whole Ray Train run of one feature; CI has the CLI chain's pre-training, "
                         "fine-tuning, few-shot")
@pytest.mark.ray
@pytest.mark.slow
def test_digits_fewshot_pretrained_beats_random_and_logs_to_mlflow(digits_cfg, tmp_path):
    """Prints the 1/5/10/25-shot table (pytest -s). 'Pre-trained' = 150 supervised steps on
    the digits *train* split only; the few-shot test split is the held-out val split."""
    from vitp.data.ingest import build_eval_dataset
    from vitp.model.vit import build_vit
    from vitp.tracking import find_runs
    from vitp.config import Run

    mcfg = ModelConfig(variant="pico/8", num_classes=10, head="pretrain")
    torch.manual_seed(0)
    random_model = build_vit(mcfg, 32).eval()
    train_rows = build_eval_dataset(Run.of(dataclasses.replace(digits_cfg, data=dataclasses.replace(
        digits_cfg.data, image_size=32))), "train").take_all()
    train_rows.sort(key=lambda r: r["key"])  # rows arrive in task-completion order
    imgs = np.stack([r["image"] for r in train_rows])  # (n, 32, 32, 3) uint8
    labels = np.array([r["label"] for r in train_rows])
    trained = train_on(build_vit(mcfg, 32), imgs, labels, steps=150)

    table = {}  # features forwarded in this process (the actor pool's: run_fewshot below)
    for name, m in (("random", random_model), ("pretrained", trained)):
        tx, ty, _ = direct_features(m, digits_cfg, "train")
        vx, vy, _ = direct_features(m, digits_cfg, "val")
        table[name] = fewshot_accuracy(tx, ty, vx, vy)
    print("\ndigits few-shot top-1 (pico/8 at 32 px, l2=1024, 3 seeds):")
    for name, acc in table.items():
        print(f"  {name:10s} " + "  ".join(f"{k}-shot {v:.3f}" for k, v in acc.items()))
    for k in (1, 5, 10, 25):
        assert table["pretrained"][k] > table["random"][k] + 0.1, table
    assert table["pretrained"][25] > 0.55 and table["random"][1] > 0.12  # both above 10% chance

    # the MLflow run: params, metrics at the source's step, lineage tag
    export = save_export(trained, mcfg, 32, tmp_path / "pretrained",
                         extra={"step": 150, "mlflow_run_id": "abc123"})
    out = run_fewshot(Run.of(digits_cfg), export, tracking=True)
    for k in (1, 5, 10, 25):
        # same model and data; batches may be composed differently, which can move a float32
        # feature in its last bits and, rarely, one prediction
        assert out[f"fewshot/{k}shot_top1"] == pytest.approx(table["pretrained"][k], abs=1 / len(vy))
    runs = find_runs(Run.of(digits_cfg).tracking_uri, digits_cfg.tracking.experiment,
                     "attributes.run_name = 'fewshot-fewshot_test-pico8-synthetic-digits'")
    assert [r["run_id"] for r in runs] == [out["run_id"]]
    run = runs[0]
    assert run["status"] == "FINISHED" and run["tags"]["source_run_id"] == "abc123"
    assert run["params"]["fewshot.l2"] == "1024.0" and run["params"]["fewshot.dataset"] == "digits"
    assert set(run["metrics"]) == {f"fewshot/{k}shot_top1" for k in (1, 5, 10, 25)}
