"""Files from strangers never run code: a checkpoint (export, resume) or a CIFAR batch whose
unpickling would create a file is refused with one line naming it, and the file never appears.

Each planted file is first shown to work: a plain unpickle of it does create the file, so a
loader that stopped refusing would fail these tests."""
import functools
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from vitp.errors import InputError
from vitp.safe_load import load_data_pickle, torch_load, weights_only

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "train"))
import workers  # noqa: E402  (tests/train/workers.py: spawned gloo ranks import it by name)


class Plant:
    """Unpickling this opens `path` for writing: it creates the file (any call would do)."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def _shows_the_attack(load, canary: Path) -> None:
    """An unrestricted `load()` (pickle.loads, torch.load(weights_only=False)) creates `canary`
    (removed again): the plant works."""
    assert not canary.exists()
    load()
    assert canary.exists(), "the planted object did not run on an unrestricted load"
    canary.unlink()


def _retamper(ckpt: Path, rel: str, obj) -> None:
    """Replace ckpt/rel with torch.save(obj) and record its new size in the rank's marker, as
    someone handing us a crafted directory would: it passes the completeness check."""
    torch.save(obj, ckpt / rel)
    marker = ckpt / "complete" / "rank_00000.json"
    m = json.loads(marker.read_text())
    assert rel in m["files"], sorted(m["files"])
    m["files"][rel] = (ckpt / rel).stat().st_size
    marker.write_text(json.dumps(m))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A real 1-rank ZeRO-2 checkpoint of the debug model (2 steps) and its export."""
    from vitp.train.local import launch

    root = tmp_path_factory.mktemp("untrusted")
    ck, ex = root / "ck", root / "export"
    launch(workers.train_save_export, 1, 2, 2, str(ck), str(ex), [f"tracking.uri={SECRET_URI}"])
    return ck


# a tracking URI whose password holds "/", "+" and "%", as cloud secret keys and encoded URIs do
SECRET_PASSWORD = "pa/ss+w0rd%2F9k2"
SECRET_URI = f"http://alice:{SECRET_PASSWORD}@mlflow.example.com:5000"


@pytest.mark.slow
def test_checkpoint_meta_and_export_config_carry_the_config_redacted(checkpoint):
    """A checkpoint and its export are copied and shared: the config they carry is redacted
    (the URI's host stays, its password does not)."""
    for path in [checkpoint / "meta.json", checkpoint.parent / "export" / "config.json"]:
        text = path.read_text()
        assert SECRET_PASSWORD not in text and "alice:***@mlflow.example.com" in text, path
    # nor anywhere else in what the run wrote: DeepSpeed's model and optimizer files, our RNG
    # state, the safetensors header; as written, or in any of the forms a URI or JSON gives it
    from urllib.parse import quote

    forms = {SECRET_PASSWORD, quote(SECRET_PASSWORD, safe=""), SECRET_PASSWORD.replace("/", "\\/")}
    files = [p for p in checkpoint.parent.rglob("*") if p.is_file()]
    assert len(files) > 5, files
    leaks = [(str(p), form) for p in files for form in forms if form.encode() in p.read_bytes()]
    assert not leaks, leaks


def test_logged_dict_artifacts_are_redacted(tmp_path):
    """sweep.json, the data manifest, config.json: every dict a run logs goes through redact."""
    import json

    from vitp.tracking.runs import RunLogger

    with RunLogger.start(f"sqlite:///{tmp_path}/m.db", "e", "r") as run:
        run.log_dict({"trials": [{"tracking": {"uri": SECRET_URI}}], "db_password": "x"}, "sweep.json")
        got = json.loads(open(run.client.download_artifacts(run.run_id, "sweep.json", str(tmp_path))).read())
    assert got == {"trials": [{"tracking": {"uri": "http://alice:***@mlflow.example.com:5000"}}],
                   "db_password": "***"}


def _tampered(checkpoint: Path, tmp_path: Path, rel: str, canary: Path) -> Path:
    """A copy of `checkpoint` whose file `rel` plants an object creating `canary`."""
    bad = tmp_path / "from-a-stranger"
    shutil.copytree(checkpoint, bad)
    obj = torch.load(bad / rel, weights_only=False)  # ours: trusted
    if rel.startswith("rng/"):
        obj["python"] = Plant(canary)
    else:
        obj["ds_version"] = Plant(canary)
    _retamper(bad, rel, obj)
    return bad


MODEL_STATES = "state/mp_rank_00_model_states.pt"


@pytest.mark.slow
def test_export_of_a_planted_checkpoint_is_refused_and_runs_nothing(checkpoint, tmp_path):
    canary = tmp_path / "ran"
    bad = _tampered(checkpoint, tmp_path, MODEL_STATES, canary)
    _shows_the_attack(lambda: torch.load(bad / MODEL_STATES, weights_only=False), canary)
    out = tmp_path / "export"
    r = subprocess.run([sys.executable, "-m", "vitp.cli", "export", str(bad), "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert str(bad) in lines[0] and "refusing to load" in lines[0] and "open)" in lines[0], lines[0]
    assert not canary.exists() and not (out / "model.safetensors").exists()
    # the untampered checkpoint still exports (the allow-list covers what DeepSpeed writes)
    r = subprocess.run([sys.executable, "-m", "vitp.cli", "export", str(checkpoint), "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and (out / "model.safetensors").exists(), r.stdout + r.stderr


@pytest.mark.slow
def test_resume_from_a_planted_checkpoint_is_refused_and_runs_nothing(checkpoint, tmp_path):
    """DeepSpeed's load of the model states, and ours of the RNG states."""
    from vitp.train.local import launch

    bad = []
    for i, rel in enumerate([MODEL_STATES, "rng/rank_00000.pt"]):
        canary = tmp_path / f"ran{i}"
        bad.append(_tampered(checkpoint, tmp_path / str(i), rel, canary))
        _shows_the_attack(lambda: torch.load(bad[-1] / rel, weights_only=False), canary)
    got = launch(workers.load_into_engine, 1, 2, [str(b) for b in bad] + [str(checkpoint)])[0]
    for b, g in zip(bad, got):
        assert isinstance(g, str) and g.startswith(f"InputError: {b}: refusing to load it") and ".open)" in g, g
    assert got[-1] == 2  # the real checkpoint resumes (its step)
    assert not any(tmp_path.glob("ran*"))


def _cifar10(root: Path, meta) -> Path:
    """A CIFAR-10 python-batch folder (2 images per batch) whose batches.meta is `meta`."""
    root.mkdir()
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {b"data": rng.integers(0, 256, (2, 3072), dtype=np.uint8), b"labels": [0, 1],
                 b"batch_label": name.encode(), b"filenames": [b"a.png", b"b.png"]}
        (root / name).write_bytes(pickle.dumps(batch, protocol=2))
    (root / "batches.meta").write_bytes(pickle.dumps(meta, protocol=2))
    return root


def test_cifar_batches_load_as_data_and_a_planted_one_is_refused(tmp_path):
    from vitp.data.datasets import cifar

    names = [b"airplane", b"automobile"] + [b"c%d" % i for i in range(8)]
    good = cifar(str(_cifar10(tmp_path / "good", {b"label_names": names})), "cifar10")
    assert good.classes[:2] == ["airplane", "automobile"] and len(good.items) == 12

    canary = tmp_path / "ran"
    planted = {b"label_names": names, b"x": Plant(canary)}
    _shows_the_attack(lambda: pickle.loads(pickle.dumps(planted, protocol=2)), canary)
    root = _cifar10(tmp_path / "bad", planted)
    with pytest.raises(InputError, match=r"batches.meta: refusing to load it: .*asks for (io|builtins).open") as e:
        cifar(str(root), "cifar10")
    assert "\n" not in str(e.value)
    assert not canary.exists()


def test_data_pickles_hold_numbers_only():
    arr = np.arange(6, dtype=np.uint8).reshape(2, 3)
    got = load_data_pickle(pickle.dumps({b"data": arr, b"l": [1, 2.5, b"x", "y"]}, protocol=2), "f")
    assert np.array_equal(got[b"data"], arr) and got[b"l"] == [1, 2.5, b"x", "y"]
    with pytest.raises(InputError, match=r"^f: holds an array of Python objects"):
        load_data_pickle(pickle.dumps({b"data": np.array([1, "a"], dtype=object)}), "f")
    with pytest.raises(InputError, match=r"^f: not a readable python pickle"):
        load_data_pickle(b"\x80\x02}q\x00", "f")  # cut short


def _shared_nesting(levels: int, width: int) -> bytes:
    """A pickle of `levels` lists, each holding the one below `width` times: a few hundred bytes
    (the memo refers back), width^levels paths for a walk that does not remember what it visited."""
    x: list = []
    for _ in range(levels):
        x = [x] * width
    return pickle.dumps({b"data": x}, protocol=2)


@pytest.mark.timeout(60)  # without a bounded walk each of these never returns
@pytest.mark.parametrize("data, says", [
    (b"]q\x00h\x00a.", "a list or dict in it holds itself or appears twice"),  # l = []; l.append(l)
    (_shared_nesting(12, 16), "a list or dict in it holds itself or appears twice"),
    (pickle.dumps({b"labels": list(range(1_000_001))}, protocol=2), "holds more than 1,000,000 values"),
    (pickle.dumps(functools.reduce(lambda x, _: [x], range(40), []), protocol=2), "nested more than 16 levels"),
], ids=["itself", "shared-nesting", "too-many", "too-deep"])
def test_a_data_pickle_that_would_walk_forever_is_refused(data, says):
    with pytest.raises(InputError, match=rf"^batch: {says}") as e:
        load_data_pickle(data, "batch")
    assert "\n" not in str(e.value)


@pytest.mark.timeout(120)
def test_a_cyclic_cifar_batch_ends_preprocess_in_one_line(ray_session, tmp_path, monkeypatch, capsys):
    """`vitp preprocess` of a CIFAR-10 folder one of whose batches is a list inside itself: exit 2,
    one line naming the batch, no shards."""
    from vitp.cli import main

    root = _cifar10(tmp_path / "cyclic", {b"label_names": [b"a"] * 10})
    (root / "data_batch_3").write_bytes(b"]q\x00h\x00a.")
    monkeypatch.chdir(tmp_path)
    assert main(["preprocess", "debug", "--set", "data.source=cifar10", f"--set=data.path={root}",
                 f"--set=work_dir={tmp_path / 'work'}", f"--set=data.shards={tmp_path / 'shards'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"vitp preprocess: {root}/data_batch_3: a list or dict in it holds itself or appears twice; "
                   "a dataset batch is a plain tree of arrays, lists and numbers (use the dataset's official files)"]
    assert not (tmp_path / "shards").exists()


def test_weights_only_blocks_a_loader_that_asks_for_code_and_restores_the_environment(tmp_path, monkeypatch):
    """DeepSpeed calls torch.load(..., weights_only=False): inside the block that is refused too;
    outside it, the process's own setting is back."""
    canary = tmp_path / "ran"
    path = tmp_path / "x.pt"
    torch.save({"w": torch.ones(2), "p": Plant(canary)}, path)
    _shows_the_attack(lambda: torch.load(path, weights_only=False), canary)
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    with pytest.raises(InputError, match=r"^ck: refusing to load it: .*asks for (io|builtins).open"):
        with weights_only("ck"):
            torch.load(path, weights_only=False)
    assert not canary.exists()
    assert os.environ.get("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD") == "1"
    assert "TORCH_FORCE_WEIGHTS_ONLY_LOAD" not in os.environ
    with pytest.raises(InputError, match=rf"^{path}: refusing"):
        torch_load(str(path))
    torch.save({"w": torch.ones(2), "a": np.arange(3, dtype=np.uint32)}, path)
    got = torch_load(str(path))
    assert torch.equal(got["w"], torch.ones(2)) and got["a"].tolist() == [0, 1, 2]


@pytest.mark.parametrize("content,says", [
    (b"\x00" * 64, "not an .npz file (no zip header)"),
    (b"PK\x03\x04cut short", "not a readable .npz"),
    ("object-array", "holds pickled Python objects, which are never loaded")])
def test_import_of_a_bad_npz_names_it_and_never_unpickles(tmp_path, capsys, content, says):
    from vitp.cli import main

    src, out = tmp_path / "weights.npz", tmp_path / "imported"
    if content == "object-array":
        np.savez(src, a=np.array([1, "x"], dtype=object))
    else:
        src.write_bytes(content)
    assert main(["import", str(src), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"vitp import: {src}: {says}") and "\n" not in err, err
    assert not out.exists()


@pytest.mark.parametrize("command,what", [("finetune", "config.json"), ("fewshot", "a plain directory")])
def test_a_source_that_cannot_hold_weights_fails_once_on_the_driver(tmp_path, command, what):
    """Refused before Ray starts (no worker raises it max_failures times): an export's config.json
    given as --from, and a directory that is neither an export nor a checkpoint. The command is
    pointed at a cluster address nothing answers: had it reached for Ray first, it would hang
    there (Ray retries the address for minutes) past the timeout, not exit 2 on the source in
    seconds."""
    (tmp_path / "export").mkdir()
    (tmp_path / "export" / "config.json").write_text('{"model": {"variant": "pico/8"}}')
    source = tmp_path / "export" / "config.json" if what == "config.json" else tmp_path / "export"
    r = subprocess.run([sys.executable, "-m", "vitp.cli", command, "debug_finetune", "--from", str(source),
                        "--no-tracking", "--address", "127.0.0.1:9", "--set", f"work_dir={tmp_path / 'work'}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=90)
    err = r.stderr.strip()
    says = "not a weights file" if what == "config.json" else "neither an export"
    assert r.returncode == 2 and err.startswith(f"vitp {command}: {source}: {says}") and "\n" not in err, err
    assert not (tmp_path / "work").exists()
