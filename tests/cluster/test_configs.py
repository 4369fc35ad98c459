"""Static checks of everything under jobs/ and cluster/, and of `vitp submit`'s pre-flight:
spec validation, recipe resolution, secret masking and the working_dir upload limit."""
import json
import os
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import ray
import yaml

from pipeline.cluster.jobspec import add_overrides, check_upload_size, load_spec, parse_entrypoint
from pipeline.errors import ConfigError

from .conftest import ROOT, vitp

JOBS = sorted((ROOT / "jobs").glob("*.yaml"))
LAUNCHER = [ROOT / "cluster" / "aws.yaml", ROOT / "cluster" / "gcp.yaml"]
KUBERAY = sorted((ROOT / "cluster" / "kuberay").glob("ray*.yaml"))
ENV = {"VITP_STORE": "s3://bucket/vit", "PRETRAINED": "s3://bucket/vit/h14_i21k/export"}


def test_there_is_a_job_spec_per_stage():
    names = {p.stem for p in JOBS}
    assert {"debug_pretrain", "preprocess_i21k", "pretrain_b16_i21k", "pretrain_l16_i21k",
            "pretrain_h14_i21k", "finetune_sweep", "fewshot"} <= names


@pytest.mark.parametrize("path", JOBS, ids=lambda p: p.name)
def test_every_job_spec_resolves_its_recipe(path):
    spec = load_spec(str(path), environ=ENV)  # resolves every recipe, check_paths=False
    assert spec.calls and all(c.recipe for c in spec.calls if c.subcommand != "compare")
    from ray.job_submission import JobSubmissionClient
    import inspect

    accepted = set(inspect.signature(JobSubmissionClient.submit_job).parameters)
    assert set(spec.kwargs) <= accepted


def test_h14_spec_is_the_h14_recipe_on_object_storage():
    spec = load_spec(str(ROOT / "jobs" / "pretrain_h14_i21k.yaml"), environ=ENV)
    from pipeline import recipes

    call = spec.calls[0]
    cfg = recipes.resolve(call.recipe, call.overrides, check_paths=False)
    assert cfg.model.variant == "H/14" and cfg.data.source == "parquet"
    assert spec.kwargs["runtime_env"]["env_vars"]["VITP_STORE"] == "s3://bucket/vit"


@pytest.mark.parametrize("path", LAUNCHER, ids=lambda p: p.name)
def test_launcher_yaml_validates_against_rays_schema(path):
    schema = json.loads((Path(ray.__file__).parent / "autoscaler" / "ray-schema.json").read_text())
    config = yaml.safe_load(path.read_text())
    jsonschema.validate(config, schema)
    types = config["available_node_types"]
    assert any(t.get("resources", {}).get("GPU") for t in types.values())  # GPU workers
    assert any(n != config["head_node_type"] and not t.get("resources", {}).get("GPU")
               for n, t in types.items())  # CPU data workers
    starts = " ".join(config["head_start_ray_commands"] + config["worker_start_ray_commands"])
    assert starts.count("RAY_AUTH_MODE=token") == 2
    assert "--dashboard-host=127.0.0.1" in starts and "0.0.0.0" not in starts


def test_launcher_schema_check_can_fail():
    schema = json.loads((Path(ray.__file__).parent / "autoscaler" / "ray-schema.json").read_text())
    bad = yaml.safe_load(LAUNCHER[0].read_text())
    bad["available_node_types"]["gpu"]["resources"]["GPU"] = "eight"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)


def _check_cluster_spec(spec: dict, where: str):
    assert spec["rayVersion"] >= "2.52", where
    assert spec["authOptions"]["mode"] == "token", where
    head = spec["headGroupSpec"]
    assert "rayStartParams" in head and head["template"]["spec"]["containers"], where
    assert head.get("serviceType", "ClusterIP") == "ClusterIP" and not head.get("enableIngress"), where
    for c in head["template"]["spec"]["containers"]:
        assert c["name"] and ":" in c["image"] and not c["image"].endswith(":latest"), where
    groups = {g["groupName"]: g for g in spec["workerGroupSpecs"]}
    for g in groups.values():
        for key in ("groupName", "minReplicas", "maxReplicas", "rayStartParams", "template"):
            assert key in g, f"{where}: workerGroupSpecs[{g.get('groupName')}] lacks {key}"
    gpu = groups["gpu"]["template"]["spec"]
    assert gpu["nodeSelector"] and gpu["tolerations"], where
    assert any("nvidia.com/gpu" in c["resources"]["limits"] for c in gpu["containers"]), where
    assert "cpu-data" in groups, where
    mounts = [m["mountPath"] for c in gpu["containers"] for m in c.get("volumeMounts", [])]
    assert "/mnt/shared" in mounts, where


@pytest.mark.parametrize("path", KUBERAY, ids=lambda p: p.name)
def test_kuberay_manifests_name_the_crd_required_fields(path):
    doc = yaml.safe_load(path.read_text())
    assert doc["apiVersion"] == "ray.io/v1" and doc["metadata"]["name"]
    if doc["kind"] == "RayCluster":
        _check_cluster_spec(doc["spec"], path.name)
    else:
        assert doc["kind"] == "RayJob"
        assert doc["spec"]["entrypoint"].startswith("vitp ")
        yaml.safe_load(doc["spec"]["runtimeEnvYAML"])
        _check_cluster_spec(doc["spec"]["rayClusterSpec"], path.name)
        env = [e for c in doc["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"]
               for e in c.get("env", [])]
        assert all("value" not in e for e in env if "PASSWORD" in e["name"])  # secrets via secretKeyRef


def test_there_is_a_rayjob_per_stage_and_they_are_up_to_date():
    kinds = {yaml.safe_load(p.read_text())["kind"] for p in KUBERAY}
    assert kinds == {"RayCluster", "RayJob"}
    assert len([p for p in KUBERAY if p.name.startswith("rayjob-")]) == 6
    out = subprocess.run([sys.executable, str(ROOT / "cluster" / "kuberay" / "generate.py"), "--check"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_mlflow_manifest_parses_and_requires_auth():
    docs = [d for d in yaml.safe_load_all((ROOT / "cluster" / "mlflow" / "mlflow.yaml").read_text()) if d]
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "Service"} <= kinds
    dep = next(d for d in docs if d["kind"] == "Deployment")
    args = " ".join(dep["spec"]["template"]["spec"]["containers"][0]["args"])
    assert "--auth" in args and "--allowed-hosts" in args
    svc = next(d for d in docs if d["kind"] == "Service")
    assert svc["spec"].get("type", "ClusterIP") == "ClusterIP"


def test_local_sh_binds_loopback_and_uses_token_auth():
    text = (ROOT / "cluster" / "local.sh").read_text()
    assert "--dashboard-host 127.0.0.1" in text and "--node-ip-address 127.0.0.1" in text
    assert "RAY_AUTH_MODE=token" in text and "ray stop" not in text.replace("`ray stop`", "")


# ------------------------------------------------------------------- pre-flight checks


def test_spec_errors_name_the_key_and_the_fix(tmp_path):
    p = tmp_path / "s.yaml"
    p.write_text("entrypoint: vitp pretrain debug\nentrypoint_cpus: 1\n")
    with pytest.raises(ConfigError, match=r"unknown key\(s\) entrypoint_cpus.*entrypoint_num_cpus"):
        load_spec(str(p))
    p.write_text("entrypoint: vitp pretrain no_such_recipe\n")
    with pytest.raises(ConfigError, match="no_such_recipe"):
        load_spec(str(p))
    p.write_text("entrypoint: vitp pretrain debug --set parallel.global_batch=33\n")
    with pytest.raises(ConfigError, match="global_batch"):
        load_spec(str(p))
    p.write_text("entrypoint: vitp pretrain debug\nruntime_env:\n  env_vars:\n    KEY: ${NOT_SET_ANYWHERE}\n")
    with pytest.raises(ConfigError, match=r"NOT_SET_ANYWHERE.*export"):
        load_spec(str(p), environ={})
    p.write_text("entrypoint: echo hello\n")
    with pytest.raises(ConfigError, match="runs no vitp command"):
        load_spec(str(p))


def test_set_overrides_go_into_the_one_recipe_command():
    ep = add_overrides("OMP_NUM_THREADS=1 vitp pretrain debug --set a.b=1", ["work_dir=/tmp/x y"])
    (call,) = parse_entrypoint(ep)
    assert call.recipe == "debug" and call.overrides == ["a.b=1", "work_dir=/tmp/x y"]
    with pytest.raises(ConfigError, match="exactly one"):
        add_overrides("vitp pretrain debug && vitp pretrain debug", ["x=1"])
    calls = parse_entrypoint("python -m pipeline.cli sweep debug_finetune --from s3://b/x --space optim.lr=1,2")
    assert [(c.subcommand, c.recipe) for c in calls] == [("sweep", "debug_finetune")]


def test_submit_never_echoes_secret_env_values(tmp_path):
    p = tmp_path / "s.yaml"
    p.write_text("entrypoint: vitp pretrain debug\nruntime_env:\n  env_vars:\n"
                 "    AWS_SECRET_ACCESS_KEY: ${MY_AWS_SECRET}\n    HF_TOKEN: hf_abcdefghijklmnopqrstuvwxyz\n"
                 "    PLAIN: visible-value\n")
    secret = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
    # No cluster listens on this port: submission fails after everything was printed.
    out = vitp("submit", str(p), "--address", "http://127.0.0.1:9", env={"MY_AWS_SECRET": secret})
    assert out.returncode == 3
    text = out.stdout + out.stderr
    assert secret not in text and "hf_abcdefghijklmnopqrstuvwxyz" not in text
    assert "AWS_SECRET_ACCESS_KEY=***" in text and "PLAIN=visible-value" in text
    assert "cannot reach the Ray jobs API" in out.stderr


def test_working_dir_over_rays_upload_limit_is_refused_with_the_fix(tmp_path):
    wd = tmp_path / "wd"
    (wd / "data").mkdir(parents=True)
    (wd / "train.py").write_text("print('hi')\n")
    with open(wd / "data" / "big.bin", "wb") as f:  # sparse: large on paper, nothing on disk
        f.truncate(600 * 2**20)
    p = tmp_path / "s.yaml"
    p.write_text(f"entrypoint: vitp pretrain debug\nruntime_env:\n  working_dir: {wd}\n")
    spec = load_spec(str(p))
    with pytest.raises(ConfigError, match=r"(?s)over Ray's 512\.0 MiB upload limit.*data 600\.0 MiB.*excludes"):
        check_upload_size(spec)
    out = vitp("submit", str(p), "--address", "http://127.0.0.1:9")
    assert out.returncode == 2 and "upload limit" in out.stderr and ".rayignore" in out.stderr
    # Excluding the data directory (as the message says) makes it fit.
    p.write_text(f"entrypoint: vitp pretrain debug\nruntime_env:\n  working_dir: {wd}\n  excludes: [data/]\n")
    notes = check_upload_size(load_spec(str(p)))
    assert notes and "0.0 MiB" in notes[0]


class _AgentStartingCluster:
    """A jobs endpoint whose head agent is not up for the first `refusals` calls: it answers as
    Ray's job head does then (JobSubmissionClient raises RuntimeError with the HTTP text)."""

    def __init__(self, refusals, error="No available agent to submit job, please try again later."):
        self.refusals, self.error, self.calls = refusals, error, []

    def submit_job(self, **kwargs):
        self.calls.append(kwargs)
        if len(self.calls) <= self.refusals:
            raise RuntimeError(f"Request failed with status code 500: {self.error}.")
        return f"raysubmit_{len(self.calls)}"


def test_submit_retries_only_while_the_job_agent_is_starting():
    from pipeline.cluster.jobs import submit_when_agent_ready

    lines = []
    cluster = _AgentStartingCluster(refusals=2)
    assert submit_when_agent_ready(cluster, {"entrypoint": "echo"}, poll_s=0.01, log=lines.append) == "raysubmit_3"
    assert len(cluster.calls) == 3 and all(c == {"entrypoint": "echo"} for c in cluster.calls)
    assert len(lines) == 2 and "job agent is not up yet" in lines[0]
    # never up: gives up after wait_s with the cluster's own message
    never = _AgentStartingCluster(refusals=10**6)
    with pytest.raises(RuntimeError, match="No available agent"):
        submit_when_agent_ready(never, {}, wait_s=0.05, poll_s=0.01, log=lines.append)
    # any other refusal is not retried: a resubmit could run the job twice
    other = _AgentStartingCluster(refusals=1, error="runtime_env working_dir too large")
    with pytest.raises(RuntimeError, match="too large"):
        submit_when_agent_ready(other, {}, poll_s=0.01, log=lines.append)
    assert len(other.calls) == 1


def test_spec_masks_every_credential_name_the_readme_promises(tmp_path):
    # *_SECRET_*, *_TOKEN, *_PASSWORD, *_KEY: written in the spec itself, not only taken from the shell
    p = tmp_path / "s.yaml"
    p.write_text("entrypoint: vitp pretrain debug\nruntime_env:\n  env_vars:\n"
                 "    AZURE_STORAGE_KEY: azurekey123\n    SSH_KEY: sshkey456\n    MY_SECRET_VALUE: s3cr3t789\n"
                 "    GH_TOKEN: tok012\n    DB_PASSWORD: pw345678\n    PLAIN: visible-value\n")
    spec = load_spec(str(p), environ={})
    shown = "\n".join(spec.describe())
    for value in ("azurekey123", "sshkey456", "s3cr3t789", "tok012", "pw345678"):
        assert value not in shown and value not in spec.mask(f"log line with {value}"), value
    assert "AZURE_STORAGE_KEY=***" in shown and "SSH_KEY=***" in shown and "PLAIN=visible-value" in shown


def test_vitp_debug_before_the_command_still_names_the_recipe():
    (call,) = parse_entrypoint("vitp --debug pretrain debug --set optim.lr=0.01")
    assert (call.subcommand, call.recipe, call.overrides) == ("pretrain", "debug", ["optim.lr=0.01"])
    ep = add_overrides("python -m pipeline.cli --debug finetune debug_finetune --from scratch", ["x.y=1"])
    assert ep.endswith("--set x.y=1")
