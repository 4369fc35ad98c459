"""How `vitp` fails: one line and a documented exit code, a traceback only with `--debug`,
a quiet stop when stdout closes early (`| head`)."""
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from vitp import cli
from vitp.cli import experiment
from vitp.errors import ClusterError, ConfigError, InputError
from vitp.tracking.store import TrackingError

ROOT = Path(__file__).resolve().parents[2]
VITP = [shutil.which("vitp")] if shutil.which("vitp") else [sys.executable, "-m", "vitp.cli"]


def run(*args, **kw):
    return subprocess.run([*VITP, *args], capture_output=True, text=True, timeout=120, cwd=ROOT, **kw)


def one_line(text: str) -> str:
    """The error line; what follows it can only be the config problems it lists ("  - ...")."""
    lines = text.strip().splitlines()
    assert lines and all(line.startswith("  - ") for line in lines[1:]), text
    return lines[0]


# ------------------------------------------------------------------ in-process: main()


def _raising(exc):
    def handler(args):
        raise exc
    return handler


@pytest.mark.parametrize("exc, code", [
    (ConfigError("optim.lr=-1: must be positive"), 2),
    (InputError("x.npz: not a ViT checkpoint"), 2),
    (TrackingError("MLflow experiment 'x' not found: use one of 'y'"), 2),
    (ClusterError("cannot reach the Ray jobs API at http://h:8265: pass --address"), 3),
    (FileNotFoundError(2, "No such file or directory", "/no/such/ckpt"), 2),
    (PermissionError(13, "Permission denied", "/root/x"), 2),
    (FileExistsError("out: not empty; pass --overwrite"), 2),
    (KeyboardInterrupt(), 130),
])
def test_each_error_kind_is_one_line_and_its_exit_code(monkeypatch, capsys, exc, code):
    monkeypatch.setattr(experiment, "cmd_export", _raising(exc))
    assert cli.main(["export", "ckpt"]) == code
    err = capsys.readouterr().err
    line = one_line(err)
    assert line.startswith("vitp export: ") and "Traceback" not in err
    if isinstance(exc, OSError) and exc.filename:
        assert line == f"vitp export: {exc.filename}: {exc.strerror}"


def test_a_bug_is_one_line_exit_1_and_points_at_debug(monkeypatch, capsys):
    monkeypatch.setattr(experiment, "cmd_export", _raising(ZeroDivisionError("division by zero\nmore")))
    assert cli.main(["export", "ckpt"]) == 1
    line = one_line(capsys.readouterr().err)
    assert line == ("vitp export: internal error: ZeroDivisionError: division by zero "
                    "(run with --debug for the traceback)")
    # a ValueError is a bug too (user errors are UserError): no bare `except ValueError` maps it to 2
    monkeypatch.setattr(experiment, "cmd_export", _raising(ValueError("bad")))
    assert cli.main(["export", "ckpt"]) == 1


def test_debug_reraises(monkeypatch):
    monkeypatch.setattr(experiment, "cmd_export", _raising(ZeroDivisionError("boom")))
    with pytest.raises(ZeroDivisionError, match="boom"):
        cli.main(["--debug", "export", "ckpt"])
    monkeypatch.setattr(experiment, "cmd_export", _raising(ConfigError("bad value")))
    with pytest.raises(ConfigError):
        cli.main(["--debug", "export", "ckpt"])


def test_every_command_has_exactly_one_handler():
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    assert set(sub.choices) == {
        "config", "model", "plan", "synth", "preprocess", "pretrain", "finetune", "sweep", "export", "fewshot",
        "import", "attention", "analyze", "predict", "compare", "submit", "jobs", "mlflow-server", "doctor", "demo"}
    for name, p in sub.choices.items():
        assert callable(p.get_default("handler")), name


def test_import_formats_are_the_importers(capsys):
    from vitp.model.convert import IMPORT_FORMATS

    parser = cli.build_parser()
    for fmt in IMPORT_FORMATS:
        assert parser.parse_args(["import", "w.npz", "--out", "o", "--format", fmt]).format == fmt
    with pytest.raises(SystemExit) as e:
        parser.parse_args(["import", "w.npz", "--out", "o", "--format", "official"])
    assert e.value.code == 2 and "invalid choice" in capsys.readouterr().err


def test_every_command_that_prints_json_takes_json():
    """One spelling for JSON output: --json wherever a command can print JSON (compare's --format json too)."""
    parser = cli.build_parser()
    assert parser.parse_args(["compare", "--json"]).format == "json"
    assert parser.parse_args(["compare", "--format", "csv"]).format == "csv"
    for argv in (["model", "B/16"], ["plan", "B/16"], ["predict", "exp", "a.png"]):
        assert parser.parse_args([*argv, "--json"]).json is True, argv


# ------------------------------------------------------------------ a real `vitp` process


def test_debug_shows_the_traceback_and_without_it_one_line():
    r = run("config", "debug", "--set", "optim.lrr=1")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert one_line(r.stderr).startswith("vitp config: ") and "optim.lr" in r.stderr
    r = run("--debug", "config", "debug", "--set", "optim.lrr=1")
    assert r.returncode == 1 and "Traceback (most recent call last)" in r.stderr and "ConfigError" in r.stderr


@pytest.mark.parametrize("args, code, says", [
    (["no-such-command"], 2, "invalid choice"),
    (["config"], 2, "vitp config: name a recipe"),
    (["config", "no_such_recipe"], 2, "unknown recipe 'no_such_recipe'"),
    (["model", "B/16", "--image-size", "200"], 2, "multiple of 16"),
    (["export", "/no/such/checkpoint"], 2, "vitp export: /no/such/checkpoint"),
    (["import", "w.npz", "--out", "o", "--format", "official"], 2, "invalid choice: 'official'"),
    (["compare", "--tag", "novalue"], 2, "expected KEY=VALUE"),
    (["jobs", "stop"], 2, "vitp jobs: stop needs a job id"),
    (["submit", "/no/such/spec.yaml"], 2, "vitp submit: job spec /no/such/spec.yaml does not exist"),
    (["preprocess", "debug", "--resume", "--overwrite"], 2, "vitp preprocess: --overwrite starts over"),
])
def test_bad_invocations_print_one_line_and_the_documented_code(args, code, says):
    r = run(*args)
    assert r.returncode == code, r.stderr
    assert says in r.stderr and "Traceback" not in r.stderr
    if r.stderr.startswith("vitp "):  # ours; argparse prints its usage first
        one_line(r.stderr)


def test_help_documents_the_exit_codes():
    r = run("--help")
    assert r.returncode == 0
    for code in ("0 ", "1 ", "2 ", "3 ", "4 ", "130", "141"):
        assert f"  {code}" in r.stdout, code
    assert "--debug" in r.stdout
    for summary in ("0 ok", "1 work failed", "2 bad input", "3 cluster", "4 job STOPPED", "130 interrupted",
                    "141 stdout closed"):
        assert summary in " ".join(cli.__doc__.split()), summary  # the module docstring says it too


def test_help_imports_nothing_heavy():
    code = ("import sys, vitp.cli; vitp.cli.build_parser(); "
            "bad = [m for m in ('torch', 'ray', 'mlflow', 'pyarrow', 'deepspeed') if m in sys.modules]; "
            "assert not bad, bad")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 0, r.stderr


def test_a_bad_recipe_or_value_is_refused_before_anything_heavy_loads():
    """Each command that trains or reads data resolves its config first: a typo costs a fraction
    of a second, not the import of torch, Ray and MLflow (seconds on a small machine)."""
    code = ("import sys, vitp.cli\n"
            "for argv in (['pretrain', 'no_such'], ['finetune', 'debug_finetune', '--from', 'scratch',\n"
            "             '--set', 'optim.lr=-1'], ['synth', 'no_such'], ['preprocess', 'no_such'],\n"
            "             ['sweep', 'no_such'], ['fewshot', 'debug', '--from', 'x', '--set', 'train.steps=x']):\n"
            "    assert vitp.cli.main(argv) == 2, argv\n"
            "bad = [m for m in ('torch', 'ray', 'mlflow', 'pyarrow', 'deepspeed') if m in sys.modules]\n"
            "assert not bad, bad")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("vitp ") == 6, r.stderr  # each refused in its one line


def test_closed_stdout_ends_quietly():
    # The reader is gone before vitp writes a byte: the write must fail, and vitp stop quietly.
    p = subprocess.Popen([*VITP, "config", "debug"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    p.stdout.close()
    _, err = p.communicate(timeout=120)
    assert p.returncode == 141, err.decode()
    assert err.decode() == ""


def test_piped_into_head_no_traceback():
    cmd = " ".join(f"'{a}'" for a in VITP) + " config debug | head -3"
    r = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert len(r.stdout.splitlines()) == 3 and r.stdout.startswith("{")
    assert r.stderr == "" and r.returncode in (0, 141)  # 0 when vitp finished writing before head left
