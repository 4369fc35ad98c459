"""Static checks of everything under jobs/ and cluster/, and of `vitp submit`'s pre-flight:
spec validation, recipe resolution, secret masking and the working_dir upload limit; and that
the Kubernetes manifests, launchers and Dockerfile hold together when applied."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import ray
import yaml

from vitp import recipes
from vitp.cluster.entrypoint import add_overrides, parse_entrypoint
from vitp.cluster.jobspec import load_spec, resolve_recipes
from vitp.cluster.upload import check_upload_size
from vitp.errors import ConfigError

from .conftest import ROOT, vitp

JOBS = sorted((ROOT / "jobs").glob("*.yaml"))
LAUNCHER = [ROOT / "cluster" / "aws.yaml", ROOT / "cluster" / "gcp.yaml"]
KUBERAY = sorted((ROOT / "cluster" / "kuberay").glob("ray*.yaml")) + sorted((ROOT / "cluster" / "kuberay").glob("*/rayjob-*.yaml"))
ENV = {"VITP_STORE": "s3://bucket/vit", "PRETRAINED": "s3://bucket/vit/h14_i21k/export"}


def test_there_is_a_job_spec_per_stage():
    names = {p.stem for p in JOBS}
    assert {"debug_pretrain", "preprocess_i21k", "pretrain_b16_i21k", "pretrain_l16_i21k",
            "pretrain_h14_i21k", "preprocess_downstream", "finetune_sweep", "fewshot"} <= names


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
    from vitp import recipes

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
    # the base is cloud-neutral: the node selector is the overlay's (cluster/overlays/,
    # test_manifest_schemas.py), which the RayJobs of cluster/kuberay/<cloud>/ are built from
    assert ("nodeSelector" in gpu) == (where != "raycluster.yaml") and gpu["tolerations"], where
    pods = [head["template"]["spec"]] + [g["template"]["spec"] for g in groups.values()]
    assert {p.get("serviceAccountName") for p in pods} == {"vit-ray"}, where
    assert any("nvidia.com/gpu" in c["resources"]["limits"] for c in gpu["containers"]), where
    assert "cpu-data" in groups, where
    # GPUs only where Train runs: a GPU-operator node shows its GPUs to any pod that does not say 0
    assert head["rayStartParams"]["num-gpus"] == groups["cpu-data"]["rayStartParams"]["num-gpus"] == "0", where
    assert groups["gpu"]["rayStartParams"]["num-gpus"] == "8", where
    # no pod waits for a claim: checkpoints, shards and exports live in object storage (VITP_STORE)
    claims = [v for p in pods for v in p.get("volumes", []) if "persistentVolumeClaim" in v]
    assert not claims, (where, claims)


@pytest.mark.parametrize("path", KUBERAY, ids=lambda p: str(p.relative_to(ROOT / "cluster" / "kuberay")))
def test_kuberay_manifests_name_the_crd_required_fields(path):
    doc = yaml.safe_load(path.read_text())
    assert doc["apiVersion"] == "ray.io/v1" and doc["metadata"]["name"]
    if doc["kind"] == "RayCluster":
        _check_cluster_spec(doc["spec"], path.name)
    else:
        assert doc["kind"] == "RayJob"
        assert doc["spec"]["entrypoint"].startswith("bash -c 'vitp ")  # see test_jobspec_shell.py
        yaml.safe_load(doc["spec"]["runtimeEnvYAML"])
        _check_cluster_spec(doc["spec"]["rayClusterSpec"], path.name)
        env = [e for c in doc["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"]
               for e in c.get("env", [])]
        assert all("value" not in e for e in env if "PASSWORD" in e["name"])  # secrets via secretKeyRef


def test_there_is_a_rayjob_per_stage_and_they_are_up_to_date():
    kinds = {yaml.safe_load(p.read_text())["kind"] for p in KUBERAY}
    assert kinds == {"RayCluster", "RayJob"}
    # one per stage and cloud overlay
    assert len([p for p in KUBERAY if p.name.startswith("rayjob-")]) == 7 * 3
    out = subprocess.run([sys.executable, str(ROOT / "cluster" / "kuberay" / "generate.py"), "--check"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_every_rayjob_ends_retries_its_log_stream_and_frees_its_cluster_soon():
    """A RayJob has a deadline no shorter than the FLOPs model's time for its training at the peak
    of its GPUs (a sweep's: every trial of its grid, with the pre-trained model's variant, on all the
    GPUs of its cluster); its submitter survives more dropped log streams than Kubernetes' default 2 (each
    retry re-attaches to the same job); its finished cluster goes within ten minutes."""
    from vitp.model.flops import training_flops

    for path in (p for p in KUBERAY if p.name.startswith("rayjob-")):
        spec = yaml.safe_load(path.read_text())["spec"]
        assert spec["submitterConfig"]["backoffLimit"] > 2, path.name
        assert 0 < spec["ttlSecondsAfterFinished"] <= 600, path.name
        assert spec["activeDeadlineSeconds"] > 0, path.name
        if path.name.startswith(("rayjob-pretrain", "rayjob-finetune-sweep")):
            job = yaml.safe_load((ROOT / "jobs" / (path.stem.removeprefix("rayjob-").replace("-", "_") + ".yaml")).read_text())
            (call,) = [c for c in parse_entrypoint(job["entrypoint"]) if c.subcommand in ("pretrain", "sweep")]
            source = job["metadata"].get("source")
            variant = recipes.resolve(source, []).model.variant if source else None
            flops = 0.0
            for cfg in call.configs():
                lrs = len(cfg.tune.space.get("optim.lr", [0])) if call.subcommand == "sweep" else 1
                flops += lrs * (training_flops(variant or cfg.model.variant, cfg.data.image_size, cfg.model.num_classes)
                                * cfg.train.steps * cfg.parallel.global_batch)
            (gpu,) = [g for g in spec["rayClusterSpec"]["workerGroupSpecs"] if g["groupName"] == "gpu"]
            peak_s = flops / (gpu["replicas"] * int(gpu["rayStartParams"]["num-gpus"]) * 989e12)
            assert spec["activeDeadlineSeconds"] > 2 * peak_s, (path.name, peak_s)


def test_mlflow_manifest_parses_and_requires_auth():
    docs = [d for d in yaml.safe_load_all((ROOT / "cluster" / "mlflow" / "mlflow.yaml").read_text()) if d]
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "Service"} <= kinds
    dep = next(d for d in docs if d["kind"] == "Deployment")
    pod = dep["spec"]["template"]["spec"]
    args = " ".join(pod["containers"][0]["args"])
    assert "--auth" in args and "--allowed-hosts" in args
    # the user store's URI (a password inside) goes in by the environment, untouched by any shell
    # or template step (a sed broke on & and |, MLflow's config reader on %)
    env = {e["name"]: e for e in pod["containers"][0]["env"]}
    assert env["MLFLOW_AUTH_DATABASE_URI"]["valueFrom"]["secretKeyRef"]["name"] == "mlflow-auth"
    assert "initContainers" not in pod and "MLFLOW_AUTH_CONFIG_PATH" not in env
    svc = next(d for d in docs if d["kind"] == "Service")
    assert svc["spec"].get("type", "ClusterIP") == "ClusterIP"


def test_local_sh_binds_loopback_and_uses_token_auth():
    text = (ROOT / "cluster" / "local.sh").read_text()
    assert "--dashboard-host 127.0.0.1" in text and "--node-ip-address 127.0.0.1" in text
    assert "RAY_AUTH_MODE=token" in text and "ray stop" not in text.replace("`ray stop`", "")


def test_nothing_leaves_the_cluster_unasked():
    """MLflow's telemetry and Ray's usage stats (vitp.net.TELEMETRY_OFF) are off in every job spec
    unless the submitting shell opts in, in every Ray container of the KubeRay manifests, in the MLflow
    server's, on the launchers' nodes, on cluster/local.sh's nodes (its own node_env, run) and in the image."""
    from vitp.net import TELEMETRY_OFF

    opt_in = {"MLFLOW_DISABLE_TELEMETRY": "false", "RAY_USAGE_STATS_ENABLED": "1"}
    for path in JOBS:
        for shell, want in ((ENV, TELEMETRY_OFF), ({**ENV, **opt_in}, opt_in)):
            env = load_spec(str(path), environ=shell, check_recipe=False).kwargs["runtime_env"]["env_vars"]
            assert {k: env.get(k) for k in TELEMETRY_OFF} == want, path.name
    for path in KUBERAY:
        doc = yaml.safe_load(path.read_text())
        spec = doc["spec"] if doc["kind"] == "RayCluster" else doc["spec"]["rayClusterSpec"]
        for group in [spec["headGroupSpec"], *spec["workerGroupSpecs"]]:
            for c in group["template"]["spec"]["containers"]:
                env = {e["name"]: e.get("value") for e in c.get("env", [])}
                assert {k: env.get(k) for k in TELEMETRY_OFF} == TELEMETRY_OFF, (path.name, group.get("groupName"))
    docs = yaml.safe_load_all((ROOT / "cluster" / "mlflow" / "mlflow.yaml").read_text())
    (server,) = [c for d in docs if d and d["kind"] == "Deployment" for c in d["spec"]["template"]["spec"]["containers"]]
    assert {e["name"]: e.get("value") for e in server["env"]}["MLFLOW_DISABLE_TELEMETRY"] == "true"
    for path in LAUNCHER:
        doc = yaml.safe_load(path.read_text())
        starts = [c for key in ("head_start_ray_commands", "worker_start_ray_commands") for c in doc[key] if "ray start" in c]
        assert len(starts) == 2 and all("MLFLOW_DISABLE_TELEMETRY=true " in c and "--disable-usage-stats" in c
                                        for c in starts), (path.name, starts)
    node_env = re.search(r"^node_env\(\) \{.*?^\}", (ROOT / "cluster" / "local.sh").read_text(), re.M | re.S).group(0)
    for given, want in (({}, TELEMETRY_OFF), (opt_in, opt_in)):
        clean = {k: v for k, v in os.environ.items() if k not in TELEMETRY_OFF}
        out = subprocess.run(["bash", "-c", f"{node_env}\nauth=0 state_dir=/x port=1 BIN=/b; node_env; env"],
                             env={**clean, **given}, capture_output=True, text=True, check=True).stdout
        got = dict(line.split("=", 1) for line in out.splitlines() if line.split("=", 1)[0] in TELEMETRY_OFF)
        assert got == want
    image = (ROOT / "cluster" / "Dockerfile").read_text()
    assert re.search(r"^ENV .*MLFLOW_DISABLE_TELEMETRY=true.*RAY_USAGE_STATS_ENABLED=0", image, re.M)


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


def test_set_overrides_go_into_every_recipe_command():
    ep = add_overrides("OMP_NUM_THREADS=1 vitp pretrain debug --set a.b=1", ["work_dir=/tmp/x y"])
    (call,) = parse_entrypoint(ep)
    assert call.recipe == "debug" and call.overrides == ["a.b=1", "work_dir=/tmp/x y"]
    calls = parse_entrypoint(add_overrides("vitp pretrain debug && vitp compare --recipe debug", ["x=1"]))
    assert [c.overrides for c in calls] == [["x=1"], []]  # compare takes no --set
    calls = parse_entrypoint("python -m vitp.cli sweep debug_finetune --from s3://b/x --space optim.lr=1,2")
    assert [(c.subcommand, c.recipe) for c in calls] == [("sweep", "debug_finetune")]
    calls = parse_entrypoint("vitp pretrain --config s3://b/exp.yaml --set a=1 && vitp finetune --like=0a1b2c "
                             "&& vitp fewshot --like runs:/9f8e")  # RECIPE's other spellings
    assert [(c.recipe, c.overrides) for c in calls] == [("s3://b/exp.yaml", ["a=1"]), ("runs:/0a1b2c", []),
                                                         ("runs:/9f8e", [])]


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
    from vitp.cluster.jobs import submit_when_agent_ready

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
    ep = add_overrides("python -m vitp.cli --debug finetune debug_finetune --from scratch", ["x.y=1"])
    assert ep.endswith("--set x.y=1")


# -------------------------------------------------- the cluster configs work when applied


def _k8s_docs() -> list[tuple[Path, dict]]:
    paths = sorted((ROOT / "cluster").glob("*/*.yaml")) + sorted((ROOT / "cluster" / "kuberay").glob("*/rayjob-*.yaml"))
    return [(p, d) for p in paths
            for d in yaml.safe_load_all(p.read_text())
            if isinstance(d, dict) and d.get("kind") and d["kind"] != "Kustomization"]


def _cluster_doc() -> str:
    return (ROOT / "docs" / "cluster.md").read_text()


def _admits(policy: dict, policy_ns: str, pod_ns: str, pod_labels: dict, port: int) -> bool:
    """Whether a NetworkPolicy's ingress rules admit a pod (Kubernetes semantics, matchLabels only;
    a namespace matches kubernetes.io/metadata.name, the label the API server sets on every one)."""
    def matches(selector, labels):
        assert set(selector) <= {"matchLabels"}, "extend _admits for matchExpressions"
        return all(labels.get(k) == v for k, v in (selector.get("matchLabels") or {}).items())

    def peer_admits(peer):
        ns_ok = (matches(peer["namespaceSelector"], {"kubernetes.io/metadata.name": pod_ns})
                 if "namespaceSelector" in peer else pod_ns == policy_ns)
        return ns_ok and matches(peer.get("podSelector", {}), pod_labels)

    return any((not rule.get("from") or any(peer_admits(p) for p in rule["from"]))
               and (not rule.get("ports") or any(p.get("port") == port for p in rule["ports"]))
               for rule in policy["spec"].get("ingress", []))


def test_networkpolicy_admits_the_kuberay_operator_on_the_dashboard_port():
    readme = _cluster_doc()
    (op_ns,) = re.findall(r"helm install kuberay-operator\b.*--namespace (\S+)", readme)
    policy = yaml.safe_load((ROOT / "cluster" / "kuberay" / "networkpolicy.yaml").read_text())
    (ns,) = set(re.findall(r"kubectl -n (\S+) apply -f cluster/kuberay/", readme))
    # The operator polls and stops RayJobs through the head's dashboard port. Its pod's labels, as
    # KubeRay v1.7.0 writes them: the Helm chart (templates/deployment.yaml, any release name) and
    # the kustomize install (ray-operator/config/manager/manager.yaml, namespace default).
    helm = {"app.kubernetes.io/name": "kuberay-operator", "app.kubernetes.io/instance": "my-release",
            "app.kubernetes.io/component": "kuberay-operator"}
    kustomize = {"app.kubernetes.io/name": "kuberay", "app.kubernetes.io/component": "kuberay-operator"}
    assert _admits(policy, ns, op_ns, helm, 8265) and _admits(policy, ns, "default", kustomize, 8265)
    assert _admits(policy, ns, ns, {"ray.io/node-type": "worker"}, 6379)  # the cluster's own pods
    assert not _admits(policy, ns, "default", {"app": "anything"}, 8265)  # nobody else
    assert not _admits(policy, ns, op_ns, helm, 6379)  # the operator only needs 8265


def test_every_referenced_account_secret_and_configmap_is_defined_or_created():
    readme = _cluster_doc()
    namespace = {d: ns for ns, d in re.findall(r"kubectl -n (\S+) apply -[fk] cluster/(\w+)/", readme)}
    # the overlays apply cluster/kuberay/ in its kustomization's namespace; the RayJobs with -n
    base = yaml.safe_load((ROOT / "cluster" / "kuberay" / "kustomization.yaml").read_text())
    assert base["namespace"] == namespace["kuberay"], (base["namespace"], namespace)

    def ns_of(path: Path, doc: dict) -> str:  # cluster/accounts/ names its own namespaces
        if doc["kind"] == "Namespace":
            return ""
        folder = path.parent.parent.name if path.name.startswith("rayjob-") else path.parent.name
        return doc["metadata"].get("namespace") or namespace[folder]

    defined = {(ns_of(p, d), d["kind"], d["metadata"]["name"]) for p, d in _k8s_docs()}
    # what each cloud's accounts/ path makes (kustomize's generators: the bucket's ConfigMaps)
    from .test_manifest_schemas import _render
    for accounts in sorted((ROOT / "cluster" / "overlays").glob("*/accounts")):
        made = {(d["metadata"].get("namespace", ""), d["kind"], d["metadata"]["name"]) for d in _render(accounts)}
        assert {("vit", "ConfigMap", "vit-store"), ("mlflow", "ConfigMap", "mlflow-store")} <= made, accounts
        defined |= made
    kinds = {"secret": "Secret", "configmap": "ConfigMap", "serviceaccount": "ServiceAccount"}
    created = {(ns, kinds[kind], name) for ns, kind, name in
               re.findall(r"kubectl -n (\S+) create (secret|configmap|serviceaccount)(?: generic)? (\S+)", readme)}
    refs = set()

    def walk(node, ns):
        if isinstance(node, dict):
            for key, kind in (("secretKeyRef", "Secret"), ("configMapKeyRef", "ConfigMap"),
                              ("secretRef", "Secret"), ("configMapRef", "ConfigMap"), ("configMap", "ConfigMap")):
                if isinstance(node.get(key), dict) and "name" in node[key]:
                    refs.add((ns, kind, node[key]["name"]))
            if isinstance(node.get("secret"), dict):
                refs.add((ns, "Secret", node["secret"]["secretName"]))
            if "serviceAccountName" in node:
                refs.add((ns, "ServiceAccount", node["serviceAccountName"]))
            if "claimName" in node:
                refs.add((ns, "PersistentVolumeClaim", node["claimName"]))
            refs.update((ns, "Secret", s["name"]) for s in node.get("imagePullSecrets", []))
            for v in node.values():
                walk(v, ns)
        elif isinstance(node, list):
            for v in node:
                walk(v, ns)

    for p, d in _k8s_docs():
        walk(d, ns_of(p, d))
    assert {r[1] for r in refs} >= {"Secret", "ServiceAccount"}  # the walk finds them
    assert ("mlflow", "ServiceAccount", "mlflow") in refs and ("vit", "ServiceAccount", "vit-ray") in refs
    assert refs - defined - created == set()


def test_mlflow_image_has_the_sql_driver_and_bucket_clients_its_stores_need():
    dep = next(d for _, d in _k8s_docs() if d["kind"] == "Deployment" and d["metadata"]["name"] == "mlflow")
    dockerfile = (ROOT / "cluster" / "Dockerfile").read_text()
    (tag,) = set(re.findall(r"docker build -f cluster/Dockerfile -t (\S+) \.", dockerfile))
    assert {c["image"] for c in dep["spec"]["template"]["spec"]["containers"]} == {tag}
    installs = " ".join(line for line in dockerfile.replace("\\\n", " ").splitlines() if "pip install" in line)
    secret_help = (ROOT / "cluster" / "mlflow" / "mlflow.yaml").read_text()
    assert "BACKEND_STORE_URI='postgresql://" in secret_help and "psycopg2-binary" in installs
    # the artifact bucket from ConfigMap mlflow-store, one per cloud (s3:// or gs://)
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    assert "--artifacts-destination=$(MLFLOW_ARTIFACTS_DESTINATION)" in container["args"]
    (env,) = [e for e in container["env"] if e["name"] == "MLFLOW_ARTIFACTS_DESTINATION"]
    assert env["valueFrom"]["configMapKeyRef"] == {"name": "mlflow-store", "key": "MLFLOW_ARTIFACTS_DESTINATION",
                                                   "optional": False}
    assert "boto3" in installs and "google-cloud-storage" in installs


def _dockerignored(patterns: list[str], path: str) -> bool:
    """Docker's rule: a path is excluded when it or a parent matches the last matching pattern."""
    def rx(p):
        p = p.strip("/")
        return re.compile("^" + re.escape(p).replace(r"\*\*/", "(.*/)?").replace(r"\*", "[^/]*")
                          .replace(r"\?", "[^/]") + "$")
    parts = path.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    excluded = False
    for p in patterns:
        neg = p.startswith("!")
        if any(rx(p.lstrip("!")).match(x) for x in prefixes):
            excluded = not neg
    return excluded


def test_dockerfile_context_and_layer_order():
    ignore = ROOT / "cluster" / "Dockerfile.dockerignore"  # BuildKit: <Dockerfile>.dockerignore
    patterns = [line.strip() for line in ignore.read_text().splitlines() if line.strip() and not line.startswith("#")]
    for path in (".git/HEAD", ".venv/bin/python", "work/debug/mlflow.db", "vitp/__pycache__/x.pyc",
                 ".pytest_cache/v", "vit_pipeline.egg-info/PKG-INFO"):
        assert _dockerignored(patterns, path), path
    for path in ("vitp/cli/__init__.py", "pyproject.toml", "README.md", "jobs/fewshot.yaml"):
        assert not _dockerignored(patterns, path), path
    lines = [line for line in (ROOT / "cluster" / "Dockerfile").read_text().splitlines() if not line.startswith("#")]
    text = "\n".join(lines)
    copy_all = next(i for i, line in enumerate(lines) if re.match(r"COPY .*\s\.\s", line))
    torch = next(i for i, line in enumerate(lines) if "torch==" in line)
    assert torch < copy_all  # a source edit does not reinstall torch / DeepSpeed
    # torch 2.13 is built for CUDA 12.6, 13.0 and 13.2 (no cu128 wheels, per the issue)
    index = re.search(r"download\.pytorch\.org/whl/(cu\d+)", text).group(1)
    assert re.search(r'"torch==2\.13\.\d+"', text) and index in {"cu126", "cu130", "cu132"}


def test_gpu_nodes_have_cpus_to_spare_beside_their_train_workers():
    """A GPU node's Ray CPUs exceed what its 8 Train workers take (the recipes' cpus_per_worker),
    so a Ray Data task or a few-shot probe actor placed there does not wait for a CPU for ever."""
    from vitp.recipes import resolve

    need = max(8 * resolve(r, [], check_paths=False).parallel.cpus_per_worker
               for r in ("b16_i21k", "l16_i21k", "h14_i21k", "finetune_cifar10"))
    spec = yaml.safe_load((ROOT / "cluster" / "kuberay" / "raycluster.yaml").read_text())["spec"]
    (gpu,) = [g for g in spec["workerGroupSpecs"] if g["groupName"] == "gpu"]
    cpus = {"kuberay": float(gpu["rayStartParams"]["num-cpus"])}
    for launcher in LAUNCHER:
        types = yaml.safe_load(launcher.read_text())["available_node_types"]
        cpus[launcher.name] = float(types["gpu"]["resources"]["CPU"])
    assert all(c >= need + 16 for c in cpus.values()), (need, cpus)
    limits = gpu["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert float(limits["cpu"]) >= cpus["kuberay"]  # the pod really has them


def test_every_manifest_runs_the_image_the_dockerfile_builds_and_its_tag_names_torchs_cuda():
    """One image tag everywhere (launchers, KubeRay, MLflow, docs), the one the Dockerfile's build
    line writes, and its cuXXX is the CUDA build of the torch inside, not the base image's."""
    dockerfile = (ROOT / "cluster" / "Dockerfile").read_text()
    (tag,) = set(re.findall(r"docker build -f cluster/Dockerfile -t (\S+) \.", dockerfile))
    index = re.search(r"TORCH_INDEX_URL=https://download\.pytorch\.org/whl/(cu\d+)", dockerfile).group(1)
    assert tag.endswith(f"-{index}"), (tag, index)
    files = [p for p in (ROOT / "cluster").rglob("*.yaml")] + [ROOT / "docs" / "cluster.md"]
    images = {m for p in files for m in re.findall(r"ghcr\.io/your-org/vit-pipeline:\S+", p.read_text())}
    assert images == {tag}, images


def test_every_gpu_install_line_names_a_published_torch_build():
    """The install lines users copy (README, Makefile) name a CUDA index torch 2.13 is built for."""
    for name in ("README.md", "Makefile", "cluster/Dockerfile"):
        indexes = re.findall(r"download\.pytorch\.org/whl/(cu\d+)", (ROOT / name).read_text())
        assert indexes and set(indexes) <= {"cu126", "cu130", "cu132"}, (name, indexes)


@pytest.mark.parametrize("path", LAUNCHER, ids=lambda p: p.name)
def test_launcher_host_commands_use_rays_docker_mount_path(path):
    from ray.autoscaler.sdk import get_docker_host_mount_location

    config = yaml.safe_load(path.read_text())
    assert config.get("docker")  # with docker, file_mounts land under Ray's host mount directory
    host_root = get_docker_host_mount_location(config["cluster_name"])
    init = " ".join(config["initialization_commands"])  # run on the host, before the container
    for target in config["file_mounts"]:
        host_path = f"{host_root}/{target.lstrip('/')}"
        assert target not in init.replace(host_path, ""), f"{target}: on the host it is {host_path}"
    assert any(f"{host_root}/" in c and "chmod 600" in c for c in config["initialization_commands"])
    starts = " ".join(config["head_start_ray_commands"] + config["worker_start_ray_commands"])
    token_paths = set(re.findall(r"RAY_AUTH_TOKEN_PATH=(\S+)", starts))
    assert token_paths and token_paths <= set(config["file_mounts"])  # the container sees the target


def _ray_aws_provider_actions() -> set[str]:
    """The EC2 API actions Ray's AWS node provider (which runs on the head) calls, read from its
    installed source: boto3's snake_case methods as IAM action names."""
    src = (Path(ray.__file__).parent / "autoscaler" / "_private" / "aws" / "node_provider.py").read_text()
    calls = set(re.findall(r"\.(create_instances|create_tags|start_instances|stop_instances|terminate_instances|"
                           r"describe_\w+|instances\.filter)\b", src))  # called, or taken as a function
    assert {"create_instances", "terminate_instances", "instances.filter"} <= calls, calls  # still found
    named = {"create_instances": "RunInstances", "instances.filter": "DescribeInstances"}
    return {"ec2:" + named.get(c, "".join(w.title() for w in c.split("_"))) for c in calls}


def _allowed(policy: dict) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for st in policy["Statement"]:
        assert st["Effect"] == "Allow"
        for action in [st["Action"]] if isinstance(st["Action"], str) else st["Action"]:
            out.setdefault(action, set()).add(st["Resource"])
    return out


def test_aws_nodes_boot_a_gpu_image_with_docker_and_the_head_may_launch_the_workers():
    """A plain Ubuntu AMI has no Docker, driver or container toolkit; Ray skips its IAM set-up when
    the head names a profile, so that profile must allow what Ray's provider calls, pass the workers'
    role and read the AMI's SSM parameter; the workers' profile reaches the bucket and nothing else."""
    config = yaml.safe_load((ROOT / "cluster" / "aws.yaml").read_text())
    profiles = {}
    for name, node in config["available_node_types"].items():
        image = node["node_config"]["ImageId"]
        assert re.fullmatch(r"resolve:ssm:/aws/service/deeplearning/ami/x86_64/base-oss-nvidia-driver-gpu-"
                            r"ubuntu-\d\d\.\d\d/latest/ami-id", image), (name, image)
        profiles[name] = node["node_config"]["IamInstanceProfile"]["Name"]
    head_profile = profiles.pop(config["head_node_type"])
    (worker_profile,) = set(profiles.values())
    assert head_profile != worker_profile
    policies = ROOT / "cluster" / "aws"
    head = _allowed(json.loads((policies / "head-policy.json").read_text()))
    worker = _allowed(json.loads((policies / "worker-policy.json").read_text()))
    assert _ray_aws_provider_actions() <= set(head), _ray_aws_provider_actions() - set(head)
    assert head["iam:PassRole"] == {f"arn:aws:iam::ACCOUNT_ID:role/{worker_profile}"}
    ssm = image.removeprefix("resolve:ssm:")
    assert any(ssm.startswith(r.split(":parameter", 1)[1].rstrip("*")) for r in head["ssm:GetParameters"])
    storage = {"s3:ListBucket", "s3:GetObject", "s3:PutObject", "s3:DeleteObject"}
    assert storage <= set(head) and storage <= set(worker)
    pull = {"ecr:GetAuthorizationToken", "ecr:BatchGetImage", "ecr:GetDownloadUrlForLayer",
            "ecr:BatchCheckLayerAvailability"}  # the image, when it is in ECR (test_cloud_nodes.py)
    assert all(a.startswith("s3:") or a in pull for a in worker), worker
    setup = (policies / "setup.sh").read_text()
    assert all(f"vit-pipeline-ray-{who}" in (head_profile, worker_profile) for who in ("head", "worker"))
    assert '"vit-pipeline-ray-$who"' in setup


@pytest.mark.parametrize("args,word", [(["123", "bucket", "vpc-0123456789abcdef0", "203.0.113.7/32"], "ACCOUNT_ID"),
                                       (["123456789012", "s3://b/x", "vpc-0123456789abcdef0", "203.0.113.7/32"], "BUCKET")])
def test_aws_setup_refuses_a_bad_account_or_bucket_before_any_call(args, word):
    out = subprocess.run(["bash", str(ROOT / "cluster" / "aws" / "setup.sh"), *args], capture_output=True,
                         text=True, env={"PATH": "/usr/bin:/bin"})  # no aws CLI on this PATH: refused first
    assert out.returncode == 2 and word in out.stderr, out.stderr


@pytest.mark.parametrize("args,word", [(["X", "bucket"], "PROJECT_ID"), (["my-project", "gs://b"], "BUCKET")])
def test_gcp_setup_refuses_a_bad_project_or_bucket_before_any_call(args, word):
    out = subprocess.run(["bash", str(ROOT / "cluster" / "gcp" / "setup.sh"), *args], capture_output=True,
                         text=True, env={"PATH": "/usr/bin:/bin"})
    assert out.returncode == 2 and word in out.stderr, out.stderr


def test_gcp_nodes_run_as_the_account_setup_creates_with_the_roles_the_head_needs():
    """Every node runs as the account cluster/gcp/setup.sh creates; it grants what the head's
    autoscaler needs to create and delete workers and give them that account, and the bucket."""
    config = yaml.safe_load((ROOT / "cluster" / "gcp.yaml").read_text())
    emails = {a["email"] for node in config["available_node_types"].values()
              for a in node["node_config"]["serviceAccounts"]}
    assert emails == {f"vit-pipeline-ray@{config['provider']['project_id']}.iam.gserviceaccount.com"}, emails
    setup = (ROOT / "cluster" / "gcp" / "setup.sh").read_text()
    assert 'account="vit-pipeline-ray@$project.iam.gserviceaccount.com"' in setup
    assert "--role roles/iam.serviceAccountUser" in setup and "--role roles/storage.objectAdmin" in setup
    assert "for role in roles/compute.instanceAdmin.v1 roles/artifactregistry.reader; do" in setup


def test_gcp_boot_disks_name_a_deep_learning_vm_family_with_a_driver():
    """Deep Learning VM families carry the NVIDIA driver in their name (common-cu128-ubuntu-2204-
    nvidia-570); the -py310 names of older images are no longer published and `ray up` fails."""
    config = yaml.safe_load((ROOT / "cluster" / "gcp.yaml").read_text())
    for name, node in config["available_node_types"].items():
        (disk,) = node["node_config"]["disks"]
        image = disk["initializeParams"]["sourceImage"]
        assert re.fullmatch(r"projects/deeplearning-platform-release/global/images/family/"
                            r"common-cu\d+-ubuntu-\d{4}-nvidia-\d+", image), (name, image)


def test_gcp_scheduling_is_an_object_and_gpu_vms_terminate_on_maintenance():
    config = yaml.safe_load((ROOT / "cluster" / "gcp.yaml").read_text())
    for name, node_type in config["available_node_types"].items():
        scheduling = node_type["node_config"].get("scheduling", {})
        assert isinstance(scheduling, dict), f"{name}: Compute API's Instance.scheduling is an object"
        if node_type.get("resources", {}).get("GPU"):
            assert scheduling.get("onHostMaintenance") == "TERMINATE", name


def test_sweep_and_fewshot_read_the_shards_the_downstream_spec_writes():
    from vitp.config import Run

    def prepared(stem):
        spec = load_spec(str(ROOT / "jobs" / f"{stem}.yaml"), environ=ENV)
        return {(c.data.source, c.data.path, Run.of(c).shards) for c in resolve_recipes(spec)}

    made = prepared("preprocess_downstream")
    assert {s for s, _, _ in made} == {"cifar10", "cifar100", "pets", "flowers", "imagenet"}
    assert prepared("finetune_sweep") == made and prepared("fewshot") <= made  # the sweep: every dataset
    assert "jobs/preprocess_downstream.yaml" in _cluster_doc()


def test_no_shipped_spec_takes_cloud_keys_from_the_shell_and_forward_env_adds_one_with_a_warning(tmp_path):
    """The nodes' identity gives bucket access; a laptop's keys go only when asked (--forward-env),
    masked, with a warning that the Jobs API keeps them and they go stale."""
    from vitp.cluster.jobspec import STATIC_CLOUD_KEYS

    shell = {**ENV, **{k: f"value-of-{k.lower()}" for k in STATIC_CLOUD_KEYS},
             "MLFLOW_TRACKING_URI": "http://mlflow:5000"}
    for path in JOBS:
        spec = load_spec(str(path), environ=shell, check_recipe=False)
        env = (spec.kwargs.get("runtime_env") or {}).get("env_vars") or {}
        assert not set(env) & set(STATIC_CLOUD_KEYS) and not spec.warnings(), path.name
    spec = load_spec(str(ROOT / "jobs" / "pretrain_b16_i21k.yaml"), environ=shell, check_recipe=False,
                     forward_env=["AWS_SECRET_ACCESS_KEY"])
    assert spec.kwargs["runtime_env"]["env_vars"]["AWS_SECRET_ACCESS_KEY"] == "value-of-aws_secret_access_key"
    assert "value-of-aws_secret_access_key" not in "\n".join(spec.describe())
    (warning,) = spec.warnings()
    assert "AWS_SECRET_ACCESS_KEY" in warning and "identity" in warning
    for name, error in (("NOT_SET_HERE", "not set in this shell"), ("BAD-NAME", "not an environment variable")):
        with pytest.raises(ConfigError, match=error):
            load_spec(str(ROOT / "jobs" / "pretrain_b16_i21k.yaml"), environ=shell, check_recipe=False,
                      forward_env=[name])


def test_submit_warns_of_a_forwarded_cloud_key_and_never_prints_it(tmp_path):
    p = tmp_path / "s.yaml"
    p.write_text("entrypoint: vitp pretrain debug\n")
    secret = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
    out = vitp("submit", str(p), "--forward-env", "AWS_SECRET_ACCESS_KEY", "--address", "http://127.0.0.1:9",
               env={"AWS_SECRET_ACCESS_KEY": secret})
    assert out.returncode == 3, out.stderr  # nothing listens there: refused after the checks
    text = out.stdout + out.stderr
    assert secret not in text and "AWS_SECRET_ACCESS_KEY=***" in out.stdout
    assert "warning: this shell's AWS_SECRET_ACCESS_KEY will be sent with the job" in out.stderr


@pytest.mark.parametrize("how", ["flag", "environment"])
def test_submit_gives_the_jobs_their_own_mlflow_address(how):
    """This shell's MLFLOW_TRACKING_URI may be a port-forward the cluster cannot reach: the jobs get
    --job-tracking-uri / $VITP_JOB_TRACKING_URI instead, wherever the spec took it from."""
    jobs_uri = "http://mlflow.mlflow.svc.cluster.local:5000"
    env = {**ENV, "MLFLOW_TRACKING_URI": "http://127.0.0.1:5000"}
    args = ["--job-tracking-uri", jobs_uri] if how == "flag" else []
    if how == "environment":
        env["VITP_JOB_TRACKING_URI"] = jobs_uri
    out = vitp("submit", "jobs/fewshot.yaml", *args, "--address", "http://127.0.0.1:9", env=env)
    assert out.returncode == 3, out.stderr  # nothing listens there: refused after the checks
    assert f"MLFLOW_TRACKING_URI={jobs_uri}" in out.stdout and "127.0.0.1:5000" not in out.stdout, out.stdout
