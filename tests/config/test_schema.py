"""Config schema: to_dict/from_dict round-trip exactly; flatten is the MLflow params view."""
from vitp.config import ExperimentConfig, apply_overrides, flatten, valid_keys
from vitp.recipes import debug


def test_round_trip_exact():
    cfg = apply_overrides(debug(), ["data.mean=0.1,0.2,0.3", "model.representation_size=7"])
    d = cfg.to_dict()
    back = ExperimentConfig.from_dict(d)
    assert back == cfg
    assert back.to_dict() == d


def test_flatten_for_mlflow():
    flat = flatten(debug().to_dict())
    assert flat["optim.lr"] == 1e-3 and flat["parallel.zero_stage"] == 2
    assert set(valid_keys()) <= set(flat)
