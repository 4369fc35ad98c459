"""Ray job specs (jobs/*.yaml): load, validate, expand secrets, check the recipes, and insert `--set`
into the entrypoint (entrypoint.py reads its shell text; it is never re-quoted). The upload size: upload.py.

A spec's keys are `JobSubmissionClient.submit_job`'s keyword arguments. Must not submit (jobs.py
talks to the cluster), print secret values, or import torch.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any

from vitp.cluster.entrypoint import RECIPE_COMMANDS, VitpCall, add_overrides, parse_entrypoint
from vitp.errors import ConfigError, InputError
from vitp.tracking.redact import REDACTED, is_secret_key, redact_text, remember_secret

# Credentials a cloud hands out to a person, not to a machine: forwarded from a laptop they are
# stored with the job and go stale (JobSpec.warnings); the nodes' own identity is the better source.
STATIC_CLOUD_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
                     "GOOGLE_APPLICATION_CREDENTIALS", "AZURE_STORAGE_KEY", "AZURE_CLIENT_SECRET")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# submit_job's keyword arguments (Ray 2.52+); `job_id` is deprecated there, so not accepted here.
SPEC_KEYS = {"entrypoint": str, "submission_id": str, "runtime_env": dict, "metadata": dict,
             "entrypoint_num_cpus": (int, float), "entrypoint_num_gpus": (int, float),
             "entrypoint_memory": int, "entrypoint_resources": dict, "entrypoint_label_selector": dict}
# The custom resource only a cluster's head offers (cluster/*.yaml, cluster/kuberay/raycluster.yaml,
# cluster/local.sh): the shipped specs' drivers ask for one unit, so they run on the head, which
# outlives the workers and reaches the dashboard (docs/cluster.md, "Where drivers run").
DRIVER_RESOURCE = "vitp_driver"
_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


@dataclass
class JobSpec:
    """A validated spec: `kwargs` go to submit_job as they are; `secrets` must never be shown."""

    path: str
    kwargs: dict[str, Any]
    calls: list[VitpCall] = field(default_factory=list)
    secrets: list[str] = field(default_factory=list)

    @property
    def entrypoint(self) -> str:
        return self.kwargs["entrypoint"]

    def mask(self, text: str) -> str:
        """`text` with every secret value and credential-looking substring replaced by ***."""
        for value in sorted(self.secrets, key=len, reverse=True):
            if len(value) >= 4:
                text = text.replace(value, REDACTED)
        return redact_text(text)

    def warnings(self) -> list[str]:
        """One line per static cloud credential the job takes from this shell (STATIC_CLOUD_KEYS)."""
        env = (self.kwargs.get("runtime_env") or {}).get("env_vars") or {}
        names = [k for k in STATIC_CLOUD_KEYS if env.get(k)]
        return [f"this shell's {', '.join(names)} will be sent with the job: the Jobs API keeps the values with "
                "the job (anyone with the cluster's token reads them back) and they are fixed now (a session "
                "token expires within hours of a days-long run); give the nodes an identity instead "
                "(instance profile, Workload Identity, IRSA: docs/cluster.md)"] if names else []

    def describe(self) -> list[str]:
        """Lines safe to print: entrypoint, env var names (secret values masked), resources."""
        lines = [f"entrypoint: {self.mask(self.entrypoint)}"]
        env = (self.kwargs.get("runtime_env") or {}).get("env_vars") or {}
        if env:
            shown = [f"{k}={REDACTED if (v in self.secrets or is_secret_key(k)) else self.mask(v)}"
                     for k, v in sorted(env.items())]
            lines.append("env_vars: " + ", ".join(shown))
        for key in ("entrypoint_num_cpus", "entrypoint_num_gpus", "entrypoint_resources"):
            if key in self.kwargs:
                lines.append(f"{key}: {self.kwargs[key]}")
        return lines


# ----------------------------------------------------------------------------- loading


def _expand_env(spec_path: str, env: dict[str, Any], environ: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    """Resolve ${VAR} / ${VAR:-default} in env_vars from this shell.

    A value is secret (never printed, masked in logs) when its key or a variable it came from
    names a credential (AWS_SECRET_ACCESS_KEY, MLFLOW_TRACKING_PASSWORD, HF_TOKEN, ...).

    Variables that end up empty are dropped, so `${AWS_ACCESS_KEY_ID:-}` falls back to the
    cluster's own credentials (instance role, workload identity) instead of an empty key.
    """
    out: dict[str, str] = {}
    secrets: list[str] = []
    for key, value in env.items():
        if not isinstance(value, (str, int, float, bool)):
            raise ConfigError(f"{spec_path}: runtime_env.env_vars.{key} must be a string, got {type(value).__name__}")
        text = str(value)
        secret_source = False

        def sub(m: re.Match) -> str:
            nonlocal secret_source
            name, default = m.group(1), m.group(2)
            if name in environ:
                secret_source = secret_source or is_secret_key(name)
                return environ[name]
            if default is not None:
                return default
            raise ConfigError(
                f"{spec_path}: runtime_env.env_vars.{key} uses ${{{name}}}, which is not set in this "
                f"shell: export {name}=... before `vitp submit` (its value is sent to the cluster and "
                f"never printed), or write ${{{name}:-}} to make it optional"
            )

        text = _VAR.sub(sub, text)
        if text == "" and _VAR.search(str(value)):
            continue
        out[str(key)] = text
        if text and (secret_source or is_secret_key(str(key))):
            secrets.append(text)
    return out, secrets


def load_spec(path: str, overrides: list[str] | tuple[str, ...] = (),
              environ: dict[str, str] | None = None, check_recipe: bool = True,
              forward_env: list[str] | tuple[str, ...] = (), job_tracking_uri: str = "") -> JobSpec:
    """Read and validate a job spec; `overrides` are appended to its vitp command as `--set`, the
    variables named in `forward_env` are added to its env_vars from this shell, and a
    `job_tracking_uri` becomes the job's MLFLOW_TRACKING_URI (this shell's may be a port-forward)."""
    import yaml  # lazy: only loading a spec needs it

    environ = dict(os.environ if environ is None else environ)
    try:
        with open(path) as f:
            raw = yaml.safe_load(f)
    except FileNotFoundError:
        raise InputError(f"job spec {path} does not exist: see jobs/*.yaml for examples") from None
    except yaml.YAMLError as e:  # one line: what the parser found and where
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        what = " ".join(str(getattr(e, "problem", None) or e).split())
        raise ConfigError(f"{path}: not valid YAML: {what}{where}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping with at least `entrypoint:`")
    unknown = sorted(set(raw) - set(SPEC_KEYS))
    if unknown:
        raise ConfigError(
            f"{path}: unknown key(s) {', '.join(unknown)}; a job spec's keys are submit_job's "
            f"arguments: {', '.join(SPEC_KEYS)}"
        )
    if not raw.get("entrypoint"):
        raise ConfigError(f"{path}: `entrypoint:` is missing, e.g. entrypoint: vitp pretrain debug")
    for key, tp in SPEC_KEYS.items():
        if key in raw and raw[key] is not None and not isinstance(raw[key], tp):
            want = " or ".join(t.__name__ for t in (tp if isinstance(tp, tuple) else (tp,)))
            raise ConfigError(f"{path}: {key} must be {want}, got {type(raw[key]).__name__}")
    for name, amount in (raw.get("entrypoint_resources") or {}).items():
        if not isinstance(name, str) or isinstance(amount, bool) or not isinstance(amount, (int, float)) \
                or not 0 < amount < float("inf"):
            raise ConfigError(f"{path}: entrypoint_resources {redact_text(str(name))}: {redact_text(str(amount))} "
                              f"must be a resource name and a positive amount, e.g. {{{DRIVER_RESOURCE}: 1}}")
    kwargs = {k: v for k, v in raw.items() if v is not None}
    kwargs["entrypoint"] = add_overrides(str(raw["entrypoint"]).strip(), list(overrides))
    secrets: list[str] = []
    runtime_env = dict(kwargs.get("runtime_env") or {})
    if "env_vars" in runtime_env:
        if not isinstance(runtime_env["env_vars"], dict):
            raise ConfigError(f"{path}: runtime_env.env_vars must be a mapping NAME: value")
        runtime_env["env_vars"], secrets = _expand_env(path, runtime_env["env_vars"], environ)
    for name in forward_env:
        if not _ENV_NAME.fullmatch(name):
            raise ConfigError(f"--forward-env {name!r}: not an environment variable name (e.g. AWS_PROFILE)")
        if name not in environ:
            raise ConfigError(f"--forward-env {name}: {name} is not set in this shell: export it first")
        runtime_env.setdefault("env_vars", {})[name] = environ[name]
        if is_secret_key(name) or name in STATIC_CLOUD_KEYS:
            secrets.append(environ[name])
    if job_tracking_uri:
        runtime_env.setdefault("env_vars", {})["MLFLOW_TRACKING_URI"] = job_tracking_uri
    if runtime_env:
        kwargs["runtime_env"] = runtime_env
    meta = kwargs.get("metadata") or {}
    bad = [k for k, v in meta.items() if not isinstance(v, str)]
    if bad:
        raise ConfigError(f"{path}: metadata values must be strings (quote them): {', '.join(map(str, bad))}")
    for value in secrets:  # masked in everything this process prints or records from now on
        remember_secret(value)
    spec = JobSpec(path, kwargs, parse_entrypoint(kwargs["entrypoint"]), secrets)
    if check_recipe:
        resolve_recipes(spec)
    return spec


def resolve_recipes(spec: JobSpec) -> list:
    """Resolve every recipe the entrypoint names (data paths live on the cluster: not checked)."""
    if not spec.calls:
        raise ConfigError(
            f"{spec.path}: the entrypoint {spec.mask(spec.entrypoint)!r} runs no vitp command: "
            "use e.g. `vitp pretrain RECIPE --set k=v` (or `python -m vitp.cli ...`)"
        )
    out = []
    for call in spec.calls:
        if call.subcommand in RECIPE_COMMANDS and not call.recipe:
            raise ConfigError(f"{spec.path}: `vitp {call.subcommand}` in the entrypoint names no recipe")
        if call.recipe:
            try:
                out.extend(call.configs())
            except ConfigError as e:
                raise ConfigError(f"{spec.path}: `vitp {call.subcommand} {call.recipe}` does not resolve: "
                                  f"{e}") from None
    return out
