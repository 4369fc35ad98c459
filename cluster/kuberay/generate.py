"""Write cluster/kuberay/<cloud>/rayjob-<stage>.yaml from jobs/<stage>.yaml and each overlay's RayCluster.

One source of truth: the entrypoint and metadata come from the job spec, the pods from the RayCluster
as cluster/overlays/<cloud> renders it (`kubectl kustomize`: the node selectors, EFA devices and
NCCL settings of that cloud, exactly as the long-lived cluster has them), the GPU replicas from the
recipe's Train workers. `--check` fails if a file is stale.
"""
from __future__ import annotations

import copy
import json
import math
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
STAGES = {  # job spec -> RayJob name
    "preprocess_i21k": "preprocess-i21k",
    "preprocess_downstream": "preprocess-downstream",
    "pretrain_b16_i21k": "pretrain-b16-i21k",
    "pretrain_l16_i21k": "pretrain-l16-i21k",
    "pretrain_h14_i21k": "pretrain-h14-i21k",
    "finetune_sweep": "finetune-sweep",
    "fewshot": "fewshot",
}
CLOUDS = ("eks", "gke", "gfd")  # cluster/overlays/<cloud> -> cluster/kuberay/<cloud>/
GPUS_PER_NODE = 8
TRAINING_COMMANDS = {"pretrain", "finetune", "sweep"}
# How long a RayJob may run before KubeRay stops it (activeDeadlineSeconds): a hung job must not hold
# the GPUs for ever. Training stages: DEADLINE_MARGIN x the FLOPs model's time at DEADLINE_MFU of an
# H100's dense bf16 peak (preemptions, restarts and slow data included) + DEADLINE_SETUP_S; the others
# (preprocessing, few-shot) a day. A sweep: the same model over the sum of its trials' work (every
# dataset x learning rate of the grid), on the GPUs its cluster has.
H100_BF16_FLOPS = 989e12
DEADLINE_MFU, DEADLINE_MARGIN, DEADLINE_SETUP_S, OTHER_DEADLINE_S = 0.35, 3, 2 * 3600, 24 * 3600
# The submitter pod follows the driver's log (`ray job logs --follow`), which exits non-zero when its
# WebSocket drops; each retry re-attaches (KubeRay runs `ray job status` before submitting:
# common/job.go, BuildJobSubmitCommand, v1.5.1) and costs nothing, but Kubernetes' default of 2
# retries would fail the RayJob, and shutdownAfterJobFinishes would delete the cluster under the job.
SUBMITTER_RETRIES = 50
# A RayJob whose cluster never gets running (GPU nodes the cloud cannot give, an image it cannot pull)
# fails after this long instead of waiting out activeDeadlineSeconds (KubeRay >= 1.7:
# preRunningDeadlineSeconds). Scaling a GPU node pool up and pulling the image take minutes.
PRE_RUNNING_DEADLINE_S = 30 * 60
# The finished job's cluster is kept this long for a look at its logs (every metric is in MLflow).
TTL_AFTER_FINISHED_S = 300
# Secrets reach the pods from a Kubernetes Secret, never from the manifest (raycluster.yaml's env).
SECRET_ENV = ["MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"]
# The bucket (VITP_STORE, PRETRAINED): one ConfigMap per cloud, made by cluster/overlays/<cloud>/accounts.
STORE_CONFIGMAP = "vit-store"


def cluster_entrypoint(entrypoint: str) -> str:
    """The spec's entrypoint as one `bash -c '...'` word list.

    In K8sJobMode the operator pastes spec.entrypoint unquoted into the submitter pod's
    `bash -ce "... ray job submit ... -- ENTRYPOINT ; ..."`. Unwrapped, $VITP_STORE etc. would
    expand there (where they are unset) and `&&` would run the later commands in that pod. Quoted,
    the submitter passes it literally; `ray job submit` re-joins it with shlex.join and the driver's
    shell runs it on the cluster, where runtimeEnvYAML sets the variables.
    """
    return "bash -c " + shlex.quote(entrypoint.strip())


def _flops(cfg) -> float:
    from vitp.model.flops import training_flops

    return training_flops(cfg.model.variant, cfg.data.image_size, cfg.model.num_classes,
                          cfg.model.representation_size) * cfg.train.steps * cfg.parallel.global_batch


def deadline_s(configs: list, gpus: int) -> int:
    """activeDeadlineSeconds for a stage whose training runs are `configs` on `gpus` GPUs (DEADLINE_*)."""
    if not configs:
        return OTHER_DEADLINE_S
    seconds = sum(_flops(cfg) for cfg in configs) / (gpus * H100_BF16_FLOPS * DEADLINE_MFU)
    return int(math.ceil((DEADLINE_MARGIN * seconds + DEADLINE_SETUP_S) / 3600)) * 3600


def _trials(call, source: str | None) -> list:
    """The resolved config of every training run `call` makes: a pre-training's one; a sweep's every
    trial (each dataset's recipe x its grid), with the model of the pre-training it starts from."""
    if call.subcommand not in TRAINING_COMMANDS:
        return []
    if call.subcommand != "sweep":
        return call.configs()[:1]
    from vitp import recipes
    from vitp.tune.space import grid_size, parse_space

    variant = recipes.resolve(source, []).model.variant if source else None
    trials = []
    for cfg in call.configs():
        if variant:
            cfg.model.variant = variant
        trials += [cfg] * (cfg.tune.num_samples * grid_size(parse_space(cfg.tune.space), cfg.tune.search))
    return trials


def _check_env(cspec: dict) -> None:
    """Every container has the tracking login from Secret vit-secrets and the bucket from ConfigMap vit-store."""
    for group in [cspec["headGroupSpec"], *cspec["workerGroupSpecs"]]:
        for c in group["template"]["spec"]["containers"]:
            have = {e["name"] for e in c.get("env", []) if "secretKeyRef" in e.get("valueFrom", {})}
            where = f"raycluster.yaml: container {c['name']} of {group.get('groupName', 'head')}"
            if not set(SECRET_ENV) <= have:
                raise SystemExit(f"{where} lacks {sorted(set(SECRET_ENV) - have)} from Secret vit-secrets")
            if {"configMapRef": {"name": STORE_CONFIGMAP, "optional": False}} not in c.get("envFrom", []):
                raise SystemExit(f"{where} lacks envFrom ConfigMap {STORE_CONFIGMAP} (VITP_STORE)")


def submitter(head: dict) -> dict:
    """The submitter pod: KubeRay's default (the head's image, 500m / 200Mi requested) as ServiceAccount
    vit-ray (its image pull secrets) on the head's nodes. KubeRay fills in the command, the
    dashboard's address and the auth token, as for its own (rayjob_controller.go,
    configureSubmitterContainer, v1.5+)."""
    pod = head["template"]["spec"]
    return {"spec": {
        "serviceAccountName": pod["serviceAccountName"],
        "restartPolicy": "Never",
        **({"nodeSelector": pod["nodeSelector"]} if "nodeSelector" in pod else {}),
        "containers": [{"name": "ray-job-submitter", "image": pod["containers"][0]["image"],
                        "resources": {"requests": {"cpu": "500m", "memory": "200Mi"},
                                      "limits": {"cpu": "1", "memory": "1Gi"}}}]}}


def rayjob(stage: str, name: str, cluster: dict) -> dict:
    sys.path.insert(0, str(ROOT))
    from vitp.cluster.jobspec import parse_entrypoint

    spec = yaml.safe_load((ROOT / "jobs" / f"{stage}.yaml").read_text())
    calls = [c for c in parse_entrypoint(spec["entrypoint"]) if c.recipe]
    cfg = calls[0].configs()[0]
    trials = [t for c in calls for t in _trials(c, spec.get("metadata", {}).get("source"))]
    cspec = copy.deepcopy(cluster["spec"])
    cspec["enableInTreeAutoscaling"] = False  # a RayJob's cluster is sized for its stage
    cspec.pop("autoscalerOptions", None)
    (gpu,) = [g for g in cspec["workerGroupSpecs"] if g["groupName"] == "gpu"]
    # GPUs only for commands that run Ray Train (few-shot features come from CPU actors); a sweep's
    # trials run side by side on as many GPU nodes as the long-lived cluster may grow to
    gpu_nodes = math.ceil(cfg.parallel.num_workers / GPUS_PER_NODE) if trials else 0
    if any(c.subcommand == "sweep" for c in calls):
        gpu_nodes = max(gpu_nodes, gpu["maxReplicas"])
    gpu["replicas"] = gpu["minReplicas"] = gpu["maxReplicas"] = gpu_nodes
    _check_env(cspec)
    env = {k: v for k, v in (spec.get("runtime_env") or {}).get("env_vars", {}).items()
           if "${" not in str(v)}
    # VITP_STORE and PRETRAINED come from ConfigMap vit-store in every pod (the overlay's accounts/)
    env["MLFLOW_TRACKING_URI"] = "http://mlflow.mlflow.svc.cluster.local:5000"
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayJob",
        "metadata": {"name": name, "labels": {"app.kubernetes.io/part-of": "vit-pipeline",
                                              "vit-pipeline/stage": spec.get("metadata", {}).get("stage", stage)}},
        "spec": {
            "entrypoint": cluster_entrypoint(spec["entrypoint"]),
            "runtimeEnvYAML": yaml.safe_dump({"env_vars": env}, sort_keys=True),
            "metadata": spec.get("metadata", {}),
            **({"entrypointNumCpus": spec["entrypoint_num_cpus"]} if "entrypoint_num_cpus" in spec else {}),
            # a JSON object in a string: the submitter passes it to `ray job submit --entrypoint-resources`
            **({"entrypointResources": json.dumps(spec["entrypoint_resources"], sort_keys=True)}
               if "entrypoint_resources" in spec else {}),
            "shutdownAfterJobFinishes": True,
            "ttlSecondsAfterFinished": TTL_AFTER_FINISHED_S,
            "activeDeadlineSeconds": deadline_s(trials, gpu_nodes * GPUS_PER_NODE),
            "preRunningDeadlineSeconds": PRE_RUNNING_DEADLINE_S,
            "backoffLimit": 0,  # the pipeline resumes from checkpoints; resubmit rather than retry blindly
            "submissionMode": "K8sJobMode",
            "submitterPodTemplate": submitter(cspec["headGroupSpec"]),
            "submitterConfig": {"backoffLimit": SUBMITTER_RETRIES},
            "rayClusterSpec": cspec,
        },
    }


def overlay_cluster(cloud: str) -> dict:
    """The RayCluster as `kubectl apply -k cluster/overlays/<cloud>` would create it."""
    kubectl = shutil.which("kubectl")
    if not kubectl:
        raise SystemExit("generate.py renders cluster/overlays/<cloud> with kubectl's kustomize: install kubectl")
    out = subprocess.run([kubectl, "kustomize", str(ROOT / "cluster" / "overlays" / cloud)],
                         capture_output=True, text=True, timeout=120)
    if out.returncode:
        raise SystemExit(f"kubectl kustomize cluster/overlays/{cloud}: {out.stderr.strip()}")
    (cluster,) = [d for d in yaml.safe_load_all(out.stdout) if d and d["kind"] == "RayCluster"]
    return cluster


def render() -> dict[str, str]:
    out = {}
    for cloud in CLOUDS:
        cluster = overlay_cluster(cloud)
        for stage, name in STAGES.items():
            header = (f"# Generated by cluster/kuberay/generate.py from jobs/{stage}.yaml and the RayCluster of\n"
                      f"# cluster/overlays/{cloud} (raycluster.yaml and the overlay): edit those.\n"
                      f"#   kubectl apply -k cluster/overlays/{cloud}/accounts   # namespaces, ServiceAccount vit-ray with\n"
                      "#                                 # your cloud's identity, ConfigMap vit-store (your bucket)\n"
                      f"#   kubectl -n vit apply -f cluster/kuberay/{cloud}/rayjob-{name}.yaml   # KubeRay >= 1.7\n"
                      f"#   kubectl -n vit logs -f job/{name}     # the submitter's log = the driver's log\n"
                      "# The entrypoint is wrapped in `bash -c '...'` so $VARS and && reach the cluster's driver,\n"
                      "# not the submitter pod (see cluster_entrypoint in generate.py). VITP_STORE and PRETRAINED\n"
                      "# come from ConfigMap vit-store; MLFLOW_TRACKING_USERNAME/PASSWORD from Secret vit-secrets\n"
                      "# (kubectl -n vit create secret generic vit-secrets --from-literal=...): no edit here.\n")
            out[f"{cloud}/rayjob-{name}.yaml"] = header + yaml.safe_dump(rayjob(stage, name, cluster), sort_keys=False,
                                                                        width=100)
    return out


def main(argv: list[str]) -> int:
    stale = []
    for fname, text in render().items():
        path = HERE / fname
        if "--check" in argv:
            if not path.exists() or path.read_text() != text:
                stale.append(fname)
        else:
            path.parent.mkdir(exist_ok=True)
            path.write_text(text)
    if stale:
        print(f"stale: {', '.join(stale)}: run python cluster/kuberay/generate.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
