"""Entrypoints through real shells: `vitp submit --set` rewrites run by `bash -c` / `sh -c` (as Ray's
driver does) and the KubeRay submitter's `bash -ce` command, with a stub `vitp` / `ray` on PATH
that records its argv, so nothing heavy runs. No Ray cluster."""
import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from vitp.cluster.entrypoint import add_overrides, parse_entrypoint
from vitp.cluster.jobspec import load_spec
from vitp.errors import ConfigError

from .conftest import ROOT

JOBS = sorted((ROOT / "jobs").glob("*.yaml"))
RAYJOBS = sorted((ROOT / "cluster" / "kuberay").glob("*/rayjob-*.yaml"))
# What the user's shell exported when running `vitp submit` (the spec sends them as env_vars).
ENV = {"VITP_STORE": "s3://bucket/vit", "PRETRAINED": "s3://bucket/vit/h14_i21k/export",
       "MLFLOW_TRACKING_URI": "http://mlflow.example:5000"}
# Overrides whose values a shell would mangle if they were not quoted.
OVERRIDES = ["train.seed=7", "tracking.run_name=it's a; b && c | d > e"]
SHELLS = [s for s in ("bash", "sh") if shutil.which(s)]


def _stub(bindir: Path, name: str, body: str) -> None:
    path = bindir / name
    path.write_text(f"#!{sys.executable} -S\nimport json, os, sys\n{body}")
    path.chmod(0o755)


@pytest.fixture
def stubs(tmp_path):
    """A bin dir with `vitp` (argv -> $STUB_LOG; exits 1 for the recipe in $STUB_FAIL), `ray` and
    `python` (the KubeRay submitter's health check) stubs; returns (bindir, log path)."""
    bindir, log = tmp_path / "bin", tmp_path / "argv.jsonl"
    bindir.mkdir()
    record = "open(os.environ['STUB_LOG'], 'a').write(json.dumps([os.path.basename(sys.argv[0])] + sys.argv[1:]) + '\\n')\n"
    _stub(bindir, "vitp", record + "print('out', flush=True); print('err', file=sys.stderr)\n"
          "sys.exit(1 if os.environ.get('STUB_FAIL') in sys.argv else 0)\n")
    # `ray job status` fails (not submitted yet) so the submitter takes the submit branch
    _stub(bindir, "ray", record + "sys.exit(1 if sys.argv[1:3] == ['job', 'status'] else 0)\n")
    _stub(bindir, "python", "sys.exit(0)\n")
    return bindir, log


def run_shell(shell: str, command: str, env: dict, stubs, *flags: str) -> tuple[subprocess.CompletedProcess, list]:
    """Run `command` with ONLY `env` (plus PATH with the stubs first) set; the recorded argvs."""
    bindir, log = stubs
    log.write_text("")
    full = {"PATH": f"{bindir}:/usr/bin:/bin", "STUB_LOG": str(log), **env}
    out = subprocess.run([shell, *flags, "-c", command], env=full, capture_output=True, text=True, timeout=60)
    return out, [json.loads(line) for line in log.read_text().splitlines()]


def expand(word: str, env: dict) -> str:
    """$VAR, ${VAR} and ${VAR:-default} as the shell expands them (the shipped specs use no other
    expansion)."""
    return re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(:-[^}]*)?\}|\$([A-Za-z_][A-Za-z0-9_]*)",
                  lambda m: env.get(m.group(1) or m.group(3)) or (m.group(2) or "")[2:], word)


def expected_calls(raw: str, env: dict, overrides: list[str]) -> list[list[str]]:
    """The argv each vitp call of a shipped spec gets: the spec's words expanded, then `--set`s.
    Independent of jobspec's parser: the shipped specs join their commands with && only."""
    assert set(re.findall(r"&&|\|\||[;|&]", raw)) <= {"&&"}, "a new operator: extend this helper"
    calls = []
    for part in re.split(r"\s&&\s", raw.strip()):
        words = [expand(w, env) for w in shlex.split(part)]
        assert words[0] == "vitp"
        calls.append(["vitp", *words[1:]] + [x for o in overrides for x in ("--set", o)])
    return calls


# --------------------------------------------------------------------- vitp submit --set


@pytest.mark.parametrize("shell", SHELLS)
@pytest.mark.parametrize("path", JOBS, ids=lambda p: p.name)
def test_set_is_appended_to_each_vitp_call_and_the_cluster_shell_still_expands(path, shell, stubs):
    raw = yaml.safe_load(path.read_text())["entrypoint"]
    spec = load_spec(str(path), OVERRIDES, environ=ENV)
    inserted = "".join(f" --set {shlex.quote(o)}" for o in OVERRIDES)
    assert spec.entrypoint.replace(inserted, "") == raw.strip()  # the spec's own text is kept as written
    out, calls = run_shell(shell, spec.entrypoint, ENV, stubs)
    assert out.returncode == 0, out.stderr
    assert calls == expected_calls(raw, ENV, OVERRIDES)
    assert not [w for c in calls for w in c if "$" in w]  # every variable expanded on the cluster
    if "$VITP_STORE" in raw:
        assert any(w.endswith("=" + ENV["VITP_STORE"]) or f"={ENV['VITP_STORE']}/" in w for c in calls for w in c)


def test_a_failing_call_stops_the_and_chain_after_the_rewrite(stubs):
    spec = load_spec(str(ROOT / "jobs" / "preprocess_downstream.yaml"), ["train.seed=7"], environ=ENV)
    out, calls = run_shell("bash", spec.entrypoint, {**ENV, "STUB_FAIL": "finetune_cifar100"}, stubs)
    assert out.returncode == 1
    assert [c[2] for c in calls] == ["finetune_cifar10", "finetune_cifar100"]  # && intact: the rest skipped


PRETRAIN_JOBS = [p for p in JOBS if p.stem.startswith("pretrain_")]


@pytest.mark.parametrize("path", PRETRAIN_JOBS, ids=lambda p: p.name)
def test_pretraining_is_gated_on_the_doctor_with_the_runs_own_settings(path, stubs):
    """`vitp doctor RECIPE --allreduce --min-busbw ${VITP_MIN_BUSBW:-0} ... && vitp pretrain RECIPE ...`:
    the doctor gets the run's --set items and the submitter's, and a FAIL (exit 3) stops the chain
    before training. VITP_MIN_BUSBW goes from this shell when set; unset, the nodes' own (else 0)."""
    assert PRETRAIN_JOBS
    spec = load_spec(str(path), OVERRIDES, environ=ENV)
    doctor, pretrain = spec.calls
    assert (doctor.subcommand, pretrain.subcommand) == ("doctor", "pretrain")
    assert doctor.recipe == pretrain.recipe and doctor.overrides == pretrain.overrides
    assert pretrain.overrides[-len(OVERRIDES):] == OVERRIDES
    assert "VITP_MIN_BUSBW" not in spec.kwargs["runtime_env"]["env_vars"]  # unset here: not sent
    out, calls = run_shell("sh", spec.entrypoint, ENV, stubs)
    assert out.returncode == 0, out.stderr
    assert calls[0][:5] == ["vitp", "doctor", doctor.recipe, "--allreduce", "--min-busbw"] and calls[0][5] == "0"
    assert [c[1] for c in calls] == ["doctor", "pretrain"]
    # This shell's VITP_MIN_BUSBW is sent (runtime_env), else the nodes' own stands; either way a
    # FAIL (the stub exits 1 for `doctor`) stops the chain before training.
    sent = load_spec(str(path), environ={**ENV, "VITP_MIN_BUSBW": "100"}).kwargs["runtime_env"]["env_vars"]
    assert sent["VITP_MIN_BUSBW"] == "100"
    for cluster_env in (sent, {"VITP_MIN_BUSBW": "100"}):  # from this shell; the nodes' own
        out, calls = run_shell("sh", spec.entrypoint, {**ENV, **cluster_env, "STUB_FAIL": "doctor"}, stubs)
        assert out.returncode == 1 and [c[1] for c in calls] == ["doctor"], calls
        assert calls[0][5] == "100"


def test_every_value_option_of_a_recipe_command_is_not_taken_for_its_recipe():
    """`vitp doctor --min-busbw 100 b16_i21k`: the parser knows which options take a value, from
    vitp's own argument parsers."""
    import argparse

    from vitp.cli import build_parser
    from vitp.cluster.entrypoint import RECIPE_COMMANDS

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name in sorted(RECIPE_COMMANDS):
        for action in sub.choices[name]._actions:
            for opt in action.option_strings if action.nargs != 0 and action.dest != "help" else ():
                if opt.startswith("--") and opt not in ("--config", "--like"):  # RECIPE's own spellings
                    (call,) = parse_entrypoint(f"vitp {name} {opt} 100 debug")
                    assert call.recipe == "debug", (name, opt)


@pytest.mark.parametrize("shell", SHELLS)
def test_redirections_pipes_defaults_and_comments_survive(shell, stubs, tmp_path):
    ep = ("cd ${WORK_DIR:-/} && vitp pretrain debug --set work_dir=${OUT:-/tmp/default} 2>&1 | "
          "tee $LOGS/pretrain.log; echo done > $LOGS/after.txt # trailing comment\n"
          "vitp --debug finetune debug_finetune --from scratch >$LOGS/ft.log 2>$LOGS/ft.err")
    env = {"LOGS": str(tmp_path)}
    out, calls = run_shell(shell, add_overrides(ep, ["train.steps=3", "tracking.run_name=a b"]), env, stubs)
    assert out.returncode == 0, out.stderr
    assert calls == [
        ["vitp", "pretrain", "debug", "--set", "work_dir=/tmp/default", "--set", "train.steps=3",
         "--set", "tracking.run_name=a b"],
        ["vitp", "--debug", "finetune", "debug_finetune", "--from", "scratch", "--set", "train.steps=3",
         "--set", "tracking.run_name=a b"],
    ]
    assert (tmp_path / "pretrain.log").read_text().split() == ["out", "err"]  # 2>&1 | tee kept
    assert (tmp_path / "after.txt").read_text() == "done\n"
    assert (tmp_path / "ft.log").read_text() == "out\n" and (tmp_path / "ft.err").read_text() == "err\n"


def test_recipe_prefix_sends_an_override_to_that_recipe_only():
    ep = "vitp preprocess finetune_cifar10 && vitp preprocess finetune_pets"
    calls = parse_entrypoint(add_overrides(ep, ["train.seed=1", "finetune_pets:data.val_fraction=0.1"]))
    assert [c.overrides for c in calls] == [["train.seed=1"], ["train.seed=1", "data.val_fraction=0.1"]]


def test_a_sweep_over_several_datasets_gets_the_prefix_and_applies_it_to_that_dataset():
    ep = ("vitp preprocess finetune_pets && vitp sweep finetune_cifar10 --from scratch "
          "--datasets finetune_cifar10,finetune_pets --set finetune_cifar10:data.path=/d/c10")
    calls = parse_entrypoint(add_overrides(ep, ["finetune_pets:data.val_fraction=0.1", "train.seed=3"]))
    assert [c.recipes for c in calls] == [["finetune_pets"], ["finetune_cifar10", "finetune_pets"]]
    # the preprocess gets the plain key; the sweep keeps the prefix, for its pets trials only
    assert calls[0].overrides == ["data.val_fraction=0.1", "train.seed=3"]
    assert calls[1].overrides == ["finetune_cifar10:data.path=/d/c10", "finetune_pets:data.val_fraction=0.1",
                                  "train.seed=3"]
    c10, pets = calls[1].configs()
    assert (c10.recipe, c10.data.path, c10.train.seed) == ("finetune_cifar10", "/d/c10", 3)
    assert c10.data.val_fraction != 0.1 and pets.data.val_fraction == 0.1 and pets.data.path != "/d/c10"
    with pytest.raises(ConfigError, match=r"runs no recipe 'finetune_flowers'; its recipes: finetune_cifar10, "
                                          r"finetune_pets$"):
        add_overrides(ep, ["finetune_flowers:train.steps=3"])
    with pytest.raises(ConfigError, match="no recipe 'finetune_flowers'.*finetune_cifar10, finetune_pets"):
        add_overrides(ep, ["finetune_flowers:train.seed=1"])
    with pytest.raises(ConfigError, match="needs a `vitp <command> RECIPE`"):
        add_overrides("vitp export /x && echo hi", ["train.seed=1"])


def test_a_variable_in_a_set_value_is_refused_with_the_fix():
    # Quoted it would reach the job as literal text (a directory named `$VITP_STORE`).
    for value in ("work_dir=$VITP_STORE/x", "work_dir=${VITP_STORE}/x", "work_dir=$(pwd)"):
        with pytest.raises(ConfigError, match="literal text.*let your shell expand it"):
            add_overrides("vitp pretrain debug", [value])
    assert add_overrides("vitp pretrain debug", ["tracking.run_name=cost$"]).endswith("'tracking.run_name=cost$'")


# ------------------------------------------------------------------ KubeRay RayJob submitter


def _generator():
    """cluster/kuberay/generate.py (not a package: loaded from its path)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("kuberay_generate", ROOT / "cluster" / "kuberay" / "generate.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def submitter_command(job: dict, version: str) -> str:
    """The submitter pod's command for a K8sJobMode RayJob, as KubeRay builds it (BuildJobSubmitCommand
    in ray-operator/controllers/ray/common/job.go, v1.5.1 and v1.7.0): words joined by spaces, the
    entrypoint pasted unquoted, run as `/bin/bash -ce -- <command>`."""
    spec, job_id = job["spec"], job["metadata"]["name"] + "-x7k2p"
    address = f"http://{job['metadata']['name']}-raycluster-head-svc.vit.svc.cluster.local:8265"
    cmd = []
    if version == "v1.7.0":  # waits for the dashboard's GCS health first
        health = ("python -c \"import urllib.request; r=urllib.request.urlopen('%s', timeout=%d); "
                  "exit(0 if b'success' in r.read() else 1)\"") % (address + "/api/gcs_healthz", 10)
        cmd += ["until", health, ">/dev/null", "2>&1", ";", "do", "echo",
                json.dumps(f"Waiting for Ray Dashboard GCS to become healthy at {address} ..."), ";",
                "sleep", "2", ";", "done", ";"]
    cmd += ["if", "!", "ray", "job", "status", "--address", address, job_id, ">/dev/null", "2>&1", ";", "then",
            "ray", "job", "submit", "--address", address, "--no-wait"]
    if spec.get("runtimeEnvYAML"):  # Go's strconv.Quote of the JSON == json.dumps for ASCII
        cmd += ["--runtime-env-json", json.dumps(json.dumps(yaml.safe_load(spec["runtimeEnvYAML"]), separators=(",", ":")))]
    if spec.get("metadata"):
        cmd += ["--metadata-json", json.dumps(json.dumps(spec["metadata"], separators=(",", ":")))]
    cmd += ["--submission-id", job_id]
    if spec.get("entrypointNumCpus"):
        cmd += ["--entrypoint-num-cpus", "%f" % spec["entrypointNumCpus"]]
    cmd += ["--", spec["entrypoint"].strip(), ";", "fi", ";", "ray", "job", "logs", "--address", address,
            "--follow", job_id]
    return " ".join(cmd)


@pytest.mark.parametrize("version", ["v1.5.1", "v1.7.0"])
@pytest.mark.parametrize("path", RAYJOBS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_rayjob_entrypoint_reaches_the_cluster_intact(path, version, stubs):
    job = yaml.safe_load(path.read_text())
    (stem,) = [k for k, v in _generator().STAGES.items() if v == job["metadata"]["name"]]
    raw = yaml.safe_load((ROOT / "jobs" / f"{stem}.yaml").read_text())["entrypoint"]
    # The submitter pod: no VITP_STORE, PRETRAINED or MLFLOW_TRACKING_URI there.
    out, calls = run_shell("bash", submitter_command(job, version), {}, stubs, "-e")
    assert out.returncode == 0, out.stderr
    assert not [c for c in calls if c[0] == "vitp"], "a vitp command ran in the submitter pod"
    (submit,) = [c for c in calls if c[:3] == ["ray", "job", "submit"]]
    assert json.loads(submit[submit.index("--runtime-env-json") + 1]) == yaml.safe_load(job["spec"]["runtimeEnvYAML"])
    # `ray job submit -- ARGS` sends shlex.join(ARGS) (ray/dashboard/modules/job/cli.py)
    sent = shlex.join(submit[submit.index("--") + 1:])
    for var in ("$VITP_STORE", "$PRETRAINED", "$MLFLOW_TRACKING_URI"):
        assert (var in sent) == (var in raw), var
    # The driver runs it with /bin/sh -c, the runtime env's variables and its pod's (VITP_STORE and
    # PRETRAINED from ConfigMap vit-store, as the cloud's accounts/ path makes it): every call of the spec.
    from .test_manifest_schemas import _render

    (store,) = [d["data"] for d in _render(ROOT / "cluster" / "overlays" / path.parent.name / "accounts")
                if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "vit-store"]
    cluster_env = {**store, **yaml.safe_load(job["spec"]["runtimeEnvYAML"])["env_vars"]}
    out, calls = run_shell("sh", sent, cluster_env, stubs)
    assert out.returncode == 0, out.stderr
    assert calls == expected_calls(raw, cluster_env, [])
