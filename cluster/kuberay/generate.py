"""Write cluster/kuberay/rayjob-<stage>.yaml from jobs/<stage>.yaml and raycluster.yaml.

One source of truth: the entrypoint and metadata come from the job spec, the cluster shape from
the RayCluster (GPU replicas sized to the recipe's Train workers). `--check` fails if stale.
"""
from __future__ import annotations

import copy
import json
import math
import shlex
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
GPUS_PER_NODE = 8
TRAINING_COMMANDS = {"pretrain", "finetune", "sweep"}
# How long a RayJob may run before KubeRay stops it (activeDeadlineSeconds): a hung job must not hold
# the GPUs for ever. Training stages: DEADLINE_MARGIN x the FLOPs model's time at DEADLINE_MFU of an
# H100's dense bf16 peak (preemptions, restarts and slow data included) + DEADLINE_SETUP_S; the others
# (preprocessing, sweeps of short fine-tunes, few-shot) a day.
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


def cluster_entrypoint(entrypoint: str) -> str:
    """The spec's entrypoint as one `bash -c '...'` word list.

    In K8sJobMode the operator pastes spec.entrypoint unquoted into the submitter pod's
    `bash -ce "... ray job submit ... -- ENTRYPOINT ; ..."`. Unwrapped, $VITP_STORE etc. would
    expand there (where they are unset) and `&&` would run the later commands in that pod. Quoted,
    the submitter passes it literally; `ray job submit` re-joins it with shlex.join and the driver's
    shell runs it on the cluster, where runtimeEnvYAML sets the variables.
    """
    return "bash -c " + shlex.quote(entrypoint.strip())


def deadline_s(stage: str, cfg) -> int:
    """activeDeadlineSeconds for a stage whose first command resolves to `cfg` (see DEADLINE_*)."""
    if not stage.startswith("pretrain"):
        return OTHER_DEADLINE_S
    from vitp.model.flops import training_flops

    flops = training_flops(cfg.model.variant, cfg.data.image_size, cfg.model.num_classes,
                           cfg.model.representation_size) * cfg.train.steps * cfg.parallel.global_batch
    seconds = flops / (cfg.parallel.num_workers * H100_BF16_FLOPS * DEADLINE_MFU)
    return int(math.ceil((DEADLINE_MARGIN * seconds + DEADLINE_SETUP_S) / 3600)) * 3600


def rayjob(stage: str, name: str, cluster: dict) -> dict:
    sys.path.insert(0, str(ROOT))
    from vitp.cluster.jobspec import parse_entrypoint

    spec = yaml.safe_load((ROOT / "jobs" / f"{stage}.yaml").read_text())
    calls = [c for c in parse_entrypoint(spec["entrypoint"]) if c.recipe]
    cfg = calls[0].configs()[0]
    # GPUs only for commands that run Ray Train (few-shot features come from CPU actors)
    trains = any(c.subcommand in TRAINING_COMMANDS for c in calls)
    gpu_nodes = math.ceil(cfg.parallel.num_workers / GPUS_PER_NODE) if trains else 0
    cspec = copy.deepcopy(cluster["spec"])
    cspec["enableInTreeAutoscaling"] = False  # a RayJob's cluster is sized for its stage
    for group in cspec["workerGroupSpecs"]:
        if group["groupName"] == "gpu":
            group["replicas"] = group["minReplicas"] = group["maxReplicas"] = gpu_nodes
    for group in [cspec["headGroupSpec"], *cspec["workerGroupSpecs"]]:
        for c in group["template"]["spec"]["containers"]:
            have = {e["name"] for e in c.get("env", []) if "secretKeyRef" in e.get("valueFrom", {})}
            if not set(SECRET_ENV) <= have:
                raise SystemExit(f"raycluster.yaml: container {c['name']} of {group.get('groupName', 'head')} "
                                 f"lacks {sorted(set(SECRET_ENV) - have)} from Secret vit-secrets")
    env = {k: v for k, v in (spec.get("runtime_env") or {}).get("env_vars", {}).items()
           if "${" not in str(v)}
    env.update({"VITP_STORE": "s3://your-bucket/vit", "PRETRAINED": "s3://your-bucket/vit/h14_i21k/export",
                "MLFLOW_TRACKING_URI": "http://mlflow.mlflow.svc.cluster.local:5000"})
    if "PRETRAINED" not in spec["entrypoint"]:
        env.pop("PRETRAINED")
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
            "activeDeadlineSeconds": deadline_s(stage, cfg),
            "preRunningDeadlineSeconds": PRE_RUNNING_DEADLINE_S,
            "backoffLimit": 0,  # the pipeline resumes from checkpoints; resubmit rather than retry blindly
            "submissionMode": "K8sJobMode",
            "submitterConfig": {"backoffLimit": SUBMITTER_RETRIES},
            "rayClusterSpec": cspec,
        },
    }


def render() -> dict[str, str]:
    cluster = yaml.safe_load((HERE / "raycluster.yaml").read_text())
    out = {}
    for stage, name in STAGES.items():
        header = (f"# Generated by cluster/kuberay/generate.py from jobs/{stage}.yaml and raycluster.yaml: edit those.\n"
                  "#   kubectl apply -k cluster/overlays/gke/accounts   # or eks, gfd: ServiceAccount vit-ray with\n"
                  "#                                                    # your cloud's identity (and mlflow's)\n"
                  f"#   kubectl -n vit apply -f cluster/kuberay/rayjob-{name}.yaml   # KubeRay >= 1.7\n"
                  f"#   kubectl -n vit logs -f job/{name}     # the submitter's log = the driver's log\n"
                  "# The entrypoint is wrapped in `bash -c '...'` so $VARS and && reach the cluster's driver,\n"
                  "# not the submitter pod (see cluster_entrypoint in generate.py).\n"
                  "# Set VITP_STORE (and PRETRAINED) below to your bucket; put MLFLOW_TRACKING_USERNAME/PASSWORD\n"
                  "# in Secret vit-secrets (kubectl -n vit create secret generic vit-secrets --from-literal=...).\n")
        out[f"rayjob-{name}.yaml"] = header + yaml.safe_dump(rayjob(stage, name, cluster), sort_keys=False, width=100)
    return out


def main(argv: list[str]) -> int:
    stale = []
    for fname, text in render().items():
        path = HERE / fname
        if "--check" in argv:
            if not path.exists() or path.read_text() != text:
                stale.append(fname)
        else:
            path.write_text(text)
    if stale:
        print(f"stale: {', '.join(stale)}: run python cluster/kuberay/generate.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
