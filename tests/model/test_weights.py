"""Our export format (vitp.model.weights): write_export -> read_weights / read_config round
trips, local and file:// URIs; what source_info reads from exports, weights files, checkpoint dirs
and "scratch"; missing or wrong inputs raise InputError naming the path."""
import dataclasses
import json

import pytest
import torch

from vitp.config import ExperimentConfig
from vitp.errors import InputError
from vitp.model.vit import ViT
from vitp.model.weights import (CONFIG, WEIGHTS, SourceInfo, read_config, read_weights,
                                    source_info, write_export)


def _cfg() -> ExperimentConfig:
    cfg = ExperimentConfig(recipe="weights_test")
    return cfg.replace(model=dataclasses.replace(cfg.model, variant="mu/4", num_classes=3, head="finetune"),
                       data=dataclasses.replace(cfg.data, image_size=16))


def _model() -> ViT:
    torch.manual_seed(0)
    return ViT("mu/4", image_size=16, num_classes=3)


@pytest.mark.parametrize("uri", [False, True])
def test_write_then_read_round_trip(tmp_path, uri):
    m, cfg = _model(), _cfg()
    out = f"file://{tmp_path}/export" if uri else str(tmp_path / "export")
    assert write_export(out, m.state_dict(), cfg.to_dict(), {"step": 7, "mlflow_run_id": "r1"}) == out
    stored = json.loads((tmp_path / "export" / CONFIG).read_text())
    assert stored["_export"] == {"step": 7, "mlflow_run_id": "r1"}
    sd = read_weights(out)
    assert sd.keys() == m.state_dict().keys()
    assert all(torch.equal(sd[k], v) for k, v in m.state_dict().items())
    assert read_config(out) == cfg
    info = source_info(out)
    assert (info.kind, info.config, info.mlflow_run_id, info.step) == ("export", cfg.to_dict(), "r1", 7)
    assert (info.recipe, info.image_size) == ("weights_test", 16)
    # the weights file itself reads the config.json beside it
    file_info = source_info(f"{out}/{WEIGHTS}")
    assert file_info.kind == "file" and file_info.mlflow_run_id == "r1"
    assert read_config(f"{out}/{WEIGHTS}") == cfg
    assert torch.equal(read_weights(f"{out}/{WEIGHTS}")["cls_token"], m.cls_token.detach())


def test_source_info_of_scratch_and_a_checkpoint_dir(tmp_path):
    assert source_info("scratch") == SourceInfo(path="scratch", kind="scratch")
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "meta.json").write_text(json.dumps({"step": 20, "config": _cfg().to_dict(),
                                              "mlflow_run_id": "abc", "world_size": 2}))
    info = source_info(str(ck))
    assert (info.kind, info.step, info.mlflow_run_id, info.recipe) == ("checkpoint", 20, "abc", "weights_test")
    assert info.path == str(ck)
    assert read_config(str(ck)) == _cfg()
    with pytest.raises(InputError, match="training checkpoint.*vitp export"):
        read_weights(str(ck))


def test_pt_files_and_their_wrappers(tmp_path):
    sd = _model().state_dict()
    torch.save({"model": sd, "epoch": 3}, tmp_path / "wrapped.pt")
    torch.save(sd, tmp_path / "plain.pth")
    for name in ("wrapped.pt", "plain.pth"):
        got = read_weights(str(tmp_path / name))
        assert got.keys() == sd.keys() and torch.equal(got["pos_embed"], sd["pos_embed"])
    info = source_info(str(tmp_path / "plain.pth"))  # nothing stored beside it
    assert (info.kind, info.config, info.mlflow_run_id, info.step) == ("file", None, None, 0)


def test_missing_and_wrong_inputs_name_the_path(tmp_path):
    missing = str(tmp_path / "nope")
    for fn in (source_info, read_weights, read_config):
        with pytest.raises(InputError, match=f"{missing}: no such file or directory"):
            fn(missing)
    (tmp_path / "empty").mkdir()
    assert source_info(str(tmp_path / "empty")).kind == "directory"
    with pytest.raises(InputError, match="neither an export"):
        read_weights(str(tmp_path / "empty"))
    with pytest.raises(InputError, match="no config.json"):
        read_config(str(tmp_path / "empty"))
    (tmp_path / "w.npy").write_bytes(b"x")
    with pytest.raises(InputError, match="unknown weights format"):
        read_weights(str(tmp_path / "w.npy"))
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / CONFIG).write_text("{not json")
    with pytest.raises(InputError, match="config.json: unreadable"):
        source_info(str(tmp_path / "bad"))


def test_export_of_a_missing_checkpoint_is_an_input_error(tmp_path):
    """`vitp export BAD_PATH` ends in one line naming the path, not a traceback."""
    from vitp.train.export import export, load_model

    with pytest.raises(InputError, match="nope: no such checkpoint directory"):
        export(str(tmp_path / "nope"), str(tmp_path / "out"))
    m = _model()
    out = write_export(str(tmp_path / "export"), m.state_dict(), _cfg().to_dict(), {"step": 1})
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(load_model(out)(x), m.eval()(x))
