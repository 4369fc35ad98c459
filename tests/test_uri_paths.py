"""Every reader and writer of exports, imports, checkpoints, plots and shards on storage URIs:
a real S3 API (moto on 127.0.0.1, the `s3` fixture) and file:// URIs. Exports written and read
back, imports from a URI, `vitp export` / `attention` from and to URIs, synth + preprocess into
URI shards. Few-shot and fine-tuning `--from` an export and on shards in the bucket are the
rehearsal's stages 5 and 6 (tests/cluster/test_rehearsal.py)."""
import dataclasses
import io
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from vitp import storage
from vitp.cli import main
from vitp.config import ExperimentConfig
from vitp.model.attention import VIEW_SIZE
from vitp.model.convert import export_timm, import_weights
from vitp.model.vit import ViT
from vitp.model.weights import CONFIG, WEIGHTS, read_config, read_weights, source_info, write_export
from vitp.train.export import load_model
from vitp.config import Run

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "model"))
sys.path.insert(0, str(ROOT / "tests" / "train"))
from test_convert import official_npz  # noqa: E402
import workers  # noqa: E402  (module-level functions the spawned gloo processes run)


@pytest.fixture(params=["s3", "file"])
def store(request, tmp_path):
    """A fresh storage root: a prefix in a new bucket of the S3 server, or a file:// directory."""
    if request.param == "s3":
        return storage.join(request.getfixturevalue("s3").bucket(), "vit")
    return f"file://{tmp_path}/store"


def _cfg() -> ExperimentConfig:
    cfg = ExperimentConfig(recipe="uri_test")
    return cfg.replace(model=dataclasses.replace(cfg.model, variant="mu/4", num_classes=3, head="finetune"),
                       data=dataclasses.replace(cfg.data, image_size=16))


def _model() -> ViT:
    torch.manual_seed(0)
    return ViT("mu/4", image_size=16, num_classes=3)


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _png(path: str) -> tuple[int, int]:
    return Image.open(io.BytesIO(storage.read_bytes(path))).size


# --------------------------------------------------------------------------- exports, imports


def test_export_to_a_uri_reads_back_equal(store):
    m, cfg = _model(), _cfg()
    out = storage.join(store, "export")
    assert write_export(out, m.state_dict(), cfg.to_dict(), {"step": 3, "mlflow_run_id": "r1"}) == out
    assert storage.listdir(out) == [CONFIG, WEIGHTS]
    assert _same(read_weights(out), m.state_dict())
    assert _same(read_weights(storage.join(out, WEIGHTS)), m.state_dict())
    assert read_config(out) == cfg
    info = source_info(out)
    assert (info.kind, info.path, info.step, info.mlflow_run_id) == ("export", out, 3, "r1")
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(load_model(out)(x), m.eval()(x))


def test_imports_from_a_uri_equal_the_same_import_from_local_files(store, tmp_path):
    """.safetensors and .pt files, our export dir, an official .npz and a timm file written back:
    each read from the URI gives the export its local copy gives."""
    from safetensors.torch import save

    sd = _model().state_dict()
    buf = io.BytesIO()
    np.savez(buf, **official_npz(seed=5))
    pt = io.BytesIO()
    torch.save({"model": sd}, pt)
    files = {"w.safetensors": save(sd), "vit.npz": buf.getvalue(), "w.pt": pt.getvalue()}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
        storage.write_bytes(storage.join(store, "in", name), data)
    write_export(str(tmp_path / "ours"), sd, _cfg().to_dict(), {"step": 1})
    write_export(storage.join(store, "in", "ours"), sd, _cfg().to_dict(), {"step": 1})

    for name in (*files, "ours"):
        local = import_weights(str(tmp_path / name), str(tmp_path / f"imp-{name}"))
        remote = import_weights(storage.join(store, "in", name), storage.join(store, f"imp-{name}"))
        assert _same(read_weights(remote), read_weights(local)), name
        assert read_config(remote) == read_config(local), name
        exported = storage.read_json(storage.join(remote, CONFIG))["_export"]
        assert exported["source"] == storage.join(store, "in", name)  # a URI is recorded as is

    timm = export_timm(storage.join(store, "imp-ours"), storage.join(store, "timm", "vit.safetensors"))
    assert _same(read_weights(timm), read_weights(export_timm(str(tmp_path / "imp-ours"),
                                                              str(tmp_path / "timm.safetensors"))))


def test_vitp_attention_reads_and_writes_uris(store, capsys):
    """Export, image and --out all on the URI."""
    out = write_export(storage.join(store, "export"), _model().state_dict(), _cfg().to_dict(), {"step": 1})
    image = storage.join(store, "img", "probe.png")
    png = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (40, 40, 3), dtype=np.uint8)).save(png, "PNG")
    storage.write_bytes(image, png.getvalue())
    att = storage.join(store, "attention")
    assert main(["attention", out, image, "--out", att]) == 0
    assert f"wrote {att}/rollout.png and {att}/attention_distance.png" in capsys.readouterr().out
    assert storage.listdir(att) == ["attention_distance.png", "rollout.png"]
    assert _png(storage.join(att, "rollout.png")) == (2 * VIEW_SIZE, VIEW_SIZE)  # image | overlay, readable
    assert main(["attention", out, storage.join(store, "img", "nope.png"), "--out", att]) == 2
    assert "nope.png: no such image file" in capsys.readouterr().err


def test_compare_plot_written_to_a_uri_is_logged_to_mlflow(s3, tmp_path):
    """S3 only: file:// takes the same path, and each MLflow store costs seconds to create."""
    from mlflow.tracking import MlflowClient

    from vitp.tracking.plots import log_plot_to_parent, plot_compare

    tracking = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking)
    parent = client.create_run(client.create_experiment(
        "uri", artifact_location=(tmp_path / "artifacts").as_uri())).info.run_id  # not ./mlruns
    store = storage.join(s3.bucket(), "vit")
    out = plot_compare(tracking, [], storage.join(store, "plots", "compare.png"))  # the placeholder
    assert out == storage.join(store, "plots", "compare.png") and _png(out)[0] > 0
    assert log_plot_to_parent(tracking, parent, out) == "compare/compare.png"
    fetched = client.download_artifacts(parent, "compare/compare.png", str(tmp_path / "dl"))
    assert open(fetched, "rb").read() == storage.read_bytes(out)


# ------------------------------------------------------------ a real checkpoint on a URI


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A real ZeRO-2 DeepSpeed checkpoint of the debug model (1 gloo process, 2 steps) and the
    export the training process wrote from it locally."""
    from vitp.train.local import launch

    d = tmp_path_factory.mktemp("trained")
    ck, ex = str(d / "checkpoint_00000002"), str(d / "export")
    launch(workers.train_save_export, 1, 2, 2, ck, ex)
    return ck, ex


@pytest.mark.e2e
@pytest.mark.slow
def test_vitp_export_of_a_uri_checkpoint_to_a_uri(store, trained, capsys):
    """The checkpoint uploaded as Ray Train leaves it; the export equals the local one."""
    ck_local, ex_local = trained
    ck = storage.join(store, "runs", "debug", "checkpoint_00000002")
    storage.upload_dir(ck_local, ck)
    out = storage.join(store, "export")
    assert main(["export", ck, "--out", out]) == 0
    assert f"wrote {out}/model.safetensors and {out}/config.json" in capsys.readouterr().out
    assert _same(read_weights(out), read_weights(ex_local))
    meta = storage.read_json(storage.join(out, CONFIG))
    assert meta["_export"]["source"] == ck and meta["_export"]["step"] == 2
    # a checkpoint is also a --from source as it is: consolidated from the URI
    assert _same(dict(load_model(ck).state_dict()), dict(load_model(ex_local).state_dict()))
    storage.rmtree(storage.join(ck, "complete"), ck)  # incomplete now: refused, one line
    assert main(["export", ck, "--out", storage.join(store, "export2")]) == 2
    assert "incomplete checkpoint" in capsys.readouterr().err


# ---------------------------------------------------------------------- synth, preprocess


@pytest.mark.ray
@pytest.mark.slow
def test_synth_and_preprocess_into_uri_shards(ray_session, store):
    import pyarrow.parquet as pq

    from vitp.data.commands import run_preprocess, run_synth
    from vitp.data.shards import read_manifest, shard_paths, verify_checksums
    from vitp.recipes import debug

    cfg = debug()
    cfg = dataclasses.replace(cfg, work_dir=store, data=dataclasses.replace(
        cfg.data, synth_classes=3, synth_images_per_class=4, storage_size=16, image_size=16,
        num_classes=3, val_fraction=0.25))
    res = run_synth(Run.of(cfg), log=lambda _: None)
    corpus = storage.join(store, "synth")
    assert res["images"] == 12 and storage.listdir(corpus) == [f"fractal_{c:05d}" for c in range(3)]
    assert all(len(storage.listdir(storage.join(corpus, c))) == 4 for c in storage.listdir(corpus))
    with pytest.raises(FileExistsError, match="not empty"):
        run_synth(Run.of(cfg), log=lambda _: None)

    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, source="imagefolder", path=corpus))
    summary = run_preprocess(Run.of(cfg), log=lambda _: None)
    shards = storage.join(store, "shards", "imagefolder")
    m = read_manifest(shards)
    assert m["counts"] == {"input": 12, "written": 12, "quarantined": 0, "train": summary["train"],
                           "val": summary["val"]}
    assert verify_checksums(shards, m) == []
    assert storage.read_json(storage.join(shards, "classes.json")) == {f"fractal_{c:05d}": c for c in range(3)}
    keys = []
    for split in ("train", "val"):
        for p in shard_paths(shards, split, m):
            fs, inner = storage.filesystem(p)
            keys += pq.read_table(inner, filesystem=fs).column("key").to_pylist()
    assert sorted(keys) == sorted(f"fractal_{c:05d}/{i:06d}.png" for c in range(3) for i in range(4))
    assert not any(n.endswith(".tmp") for n in storage.file_sizes(shards))
    assert pq.read_table(storage.filesystem(storage.join(shards, "quarantine.parquet"))[1],
                         filesystem=storage.filesystem(shards)[0]).num_rows == 0
    with pytest.raises(FileExistsError, match="already holds shards"):
        run_preprocess(Run.of(cfg), log=lambda _: None)

    # the driver's check before training: the shards as written pass; a foreign first shard and
    # a deleted one are named, in one line, before any Train worker would read them
    from vitp.data.shards import check_shard_files
    from vitp.errors import InputError

    check_shard_files(shards, m)
    first, last = m["shards"]["train"][0]["file"], m["shards"]["val"][-1]["file"]
    original = storage.read_bytes(storage.join(shards, first))
    storage.write_bytes(storage.join(shards, first), b"\x89PNG\r\n\x1a\n" + original[8:])
    with pytest.raises(InputError, match=f"{first}: not a Parquet file"):
        check_shard_files(shards, m)
    storage.write_bytes(storage.join(shards, first), original)
    fs, inner = storage.filesystem(storage.join(shards, last))
    fs.delete_file(inner)
    with pytest.raises(InputError, match=f"1 of the {len(shard_paths(shards, 'train', m)) + len(shard_paths(shards, 'val', m))} "
                                         f"shards its manifest lists are missing \\({last}\\)"):
        check_shard_files(shards, m)
    storage.write_bytes(storage.join(shards, "manifest.json"), b"<html>AccessDenied</html>")
    with pytest.raises(InputError, match="manifest.json: not a shards manifest"):
        read_manifest(shards)
