"""Ray job specs (jobs/*.yaml): load, validate, expand secrets, check the recipes, and insert `--set`
into the entrypoint's shell text (never re-quoting what the spec wrote). The upload size: upload.py.

A spec's keys are `JobSubmissionClient.submit_job`'s keyword arguments. Must not submit (jobs.py
talks to the cluster), print secret values, or import torch.
"""
from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

from vitp import recipes
from vitp.config.files import like_recipe
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
# vitp subcommands whose first positional argument is a recipe name.
RECIPE_COMMANDS = {"config", "synth", "preprocess", "pretrain", "finetune", "sweep", "fewshot"}
# Options of those subcommands that take a value (so the value is not mistaken for the recipe).
_VALUE_OPTIONS = {"--set", "--from", "--address", "--out", "--tracking-uri", "--name", "--datasets",
                  "--space", "--scheduler", "--experiment", "--sweep", "--tag", "--filter",
                  "--format", "--plot", "--recipe"}
_GLOBAL_FLAGS = {"--debug"}  # vitp's own options, given before the subcommand
_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


@dataclass
class VitpCall:
    """One `vitp SUBCOMMAND [RECIPE] ...` found in an entrypoint."""

    subcommand: str
    recipe: str | None
    overrides: list[str]
    end: int  # offset in the entrypoint where this command's words end (`--set` goes there)
    datasets: list[str] = field(default_factory=list)  # `vitp sweep --datasets A,B`

    @property
    def recipes(self) -> list[str]:
        """Every recipe this call runs: its RECIPE, and a sweep's --datasets."""
        return list(dict.fromkeys(([self.recipe] if self.recipe else []) + self.datasets))

    def configs(self, check_paths: bool = False) -> list:
        """Each recipe's resolved config, with the `--set` items that reach it (a sweep's
        `RECIPE:KEY=VALUE` to that recipe only)."""
        if self.subcommand != "sweep":
            return [recipes.resolve(self.recipe, self.overrides, check_paths=check_paths)]
        recipes.check_scoped(self.overrides, self.recipes)
        return [recipes.resolve(r, recipes.overrides_for(r, self.overrides), check_paths=check_paths)
                for r in self.recipes]


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


# ------------------------------------------------------------------------------- parsing
# The entrypoint is shell text run by the cluster's shell: it is scanned (never re-quoted), so
# $VARS expand there and operators and redirections stay as written. `--set` is inserted as text.


def _skip_quoted(text: str, i: int, close: str) -> int:
    """Index after the `close` that ends the quoted or nested part starting at text[i]."""
    opener, depth = {")": "(", "}": "{"}.get(close), 0
    while i < len(text):
        c = text[i]
        if close == "'":
            if c == "'":
                return i + 1
        elif c == "\\":
            i += 1
        elif c == close and depth == 0:
            return i + 1
        elif opener and c in (opener, close):
            depth += 1 if c == opener else -1
        elif c == "`" or (c in "'\"" and close != '"'):
            i = _skip_quoted(text, i + 1, c) - 1
        elif c == "$" and text[i + 1:i + 2] in ("(", "{"):
            i = _skip_quoted(text, i + 2, ")" if text[i + 1] == "(" else "}") - 1
        i += 1
    raise ConfigError(f"entrypoint {redact_text(text)!r}: unbalanced {close!r}: close the quote or bracket")


def command_spans(text: str) -> list[tuple[int, int]]:
    """(start, end) of each simple command of a shell command line, split at && || ; | & ( ) and
    newlines; quotes, escapes, $(...), ${...}, `...` and comments respected; trailing blanks cut."""
    spans, start, i, n = [], 0, 0, len(text)
    while i < n:
        c, nxt = text[i], text[i + 1:i + 2]
        if c == "\\":
            i += 2
        elif c in "'\"`":
            i = _skip_quoted(text, i + 1, c)
        elif c == "$" and nxt in ("(", "{"):
            i = _skip_quoted(text, i + 2, ")" if nxt == "(" else "}")
        elif c == "#" and (i == 0 or text[i - 1] in " \t\n;&|()"):
            spans.append((start, i))  # a comment runs to the end of the line
            start = i = n if text.find("\n", i) < 0 else text.find("\n", i)
        elif c in ";&|()\n" and not (c in "&|" and text[i - 1:i] in ("<", ">")) and not (c == "&" and nxt == ">"):
            spans.append((start, i))  # `>&`, `<&`, `>|` and `&>` are redirections, not operators
            i += 2 if text[i:i + 2] in ("&&", "||", ";;", "|&") else 1
            start = i
        else:
            i += 1
    spans.append((start, n))
    out = []
    for s, e in spans:
        while e > s and (text[e - 2:e] == "\\\n" or (text[e - 1].isspace() and text[e - 2:e - 1] != "\\")):
            e -= 2 if text[e - 2:e] == "\\\n" else 1  # blanks and line continuations
        if text[s:e].strip():
            out.append((s, e))
    return out


_REDIRECT = re.compile(r"^\d*(&>>?|>>?|<<?|>&|<&|>\|)(.*)$")
_PREFIX_WORDS = {"if", "then", "elif", "else", "do", "while", "until", "{", "!", "time", "exec", "command", "env"}


def _words(text: str) -> list[str]:
    """The words of one simple command, less redirections, leading keywords and VAR=value."""
    try:
        tokens = shlex.split(text)
    except ValueError as e:
        raise ConfigError(f"entrypoint {redact_text(text)!r}: {e}: fix the quoting") from None
    words, skip = [], False
    for tok in tokens:
        m = _REDIRECT.match(tok)
        if skip or m:
            skip = not skip and bool(m) and not m.group(2)  # `> file`: the next word is the target
            continue
        words.append(tok)
    while words and (words[0] in _PREFIX_WORDS or re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0])):
        words = words[1:]
    return words


def _vitp_args(words: list[str]) -> list[str] | None:
    """The arguments after `vitp` / `python -m vitp.cli`, or None for another command."""
    if words and os.path.basename(words[0]) == "vitp":
        return words[1:]
    if len(words) >= 3 and os.path.basename(words[0]).startswith("python") and words[1:3] == ["-m", "vitp.cli"]:
        return words[3:]
    return None


def parse_entrypoint(entrypoint: str) -> list[VitpCall]:
    """Every vitp call in the entrypoint, with its recipe, `--set` overrides and where it ends."""
    calls = []
    for start, end in command_spans(entrypoint):
        args = _vitp_args(_words(entrypoint[start:end]))
        while args and args[0] in _GLOBAL_FLAGS:  # `vitp --debug pretrain ...`
            args = args[1:]
        if not args:
            continue
        sub, recipe, overrides, datasets = args[0], None, [], []
        rest = iter(args[1:])
        for a in rest:
            if a == "--set" or a.startswith("--set="):
                overrides.extend([a[len("--set="):]] if a.startswith("--set=") else islice(rest, 1))
            elif (a == "--datasets" or a.startswith("--datasets=")) and sub == "sweep":
                value = a[len("--datasets="):] if a.startswith("--datasets=") else next(rest, "")
                datasets = [d.strip() for d in value.split(",") if d.strip()]
            elif a == "--recipe" and sub == "compare":
                recipe = next(rest, None)  # `vitp compare --recipe R` reads R's MLflow store
            elif a.split("=", 1)[0] in ("--config", "--like") and sub in RECIPE_COMMANDS:  # RECIPE's spellings
                value = a.split("=", 1)[1] if "=" in a else next(rest, "")
                recipe = value if a.startswith("--config") else like_recipe(value)
            elif a in _VALUE_OPTIONS:
                next(rest, None)
            elif not a.startswith("-") and recipe is None and sub in RECIPE_COMMANDS:
                recipe = a
        calls.append(VitpCall(sub, recipe, overrides, end, datasets))
    return calls


_SHELL_REF = re.compile(r"\$[A-Za-z_{(]")


def add_overrides(entrypoint: str, overrides: list[str]) -> str:
    """Append `--set k=v` to every `vitp <command> RECIPE` of the entrypoint (`RECIPE:k=v`: to the
    calls that run that recipe only; a sweep over several --datasets gets it as `RECIPE:k=v`, which
    it applies to that dataset's trials). The entrypoint's text is kept as written; only the values
    are quoted."""
    calls = [c for c in parse_entrypoint(entrypoint) if c.subcommand in RECIPE_COMMANDS and c.recipe]
    if overrides and not calls:
        raise ConfigError(f"--set needs a `vitp <command> RECIPE` in the entrypoint, found none in "
                          f"{redact_text(entrypoint)!r}: put the overrides into the spec's entrypoint instead")
    inserts: dict[int, list[str]] = {}
    for item in overrides:
        if _SHELL_REF.search(item):
            raise ConfigError(
                f"--set {redact_text(item)}: a $VARIABLE in a --set value reaches the job as literal text "
                "(values are quoted, not expanded on the cluster): let your shell expand it (double "
                "quotes, not single), or write the reference into the spec's entrypoint")
        recipe, kv = recipes.scoped(item)
        targets = [c for c in calls if recipe is None or recipe in c.recipes]
        if not targets:
            raise ConfigError(f"--set {redact_text(item)}: the entrypoint runs no recipe {recipe!r}; "
                              f"its recipes: {', '.join(sorted({r for c in calls for r in c.recipes}))}")
        for c in targets:
            inserts.setdefault(c.end, []).append(item if recipe and len(c.recipes) > 1 else kv)
    for end in sorted(inserts, reverse=True):
        entrypoint = entrypoint[:end] + "".join(f" --set {shlex.quote(kv)}" for kv in inserts[end]) + entrypoint[end:]
    return entrypoint


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
