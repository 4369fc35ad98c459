"""`vitp` as a user runs it: a real subprocess of the installed console script."""
import argparse
import json
import os
import shutil
import subprocess
import sys

import pytest

VITP = [shutil.which("vitp") or "", ] if shutil.which("vitp") else [sys.executable, "-m", "vitp.cli"]


def run(*args):
    return subprocess.run([*VITP, *args], capture_output=True, text=True, timeout=120)


def test_config_prints_resolved_json():
    r = run("config", "debug", "--set", "optim.lr=0.005", "--set", "parallel.zero_stage=3")
    assert r.returncode == 0, r.stderr
    cfg = json.loads(r.stdout)
    assert cfg["optim"]["lr"] == 0.005 and cfg["parallel"]["zero_stage"] == 3
    assert cfg["recipe"] == "debug"


@pytest.mark.parametrize("where", ["before", "after"])
def test_debug_and_verbose_are_taken_before_or_after_the_command(where, monkeypatch):
    """--debug (the traceback instead of one line) and --verbose (Ray's INFO output) anywhere."""
    from vitp.cli import main
    from vitp.config import ConfigError
    from vitp.console import VERBOSE_ENV

    monkeypatch.delenv(VERBOSE_ENV, raising=False)
    command = ["config", "debug", "--set", "optim.lrr=1"]
    flags = ["--debug", "--verbose"]
    with pytest.raises(ConfigError, match="did you mean 'optim.lr'"):  # --debug: raised, not mapped to exit 2
        main(flags + command if where == "before" else command + flags)
    assert os.environ.get(VERBOSE_ENV) == "1"
    monkeypatch.delenv(VERBOSE_ENV)
    assert main(command) == 2 and VERBOSE_ENV not in os.environ  # neither: one line, exit 2


def test_version_is_the_installed_distributions(capsys):
    from importlib.metadata import version

    from vitp.cli import main

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out == f"vitp {version('vit-pipeline')}\n"


def test_config_errors_exit_2_with_message():
    r = run("config", "debug", "--set", "optim.lrr=1")
    assert r.returncode == 2 and "optim.lr" in r.stderr and "Traceback" not in r.stderr
    r = run("config", "debug", "--set", "parallel.global_batch=33")
    assert r.returncode == 2 and "global_batch 33 != micro 16" in r.stderr
    # a recipe is read without its paths: a cluster recipe's corpus and shards are not on this machine
    r = run("config", "b16_i21k", "--set", "data.path=/no/such/corpus")
    assert r.returncode == 0 and json.loads(r.stdout)["data"]["path"] == "/no/such/corpus", r.stderr
    assert run("config", "b16_i21k", "--no-path-check").returncode == 0  # the old flag is still taken


def test_config_list_names_every_recipe():
    from vitp.recipes import RECIPES

    r = run("config", "--list")
    assert r.returncode == 0
    for name in RECIPES:
        assert name in r.stdout


@pytest.mark.long(reason="a server or cluster started for one check; CI starts them for the CLI chain, "
                         "doctor, rehearsal")
@pytest.mark.slow  # three vitp processes that count a model's FLOPs
def test_model_prints_params_and_flops():
    r = run("model", "B/16", "--json")
    info = json.loads(r.stdout)
    assert info["params_m"] == pytest.approx(86.568, abs=1e-3)
    assert info["forward_gflops"] == pytest.approx(35.13, abs=0.01)
    r = run("model", "H/14", "--image-size", "224")
    assert "632.05M params" in r.stdout
    r = run("model", "B/16", "--image-size", "200")
    assert r.returncode == 2 and "multiple of 16" in r.stderr


def test_every_commands_help_names_its_defaults():
    """`vitp CMD --help`: each option with a default worth saying shows it (argparse's text)."""
    from vitp.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    shown = 0
    for name, p in sub.choices.items():
        text = " ".join(p.format_help().split())  # argparse wraps lines anywhere between words
        for action in p._actions:
            if (action.option_strings and action.default not in (None, False, "", [], argparse.SUPPRESS)
                    and action.help != argparse.SUPPRESS):
                if "default" in (action.help or "").lower():  # its own words say it
                    continue
                assert f"(default: {action.default})" in text, (name, action.option_strings, action.default)
                shown += 1
    assert shown >= 15, shown


@pytest.mark.long(reason="a server or cluster started for one check; CI starts them for the CLI chain, "
                         "doctor, rehearsal")
@pytest.mark.slow  # the whole command in a subprocess (MLflow, torch): make test, not test-fast
def test_a_run_in_mlflow_is_a_recipe_for_a_new_run_like_it(tmp_path, monkeypatch):
    """`vitp CMD runs:/RUN_ID`: the run's logged config.json, under a run name of its own (the same
    command again continues that one, never the original); a missing run or store is one line."""
    from vitp.config import ExperimentConfig
    from vitp.recipes import resolve
    from vitp.tracking.runs import RunLogger

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    cfg = resolve("debug", ["optim.lr=0.02", "train.steps=33", f"work_dir={tmp_path}"], check_paths=False)
    logger = RunLogger.start(uri, "like", cfg.run_name)
    logger.log_config(cfg.to_dict())
    logger.end()

    env = {**os.environ, "MLFLOW_TRACKING_URI": uri}
    p = subprocess.run([*VITP, "config", f"runs:/{logger.run_id}", "--set", "train.steps=34"],
                       capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 0 and not p.stderr.strip(), p.stderr  # no download progress either
    got = ExperimentConfig.from_dict(json.loads(p.stdout))
    assert got.tracking.run_name == f"{cfg.run_name}-like-{logger.run_id[:8]}"
    assert got.train.steps == 34  # --set over the run's config
    want = cfg.to_dict()
    want["tracking"]["run_name"], want["train"]["steps"] = got.tracking.run_name, 34
    assert got.to_dict() == want  # the rest exactly as the run had it

    p = subprocess.run([*VITP, "config", "runs:/0123456789abcdef"], capture_output=True, text=True,
                       timeout=120, env=env)
    assert p.returncode == 2 and p.stderr.startswith("vitp config: runs:/0123456789abcdef: no such run at "), p.stderr
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    r = run("config", f"runs:/{logger.run_id}")
    assert r.returncode == 2 and "give --tracking-uri URI or set MLFLOW_TRACKING_URI" in r.stderr, r.stderr


def test_config_file_and_like_are_spellings_of_the_recipe(tmp_path, capsys, monkeypatch):
    """--config FILE is the experiment file given as RECIPE, --like RUN (a bare id, runs:/ID) the
    run given as runs:/ID; two of them, or none where a command needs one, is one line, exit 2."""
    from vitp.cli import main
    from vitp.recipes import resolve
    from vitp.tracking.runs import RunLogger

    def config(*argv):
        assert main(["config", *argv]) == 0
        return json.loads(capsys.readouterr().out)

    f = tmp_path / "exp.yaml"
    f.write_text("recipe: debug\noptim:\n  lr: 0.02\n")
    assert config("--config", str(f)) == config(str(f)) and config(str(f))["optim"]["lr"] == 0.02
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    logger = RunLogger.start(uri, "like", "r")
    logger.log_config(resolve("debug", ["train.steps=33"], check_paths=False).to_dict())
    logger.end()
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    # where the run is read from: a flag the command takes, or the environment
    for argv, give in ((["config"], "give --tracking-uri URI or set MLFLOW_TRACKING_URI"),
                       (["synth"], "the run is read from MLflow: set MLFLOW_TRACKING_URI")):
        assert main([*argv, "--like", logger.run_id]) == 2
        assert give in capsys.readouterr().err
    assert config("--like", logger.run_id, "--tracking-uri", uri)["train"]["steps"] == 33
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    as_run = config(f"runs:/{logger.run_id}")
    assert as_run["train"]["steps"] == 33
    assert config("--like", logger.run_id) == config("--like", f"runs:/{logger.run_id}") == as_run
    for argv, needle in ((["config", "debug", "--config", str(f)], "give one of RECIPE, --config FILE and --like RUN"),
                         (["pretrain", "--set", "train.steps=3"], "no recipe: give a RECIPE name")):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"vitp {argv[0]}: ") and needle in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.slow  # the whole command in a subprocess (MLflow, torch): make test, not test-fast
def test_predict_gives_each_image_the_models_top_classes(tmp_path):
    """`vitp predict EXPORT IMAGES...`: per image, the classes the model ranks highest with their
    probabilities, as the model computes them on the image cropped the way evaluation crops it;
    a missing image is one line before any model loads."""
    import numpy as np
    import torch
    from PIL import Image

    from vitp.data.decode import decode_image, resize_center_crop
    from vitp.data.ingest import normalize
    from vitp.model.vit import build_vit
    from vitp.model.weights import write_export
    from vitp.recipes import resolve

    cfg = resolve("debug_finetune", check_paths=False)
    torch.manual_seed(0)
    model = build_vit(cfg.model, cfg.data.image_size).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)  # the zero-initialised head would tie every class
    export = write_export(str(tmp_path / "export"), model.state_dict(), cfg.to_dict(), {})
    rng = np.random.default_rng(0)
    paths = []
    for i, size in enumerate(((64, 80), (30, 50))):
        paths.append(str(tmp_path / f"img{i}.png"))
        Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8)).save(paths[-1])

    r = run("predict", export, *paths, "--top", "3", "--json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert [row["image"] for row in rows] == paths
    for row, path in zip(rows, paths):
        pixels = resize_center_crop(decode_image(open(path, "rb").read()), cfg.data.image_size)
        with torch.no_grad():
            probs = model(normalize(torch.from_numpy(pixels[None].copy()), cfg.data.mean, cfg.data.std)
                          .contiguous()).softmax(-1)[0]
        want = probs.argsort(descending=True)[:3].tolist()
        assert [t["class"] for t in row["top"]] == want, (row, probs)
        assert [t["prob"] for t in row["top"]] == pytest.approx(probs[want].tolist(), abs=1e-5)
    text = run("predict", export, paths[0], "--top", "2")
    assert text.returncode == 0 and text.stdout.startswith(f"{paths[0]}: class {rows[0]['top'][0]['class']} ")
    # the class names an export records (vitp export reads them from the training shards)
    names = [f"kind-{i}" for i in range(cfg.model.num_classes)]
    named = write_export(str(tmp_path / "named"), model.state_dict(), cfg.to_dict(), {"classes": names})
    top = rows[0]["top"][0]
    text = run("predict", named, paths[0], "--top", "2")
    assert text.returncode == 0 and text.stdout.startswith(f"{paths[0]}: {names[top['class']]} (class {top['class']}) ")

    r = run("predict", export, paths[0], str(tmp_path / "missing.png"))
    assert r.returncode == 2 and r.stderr.strip() == (f"vitp predict: {tmp_path / 'missing.png'}: no such image "
                                                      "file; give a JPEG or PNG (a path or URI)"), r.stderr


@pytest.mark.slow  # vitp export and predict in subprocesses (torch), transformers' pipeline
def test_the_hugging_face_export_classifies_image_files_through_pipeline_as_vitp_predict_does(tmp_path):
    """`vitp export --format hf` writes what `transformers.pipeline("image-classification")` needs to
    take an image file: the same crop and normalisation as `vitp predict`, so the same classes, by
    name, with the same probabilities (images whose shorter side scales to whole pixels: HF resizes
    then crops, we resize the centred square in one pass, the same pixels then)."""
    import numpy as np
    import torch
    from PIL import Image
    from transformers import pipeline

    from vitp.model.vit import build_vit
    from vitp.model.weights import write_export
    from vitp.recipes import resolve

    cfg = resolve("debug_finetune", ["data.mean=[0.4,0.5,0.6]", "data.std=[0.2,0.25,0.3]"], check_paths=False)
    torch.manual_seed(1)
    model = build_vit(cfg.model, cfg.data.image_size)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)  # the zero-initialised head would tie every class
    names = [f"kind-{i}" for i in range(cfg.model.num_classes)]
    export = write_export(str(tmp_path / "export"), model.state_dict(), cfg.to_dict(), {"classes": names})
    rng = np.random.default_rng(1)
    paths = []
    for i, (h, w) in enumerate(((64, 80), (30, 50), (96, 48))):
        paths.append(str(tmp_path / f"img{i}.png"))
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(paths[-1])

    r = run("export", export, "--format", "hf", "--out", str(tmp_path / "hf"))
    assert r.returncode == 0 and "preprocessor_config.json" in r.stdout, r.stderr
    ours = json.loads(run("predict", export, *paths, "--top", "4", "--json").stdout)
    classify = pipeline("image-classification", model=str(tmp_path / "hf"))
    for row, path in zip(ours, paths):
        theirs = classify(path, top_k=4)
        assert [t["label"] for t in theirs] == [t["name"] for t in row["top"]], (theirs, row)
        assert [t["score"] for t in theirs] == pytest.approx([t["prob"] for t in row["top"]], abs=1e-4)
    r = run("export", export, "--headless", "--out", str(tmp_path / "ours"))  # our format keeps the head
    assert r.returncode == 2 and r.stderr.strip() == ("vitp export: --headless is for --format timm or hf: our own "
                                                      "export keeps the whole model (fine-tunes replace its head)")
    assert not (tmp_path / "ours").exists()
