"""Every `vitp` subcommand once, as a user runs it: the installed console script in a subprocess,
on tiny inputs, checking what it printed or wrote (not only the exit code).

Fast part (`make test`, ~1 min): --help, config (+ --list, --keys), model, import (each
--format), and bad invocations (one line on stderr, the documented exit code). The e2e part
(`make test-e2e`): one chained scenario in a temporary work dir, synth -> preprocess -> pretrain
-> export -> import / attention / finetune / fewshot / sweep -> compare (and --stale-after) against a
basic-auth MLflow server (runs in PostgreSQL, artifacts on S3, its login cache); mlflow-server in its
exposed form (--auth --allowed-hosts, --auth-cache-s 0); submit + jobs against a local Ray
cluster (cluster/local.sh); then a search of everything the chain printed and wrote for the
secrets it ran with (test_no_secret_leaves_the_chain). The demo has its own file (test_demo_e2e.py).
"""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from httpcalls import request  # tests/httpcalls.py
from vitp.net import free_port

ROOT = Path(__file__).resolve().parents[2]
VITP = Path(sys.executable).parent / "vitp"  # the console script the venv installed
COMMANDS = ("config", "model", "plan", "synth", "preprocess", "pretrain", "finetune", "sweep", "export",
            "fewshot", "import", "attention", "analyze", "predict", "compare", "submit", "jobs", "mlflow-server", "doctor",
            "demo")


def vitp_env() -> dict[str, str]:
    """The user's environment without a Ray/MLflow address of some other run, venv first on PATH."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RAY_ADDRESS", "RAY_AUTH", "RAY_API_SERVER", "MLFLOW_TRACKING"))}
    env["PATH"] = f"{VITP.parent}{os.pathsep}{env.get('PATH', '')}"
    return env


@dataclass
class Run:
    args: tuple[str, ...]
    rc: int
    out: str
    err: str
    seconds: float

    def __str__(self) -> str:  # what a failed assertion shows
        return (f"$ vitp {' '.join(self.args)}  (exit {self.rc}, {self.seconds:.0f}s)\n"
                f"--- stdout (tail)\n{self.out[-3000:]}\n--- stderr (tail)\n{self.err[-3000:]}")


def vitp(*args: str, cwd: Path | None = None, timeout: float = 600, env: dict[str, str] | None = None) -> Run:
    t0 = time.monotonic()
    p = subprocess.run([str(VITP), *args], cwd=cwd or ROOT, env=env or vitp_env(), capture_output=True,
                       text=True, timeout=timeout)
    return Run(args, p.returncode, p.stdout, p.stderr, time.monotonic() - t0)


# A Ray worker process raises SystemExit from its SIGTERM handler (ray/_private/worker.py) when Ray
# ends it; landing inside a weakref callback at shutdown, that is printed as "Exception ignored in:"
# and a traceback ending in SystemExit. Ray's race at exit (seen once in CI after a demo whose every
# stage succeeded), not an error of ours.
IGNORED_EXIT = re.compile(r"^Exception ignored in: [^\n]*\nTraceback \(most recent call last\):\n"
                          r"(?:(?:  [^\n]*)?\n)*?SystemExit: \d+$", re.M)


def ok(r: Run) -> Run:
    """Exit 0 and no traceback of vitp's own (Ray forwards its actors' logs, tracebacks of its
    internal actors included, as lines prefixed with "(ActorName pid=...)": those are not ours;
    neither is IGNORED_EXIT's)."""
    assert r.rc == 0, str(r)
    err = IGNORED_EXIT.sub(lambda m: "" if "in sigterm_handler" in m.group(0) else m.group(0), r.err)
    assert not re.search(r"^Traceback", err, re.M), str(r)
    return r


def one_line_error(r: Run, command: str, code: int, mentions: str) -> None:
    """The documented failure shape: exit `code`, exactly one stderr line `vitp CMD: ...` naming
    the bad input, no traceback, nothing on stdout."""
    lines = r.err.strip().splitlines()
    assert r.rc == code, str(r)
    assert len(lines) == 1 and lines[0].startswith(f"vitp {command}: "), str(r)
    assert mentions in lines[0], str(r)
    assert r.out == "", str(r)


def load_tensors(path: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(path))


def is_png(path: Path) -> bool:
    return path.is_file() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# =============================================================================== fast part


def test_help_lists_every_command_and_the_exit_codes():
    t0 = time.monotonic()
    r = ok(vitp("--help"))
    print(f"vitp --help: {time.monotonic() - t0:.2f}s wall")
    listed = set(re.findall(r"^\s{4}(\S+)\s", r.out, re.M))
    assert set(COMMANDS) <= listed, f"not in --help: {set(COMMANDS) - listed}\n{r.out}"
    assert "--debug" in r.out
    epilog = r.out[r.out.lower().index("exit codes"):]
    codes = {int(c) for c in re.findall(r"^\s+(\d+)\s+\S", epilog, re.M)}
    assert {0, 1, 2, 3} <= codes, epilog


def test_config_list_keys_and_resolved_json(tmp_path):
    from vitp.recipes import RECIPES

    r = ok(vitp("config", "--list"))
    names = [line.split()[0] for line in r.out.splitlines() if line.strip()]
    assert names == list(RECIPES) and all(len(line.split()) > 1 for line in r.out.splitlines())

    r = ok(vitp("config", "--keys", "debug"))
    keys = r.out.split()
    assert {"optim.lr", "train.steps", "data.synth_images_per_class", "tracking.uri"} <= set(keys)

    r = ok(vitp("config", "debug", "--set", "train.steps=40", "--set", f"work_dir={tmp_path}",
                "--set", "optim.lr=0.005"))
    cfg = json.loads(r.out)
    assert cfg["recipe"] == "debug" and cfg["train"]["steps"] == 40 and cfg["optim"]["lr"] == 0.005
    assert cfg["work_dir"] == str(tmp_path) and cfg["model"]["variant"] == "pico/8"


def test_model_prints_the_paper_numbers():
    info = json.loads(ok(vitp("model", "Ti/16", "--json")).out)
    assert (info["depth"], info["width"], info["mlp_dim"], info["heads"], info["tokens"]) == (12, 192, 768, 3, 197)
    assert info["params_m"] == pytest.approx(5.717, abs=1e-3)  # docs/paper.md: 5.7M
    assert info["forward_gflops"] == pytest.approx(2.51, abs=0.01)
    assert info["train_gflops"] == pytest.approx(3 * 2.507, abs=0.01)  # training = 3 x forward


@pytest.mark.slow  # `vitp model` and `vitp plan` in subprocesses (~10 s): make test, not test-fast
def test_model_and_plan_print_the_memory_model():
    info = json.loads(ok(vitp("model", "H/14", "--zero", "2", "--workers", "8", "--json")).out)["memory"]
    assert info["paper_states_gb"] == pytest.approx(2.4, abs=0.05)  # ZeRO paper: 2P + 14P/N at N = 8
    settings = json.loads(ok(vitp("plan", "H/14", "--gpus", "1", "--gpu-mem", "16", "--json")).out)
    assert settings and all(s["device_gb"] <= 0.9 * 16 for s in settings)
    text = ok(vitp("plan", "H/14", "--gpus", "1", "--gpu-mem", "16")).out
    best = settings[0]
    assert f"--set parallel.micro_batch={best['micro_batch']}" in text  # (1 GPU: 4096 splits into it)
    assert f"--set parallel.zero_stage={best['zero_stage']}" in text
    one_line_error(vitp("plan", "H/14", "--gpus", "1", "--gpu-mem", "0.1"), "plan", 2, "does not fit")
    one_line_error(vitp("plan", "H/14", "--gpus", "3"), "plan", 2, "--global-batch 4096 does not split over --gpus 3")
    # the printed line pastes onto `vitp config h14_i21k` as it is: the batch triangle holds on the planned GPUs
    from vitp.config import ExperimentConfig

    for gpus, mem in ((1, "16"), (32, "80")):
        text = ok(vitp("plan", "H/14", "--gpus", str(gpus), "--gpu-mem", mem)).out
        line = next(line for line in text.splitlines() if line.strip().startswith("--set "))
        words = shlex.split(line)
        assert words[::2] == ["--set"] * (len(words) // 2)
        p = ExperimentConfig.from_dict(json.loads(ok(vitp("config", "h14_i21k", *words)).out)).parallel  # pasted
        assert p.num_workers == gpus and p.micro_batch * p.grad_accum * gpus == p.global_batch == 4096
        assert p.micro_batch <= json.loads(ok(vitp("plan", "H/14", "--gpus", str(gpus), "--gpu-mem", mem,
                                                   "--json")).out)[0]["micro_batch"]


# --- bad invocations: one line, the documented exit code (tests/cli/test_errors.py has more)


@pytest.mark.e2e  # a vitp process per case: minutes in all; tests/cli/test_errors.py keeps the fast checks
@pytest.mark.parametrize("args, mentions", [
    (("config", "no_such_recipe"), "no_such_recipe"),
    (("config", "debug", "--set", "optim.lrr=1"), "optim.lrr"),
    (("finetune", "debug_finetune", "--from", "/nonexistent/weights"), "/nonexistent/weights"),
    (("export", "/nonexistent"), "/nonexistent"),
    (("import", "/nonexistent/vit.npz", "--out", "/nonexistent/out"), "/nonexistent/vit.npz"),
], ids=["unknown-recipe", "bad-set-key", "missing-from", "export-missing", "import-missing"])
def test_bad_invocation_is_one_line_and_exit_2(args, mentions, tmp_path):
    one_line_error(vitp(*args, cwd=tmp_path), args[0], 2, mentions)


@pytest.mark.e2e
def test_unreachable_cluster_is_one_line_and_exit_3():
    address = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    one_line_error(vitp("jobs", "list", "--address", address), "jobs", 3, address)


def test_unknown_subcommand_is_an_argparse_error():
    r = vitp("frobnicate")
    assert r.rc == 2 and "invalid choice: 'frobnicate'" in r.err and "Traceback" not in r.err, str(r)


def test_output_piped_into_head_leaves_no_traceback():
    p = subprocess.run(f"'{VITP}' config debug | head -3", shell=True, cwd=ROOT, env=vitp_env(),
                       capture_output=True, text=True, timeout=120)
    assert len(p.stdout.splitlines()) == 3 and p.stdout.startswith("{"), p.stdout
    assert "Traceback" not in p.stderr and "BrokenPipe" not in p.stderr, p.stderr
    # (the reader gone before vitp writes a byte: tests/cli/test_errors.py, exit 141)


# --- import: every --format gives back the same weights


D, M, P, HEADS, DEPTH, GRID, CLASSES, REP = 64, 128, 8, 4, 2, 4, 7, 48  # pico/8 at 32 px


def ours_state_dict(seed: int = 0) -> dict[str, np.ndarray]:
    """Random pico/8 weights (32 px, pre-training head: pre-logits 48 wide, 7 classes) in our
    naming, made with numpy only."""
    rng = np.random.default_rng(seed)

    def r(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    sd = {"patch_embed.proj.weight": r(D, 3, P, P), "patch_embed.proj.bias": r(D),
          "cls_token": r(1, 1, D), "pos_embed": r(1, GRID * GRID + 1, D),
          "norm.weight": r(D), "norm.bias": r(D), "pre_logits.0.weight": r(REP, D),
          "pre_logits.0.bias": r(REP), "head.weight": r(CLASSES, REP), "head.bias": r(CLASSES)}
    for i in range(DEPTH):
        b = f"blocks.{i}."
        sd.update({b + "norm1.weight": r(D), b + "norm1.bias": r(D), b + "attn.qkv.weight": r(3 * D, D),
                   b + "attn.qkv.bias": r(3 * D), b + "attn.proj.weight": r(D, D), b + "attn.proj.bias": r(D),
                   b + "norm2.weight": r(D), b + "norm2.bias": r(D), b + "mlp.fc1.weight": r(M, D),
                   b + "mlp.fc1.bias": r(M), b + "mlp.fc2.weight": r(D, M), b + "mlp.fc2.bias": r(D)})
    return sd


def to_official_npz(sd: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Ours -> the google-research/vision_transformer .npz layout (docs/paper.md, section 10)."""
    d = D // HEADS
    w = {"embedding/kernel": sd["patch_embed.proj.weight"].transpose(2, 3, 1, 0),  # (P, P, C, D)
         "embedding/bias": sd["patch_embed.proj.bias"], "cls": sd["cls_token"],
         "Transformer/posembed_input/pos_embedding": sd["pos_embed"],
         "Transformer/encoder_norm/scale": sd["norm.weight"], "Transformer/encoder_norm/bias": sd["norm.bias"],
         "pre_logits/kernel": sd["pre_logits.0.weight"].T, "pre_logits/bias": sd["pre_logits.0.bias"],
         "head/kernel": sd["head.weight"].T, "head/bias": sd["head.bias"]}
    for i in range(DEPTH):
        o, b = f"blocks.{i}.", f"Transformer/encoderblock_{i}/"
        mha = b + "MultiHeadDotProductAttention_1/"
        qkv_w, qkv_b = np.split(sd[o + "attn.qkv.weight"], 3), np.split(sd[o + "attn.qkv.bias"], 3)
        for n, wt, bias in zip(("query", "key", "value"), qkv_w, qkv_b):
            w[f"{mha}{n}/kernel"] = wt.T.reshape(D, HEADS, d)  # (D, H, d)
            w[f"{mha}{n}/bias"] = bias.reshape(HEADS, d)
        w[mha + "out/kernel"] = sd[o + "attn.proj.weight"].T.reshape(HEADS, d, D)
        w[mha + "out/bias"] = sd[o + "attn.proj.bias"]
        for ours, theirs in (("norm1", "LayerNorm_0"), ("norm2", "LayerNorm_2")):
            w[f"{b}{theirs}/scale"], w[f"{b}{theirs}/bias"] = sd[o + ours + ".weight"], sd[o + ours + ".bias"]
        for j in (0, 1):
            w[f"{b}MlpBlock_3/Dense_{j}/kernel"] = sd[f"{o}mlp.fc{j + 1}.weight"].T
            w[f"{b}MlpBlock_3/Dense_{j}/bias"] = sd[f"{o}mlp.fc{j + 1}.bias"]
    return w


def to_hf(sd: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Ours -> Hugging Face hub naming (ViTModel pooler as pre-logits, `classifier` as head)."""
    top = {"patch_embed.proj": "vit.embeddings.patch_embeddings.projection", "norm": "vit.layernorm",
           "pre_logits.0": "vit.pooler.dense", "head": "classifier"}
    layer = {"norm1": "layernorm_before", "norm2": "layernorm_after", "attn.proj": "attention.output.dense",
             "mlp.fc1": "intermediate.dense", "mlp.fc2": "output.dense"}
    out = {"vit.embeddings.cls_token": sd["cls_token"], "vit.embeddings.position_embeddings": sd["pos_embed"]}
    for key, value in sd.items():
        name, _, kind = key.rpartition(".")
        if m := re.match(r"blocks\.(\d+)\.(.+)$", name):
            i, mod = m.groups()
            if mod == "attn.qkv":
                for n, part in zip(("query", "key", "value"), np.split(value, 3)):
                    out[f"vit.encoder.layer.{i}.attention.attention.{n}.{kind}"] = part
            else:
                out[f"vit.encoder.layer.{i}.{layer[mod]}.{kind}"] = value
        elif name in top:
            out[f"{top[name]}.{kind}"] = value
    return out


@pytest.fixture(scope="module")
def weight_files(tmp_path_factory):
    """The same weights in each foreign layout: {format: path}."""
    from safetensors.numpy import save_file

    d = tmp_path_factory.mktemp("weights")
    sd = ours_state_dict()
    np.savez(d / "ViT-pico_8.npz", **to_official_npz(sd))
    save_file({k.replace("pre_logits.0.", "pre_logits.fc."): v for k, v in sd.items()},
              str(d / "timm.safetensors"))
    save_file(to_hf(sd), str(d / "hf.safetensors"))
    return sd, {"npz": d / "ViT-pico_8.npz", "timm": d / "timm.safetensors", "hf": d / "hf.safetensors"}


def assert_same_weights(export_dir: Path, sd: dict[str, np.ndarray]) -> dict:
    got = load_tensors(export_dir / "model.safetensors")
    assert got.keys() == sd.keys(), sorted(set(got) ^ set(sd))
    for k, v in sd.items():
        np.testing.assert_allclose(got[k], v, rtol=0, atol=1e-6, err_msg=k)
    cfg = json.loads((export_dir / "config.json").read_text())
    assert (cfg["model"]["variant"], cfg["model"]["num_classes"], cfg["model"]["head"],
            cfg["model"]["representation_size"], cfg["data"]["image_size"]) == ("pico/8", CLASSES, "pretrain", REP, 32)
    return cfg


@pytest.mark.e2e  # a vitp process per case: minutes in all; tests/cli/test_errors.py keeps the fast checks
@pytest.mark.parametrize("fmt, source, recorded", [
    ("npz", "npz", "npz"), ("timm", "timm", "timm"), ("hf", "hf", "hf"),
    ("auto", "npz", "npz"), ("auto", "hf", "hf"), ("ours", "export", "ours"),
])
def test_import_each_format_gives_the_same_weights(fmt, source, recorded, weight_files, tmp_path):
    sd, files = weight_files
    if source == "export":  # our own export dir, as `vitp import` / `vitp export` write it
        src = tmp_path / "first"
        ok(vitp("import", str(files["npz"]), "--out", str(src), "--format", "npz"))
    else:
        src = files[source]
    out = tmp_path / "imported"
    r = ok(vitp("import", str(src), "--out", str(out), "--format", fmt))
    assert f"wrote {out}" in r.out and "vitp finetune" in r.out, str(r)
    cfg = assert_same_weights(out, sd)
    assert cfg["_export"]["format"].startswith(recorded), cfg["_export"]


@pytest.mark.e2e
def test_import_with_the_wrong_format_is_one_line(weight_files, tmp_path):
    """timm weights given as --format npz: bad input (exit 2) naming the file, nothing written.
    (--format choices = the importer's: tests/cli/test_errors.py.)"""
    _, files = weight_files
    r = vitp("import", str(files["timm"]), "--out", str(tmp_path / "x"), "--format", "npz")
    one_line_error(r, "import", 2, files["timm"].name)
    assert not (tmp_path / "x" / "model.safetensors").exists()


# --- mlflow-server: the exposed form docs/cluster.md gives, served and refused by Host header, the
# login cache docs/security.md describes, and Ctrl-C stops it cleanly (e2e: a real server takes
# 10-80 s to start on 2 shared cores)


@pytest.mark.e2e
@pytest.mark.slow
def test_mlflow_server_serves_and_stops_on_ctrl_c(tmp_path):
    """`vitp mlflow-server --auth --allowed-hosts mlflow.example.com` (docs/cluster.md) with
    `--auth-cache-s 0` (docs/security.md: the password checked on every request): the listed Host
    is served, another refused with 403 (MLflow's DNS-rebinding guard); a password changed
    directly in the user database is refused at the next request (the default cache would still
    let it in: test_a_verified_login_outlives_a_change_in_the_user_database); Ctrl-C stops it."""
    import sqlite3
    from contextlib import closing

    from werkzeug.security import generate_password_hash  # how MLflow's user store hashes

    port, password, listed = free_port(), "ctrl-c-admin-password-5v9q", "mlflow.example.com"
    env = {k: v for k, v in vitp_env().items() if not k.startswith("MLFLOW_AUTH")}
    env["MLFLOW_AUTH_ADMIN_PASSWORD"] = password  # its users: auth.db beside the SQLite store
    proc = subprocess.Popen(
        [str(VITP), "mlflow-server", "--auth", "--allowed-hosts", listed, "--auth-cache-s", "0",
         "--port", str(port), "--workers", "1", "--backend-store-uri", f"sqlite:///{tmp_path}/mlflow.db",
         "--artifacts-destination", str(tmp_path / "artifacts"), "--log", str(tmp_path / "server.log")],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        # Ctrl-C reaches a foreground process with SIGINT at its default; a test run started in
        # the background (`make test-e2e &`) would pass SIGINT down ignored
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    lines = []
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if "Ctrl-C stops it" in line:
                break
        banner = "".join(lines)
        uri = f"http://127.0.0.1:{port}"
        assert (f"mlflow server at {uri}" in banner and f"MLFLOW_TRACKING_URI={uri}" in banner
                and "auth basic" in banner), banner + proc.stderr.read() if proc.poll() is not None else banner
        api = f"{uri}/api/2.0/mlflow/experiments/search?max_results=5"
        assert request(api, listed)[0] == 401  # past the Host guard, at the login
        status, body = request(api, listed, "admin", password)
        assert status == 200 and [e["name"] for e in json.loads(body)["experiments"]] == ["Default"], body
        assert request(api, "evil.example.com", "admin", password)[0] == 403  # a login does not get past it
        # the admin's password changed in the user database itself, not through the server's API
        changed = "ctrl-c-changed-password-2m7x"
        with closing(sqlite3.connect(tmp_path / "auth.db")) as db, db:
            assert db.execute("UPDATE users SET password_hash = ? WHERE username = 'admin'",
                              (generate_password_hash(changed),)).rowcount == 1
        assert request(api, listed, "admin", password)[0] == 401  # verified a moment ago: not cached
        assert request(api, listed, "admin", changed)[0] == 200
    finally:
        proc.send_signal(signal.SIGINT)
        try:  # communicate drains both pipes: a full pipe must not hold the server's exit
            _, err = proc.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    rc = proc.returncode
    assert rc == 0 and "Traceback" not in err, (rc, err)
    with socket.socket() as s:  # the server went with it
        assert s.connect_ex(("127.0.0.1", port)) != 0


# ================================================================================ e2e part


# Fake secrets where a user keeps them, with the '/', '+' and '%' that cloud keys and generated
# passwords hold: the chain runs with them and none may appear in anything it prints or writes
# (test_no_secret_leaves_the_chain). The S3 server (moto) and the MLflow server accept them. PGPASSWORD
# is a name outside the patterns vitp first knew (*_PASSWORD, *_KEY, ...): PostgreSQL's own variable,
# which the MLflow server's user database really logs in with (libpq reads it).
SECRETS = {"S3 secret key": "fake/S3+secret%2Fkey9z", "MLflow password": "ml/Pass%41+w0rd",
           "database password": "db/pw%2Fq+y", "PGPASSWORD": "pg/Auth+pw%3Dz7"}


@pytest.fixture(scope="module")
def scenario(tmp_path_factory, s3):
    """The chain's work dir, and what a user on a shared tracking server has: an MLflow server with
    basic auth (its password in MLFLOW_TRACKING_PASSWORD, its users in PostgreSQL logged in to with
    PGPASSWORD, in the whole chain's environment), its runs in PostgreSQL (the database password
    inside MLFLOW_BACKEND_STORE_URI) and its artifacts on S3 (the secret key in AWS_SECRET_ACCESS_KEY)."""
    import tempfile
    from urllib.parse import quote

    sys.path.insert(0, str(ROOT / "tests"))
    from postgres import PostgresServer

    base = tmp_path_factory.mktemp("every-command")
    # the chain's TMPDIR (Ray's session logs, checkpoint staging, spools): searched for the
    # secrets too; short, for Ray's socket paths
    tmp = Path(tempfile.mkdtemp(prefix="vitp-e", dir="/tmp"))
    db = PostgresServer(Path(tempfile.mkdtemp(prefix="vitp-pg", dir="/tmp")))  # pytest's tmp is root-only
    db.create("vitp", SECRETS["database password"], "mlflow")
    db.create("vitpauth", SECRETS["PGPASSWORD"], "mlflowauth")
    env = {**vitp_env(), "TMPDIR": str(tmp), "AWS_SECRET_ACCESS_KEY": SECRETS["S3 secret key"],
           "MLFLOW_TRACKING_USERNAME": "admin", "MLFLOW_TRACKING_PASSWORD": SECRETS["MLflow password"],
           "PGPASSWORD": SECRETS["PGPASSWORD"]}
    server_env = {**env, "MLFLOW_AUTH_ADMIN_PASSWORD": SECRETS["MLflow password"],
                  "MLFLOW_BACKEND_STORE_URI": f"postgresql://vitp:{quote(SECRETS['database password'], safe='')}"
                                              f"@127.0.0.1:{db.port}/mlflow",
                  # no password in this URI: the users' database is logged in to with $PGPASSWORD
                  "MLFLOW_AUTH_DATABASE_URI": f"postgresql://vitpauth@127.0.0.1:{db.port}/mlflowauth"}
    port, bucket = free_port(), s3.bucket("mlflow")
    server = subprocess.Popen([str(VITP), "mlflow-server", "--auth", "--port", str(port), "--workers", "1",
                               "--artifacts-destination", f"{bucket}/artifacts",
                               "--log", str(base / "mlflow-server.log")],
                              cwd=base, env=server_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    banner = []
    while not banner or "Ctrl-C stops it" not in banner[-1]:
        line = server.stdout.readline()
        assert line, "".join(banner) + server.stderr.read()
        banner.append(line)
    try:
        with pytest.MonkeyPatch.context() as mp:  # this test's own MLflow client logs in too
            for key in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
                mp.setenv(key, env[key])
            yield Scenario(base, tmp, env, f"http://127.0.0.1:{port}", printed=["".join(banner)], db_dir=db.root,
                           artifacts_bucket=bucket.removeprefix("s3://"))
    finally:
        # a process manager's stop: the command stops its server's process group and exits 0
        # (Ctrl-C is test_mlflow_server_serves_and_stops_on_ctrl_c's)
        server.send_signal(signal.SIGTERM)
        try:
            stopped = server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            stopped = "still running after 60 s"
        server.stdout.close()
        server.stderr.close()
        db.stop()
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(db.root, ignore_errors=True)
        assert stopped == 0, f"vitp mlflow-server on SIGTERM: {stopped} (0: stopped with its server)"


class Scenario:
    """One work dir; each step runs once, on demand, after the steps it consumes."""

    SWEEP = "cli-sweep"

    def __init__(self, base: Path, tmp: Path, env: dict[str, str], uri: str, printed: list[str], db_dir: Path,
                 artifacts_bucket: str):
        self.base, self.tmp, self.env, self.uri, self.db_dir = base, tmp, env, uri, db_dir
        self.artifacts_bucket = artifacts_bucket  # where the MLflow server stores artifacts
        self.work = base / "work"
        self.synth = self.work / "synth"
        self.shards = self.work / "shards" / "synth"  # beside shards/digits, as `vitp preprocess` lays them out
        self.export = self.work / "export"
        self.runs: dict[str, Run] = {}
        self.facts: dict[str, str] = {}
        self.printed = printed  # everything the chain's commands printed

    def vitp(self, *args: str, timeout: float = 600) -> Run:
        r = vitp(*args, timeout=timeout, env=self.env)
        self.printed.append(r.out + r.err)
        return r

    # What every pre-training command of the chain shares: the tiny debug recipe on the corpus
    # `vitp synth` rendered, sharded by `vitp preprocess`.
    def pretrain_sets(self) -> list[str]:
        return [f"work_dir={self.work}", f"tracking.uri={self.uri}", "data.synth_images_per_class=16",
                "data.source=imagefolder", f"data.path={self.synth}", f"data.shards={self.shards}"]

    def finetune_sets(self) -> list[str]:
        return [f"work_dir={self.work}", f"tracking.uri={self.uri}", "train.steps=4", "train.log_every=2",
                "train.eval_every=4", "optim.warmup_steps=1"]

    def need(self, step: str) -> Run:
        if step not in self.runs:
            self.runs[step] = getattr(self, "_" + step)()
        r = self.runs[step]
        if r.rc != 0:
            pytest.fail(f"step {step!r} failed, so this test cannot run:\n{r}", pytrace=False)
        return r

    @staticmethod
    def sets(items: list[str]) -> list[str]:
        return [a for item in items for a in ("--set", item)]

    def experiment_file(self, name: str, recipe: str, items: list[str]) -> Path:
        """The user's own experiment file: `recipe:` and KEY=VALUE items as YAML sections (values
        typed as YAML reads them), the way a user writes one."""
        import yaml

        data: dict = {"recipe": recipe}
        for item in items:
            key, _, value = item.partition("=")
            section, _, field = key.rpartition(".")
            (data.setdefault(section, {}) if section else data)[field] = yaml.safe_load(value)
        path = self.base / name
        path.write_text(yaml.safe_dump(data))
        return path

    def _synth(self) -> Run:
        return self.vitp("synth", "debug", *self.sets([f"work_dir={self.work}", "data.synth_images_per_class=16"]))

    def _preprocess(self) -> Run:
        self.need("synth")
        return self.vitp("preprocess", "debug", *self.sets(self.pretrain_sets()))

    def _digits(self) -> Run:
        return self.vitp("preprocess", "debug_finetune", "--set", f"work_dir={self.work}")

    def _pretrain(self) -> Run:
        self.need("preprocess")
        self.need("digits")  # the few-shot probes' dataset, by name: work_dir/shards/digits
        # the experiment in the user's file, one more change on the command line (--set wins)
        exp = self.experiment_file("pretrain.yaml", "debug", self.pretrain_sets() + [
            "train.steps=400", "train.log_every=2", "train.eval_every=4", "train.checkpoint_every=4",
            "optim.warmup_steps=1", "train.fewshot_every=2", "train.fewshot_datasets=digits"])
        r = self.vitp("pretrain", str(exp), "--set", "train.steps=4")
        if r.rc == 0:
            self.facts["checkpoint"] = re.search(r"^\s*checkpoint:\s+(\S+)", r.out, re.M).group(1)
            self.facts["pretrain_run"] = re.search(r"^\s*MLflow run:\s+(\S+)", r.out, re.M).group(1)
        return r

    def _export(self) -> Run:
        self.need("pretrain")
        return self.vitp("export", self.facts["checkpoint"], "--out", str(self.export), "--register", "vit-e2e")

    def _finetune(self) -> Run:
        self.need("export")
        exp = self.experiment_file("finetune.yaml", "debug_finetune", self.finetune_sets())
        r = self.vitp("finetune", str(exp), "--from", str(self.export), "--log-format", "json")
        if r.rc == 0:
            self.facts["finetune_run"] = re.search(r"^\s*MLflow run:\s+(\S+)", r.out, re.M).group(1)
        return r

    def _fewshot(self) -> Run:
        self.need("export")
        return self.vitp("fewshot", "debug_finetune", "--from", str(self.export), *self.sets(self.finetune_sets()[:2]))

    def _sweep(self) -> Run:
        self.need("finetune")  # its experiment file
        return self.vitp("sweep", str(self.base / "finetune.yaml"), "--name", self.SWEEP, "--from", str(self.export),
                         "--from", "scratch", "--space", "optim.lr=0.1", "--set", 'tune.space={"optim.lr": [0.1]}')

    def tracking_client(self):
        from mlflow.tracking import MlflowClient

        return MlflowClient(self.uri)


@pytest.mark.e2e
@pytest.mark.ray
@pytest.mark.slow
class TestChain:
    """synth -> preprocess -> pretrain -> export -> import / attention / finetune / fewshot /
    sweep -> compare, each through the console script, each fed by the one before."""

    def test_synth_renders_the_corpus(self, scenario):
        r = scenario.need("synth")
        assert "rendered 160 fractal images (10 classes" in r.out, str(r)
        classes = sorted(p for p in scenario.synth.iterdir() if p.is_dir())
        assert len(classes) == 10 and all(len(list(c.iterdir())) == 16 for c in classes)

    def test_preprocess_shards_the_synth_corpus(self, scenario):
        r = scenario.need("preprocess")
        manifest = json.loads((scenario.shards / "manifest.json").read_text())
        assert manifest["counts"]["written"] == 160 and manifest["counts"]["quarantined"] == 0, manifest["counts"]
        assert manifest["num_classes"] == 10 and manifest["storage"]["size"] == 40
        assert "160 inputs, 10 classes" in r.out, str(r)

    def test_pretrain_trains_checkpoints_and_logs(self, scenario):
        r = scenario.need("pretrain")
        assert re.search(r"done in \d+s: step 4, train/loss \d+\.\d{4}", r.out), str(r)
        assert Path(scenario.facts["checkpoint"]).is_dir()
        assert f"vitp export {scenario.facts['checkpoint']}" in r.out
        client = scenario.tracking_client()
        run = client.get_run(scenario.facts["pretrain_run"])
        assert run.info.status == "FINISHED"
        assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == [2, 4]
        # system metrics (tracking.system_metrics, on by default) at each log step
        assert [m.step for m in client.get_metric_history(run.info.run_id, "system/cpu_utilization_percentage")] == [2, 4]
        # few-shot probes on digits during pre-training, at every multiple of train.fewshot_every
        for k in (1, 5, 10, 25):
            history = client.get_metric_history(run.info.run_id, f"fewshot/digits_{k}shot_top1")
            assert [m.step for m in history] == [2, 4] and all(0 <= m.value <= 1 for m in history), (k, history)
        (dataset,) = run.inputs.dataset_inputs  # the shards, as MLflow's Dataset column shows them
        assert dataset.dataset.name == "imagefolder" and str(scenario.shards) in dataset.dataset.source
        assert run.data.tags["mlflow.source.name"] == "vitp pretrain debug"

    def test_a_logged_run_is_the_recipe_of_a_run_like_it(self, scenario):
        """`vitp config runs:/RUN_ID`: the pre-training's logged config, the same as the user's
        experiment file resolves to (plus --set train.steps=4), under a run name of its own."""
        scenario.need("pretrain")
        run_id = scenario.facts["pretrain_run"]
        mine = json.loads(ok(scenario.vitp("config", str(scenario.base / "pretrain.yaml"), "--set",
                                           "train.steps=4")).out)
        r = vitp("config", f"runs:/{run_id}", env={**scenario.env, "MLFLOW_TRACKING_URI": scenario.uri})
        scenario.printed.append(r.out + r.err)
        like = json.loads(ok(r).out)
        logged_name = scenario.tracking_client().get_run(run_id).info.run_name
        assert like["tracking"]["run_name"] == f"{logged_name}-like-{run_id[:8]}"
        like["tracking"]["run_name"] = mine["tracking"]["run_name"]
        assert like == mine

    def test_pretrain_console_says_each_thing_once(self, scenario):
        """What the user reads: every progress line once (Train's print patch logged each twice),
        no warning twice, none of Ray's or DeepSpeed's chatter."""
        r = scenario.need("pretrain")
        lines = (r.out + r.err).splitlines()
        progress = [line for line in lines if re.search(r"\] step \d+/4 ", line)]
        assert [re.search(r"step (\d+)/4", line).group(1) for line in progress] == ["2", "4"], str(r)
        # each a log line: time, level and the rank that wrote it; the driver's lines say so
        assert all(re.search(r"\d\d:\d\d:\d\dZ INFO \[rank 0\] \[[^]]+\] step", line) for line in progress), progress
        assert re.search(r"Z INFO \[driver\] \[[^]]+\] MLflow run \w+ \(new\)", r.out), str(r)
        warnings = [line for line in lines if re.search(r"\w+Warning: ", line)]
        assert len(warnings) == len(set(warnings)), "\n".join(warnings)
        for chatter in ("Reporting training result", "built successfully", "Token authentication",
                        "Creating initial MLflow database tables", "Failed to query Ray Train Controller"):
            assert chatter not in r.out + r.err, chatter

    def test_a_rerun_with_other_settings_is_a_run_of_its_own(self, scenario):
        """`vitp pretrain` of the same experiment again: the same settings report the finished run;
        under the name the user set, other settings are refused in one line; with the derived name
        they train a run named with their settings hash, the finished one left as it was."""
        scenario.need("pretrain")
        exp, client = str(scenario.base / "pretrain.yaml"), scenario.tracking_client()
        first = client.get_run(scenario.facts["pretrain_run"])
        name, lr = first.info.run_name, first.data.params["optim.lr"]
        runs = sorted(p.name for p in (scenario.work / "runs").iterdir())
        assert name == "pretrain-pico8-imagefolder" and name in runs  # the file's name, not its recipe's

        same = ok(scenario.vitp("pretrain", exp, "--set", "train.steps=4"))
        assert f"[{name}] already finished" in same.out and "change nothing" not in same.out + same.err
        assert f"[{name}] nothing trained, already step 4" in same.out, str(same)
        assert f"MLflow run: {first.info.run_id}" in same.out, str(same)

        named = scenario.vitp("pretrain", exp, "--set", "train.steps=4", "--set", "optim.lr=0.05",
                              "--set", f"tracking.run_name={name}")
        assert named.rc == 2 and "Traceback" not in named.err, str(named)
        refusal = [line for line in named.err.splitlines() if line.startswith("vitp pretrain: ")]
        assert len(refusal) == 1 and f"tracking.run_name='{name}' already holds a run with other settings" in \
            refusal[0] and f"optim.lr=0.05 (was {lr})" in refusal[0], str(named)

        other = ok(scenario.vitp("pretrain", exp, "--set", "train.steps=2", "--set", "optim.lr=0.05"))
        renamed = re.search(rf"this one is ({re.escape(name)}-[0-9a-f]{{8}}) \(new\)", other.err)
        assert renamed and f"optim.lr=0.05 (was {lr})" in other.err, str(other)
        run_id = re.search(r"^\s*MLflow run:\s+(\S+)", other.out, re.M).group(1)
        run = client.get_run(run_id)
        assert run_id != first.info.run_id and run.info.run_name == renamed.group(1)
        assert run.info.status == "FINISHED" and run.data.params["optim.lr"] == "0.05"
        assert sorted(p.name for p in (scenario.work / "runs").iterdir()) == sorted(runs + [renamed.group(1)])
        after = client.get_run(first.info.run_id)
        assert (after.info.end_time, after.data.params) == (first.info.end_time, first.data.params)

    def test_export_writes_weights_and_config(self, scenario):
        r = scenario.need("export")
        assert f"wrote {scenario.export}/model.safetensors and {scenario.export}/config.json" in r.out, str(r)
        cfg = json.loads((scenario.export / "config.json").read_text())
        assert cfg["recipe"] == "debug" and cfg["model"]["variant"] == "pico/8" and cfg["train"]["steps"] == 4
        weights = load_tensors(scenario.export / "model.safetensors")
        assert weights["pos_embed"].shape == (1, 17, 64) and weights["pos_embed"].dtype == np.float32
        assert weights["head.weight"].shape[0] == 10 and np.isfinite(weights["head.weight"]).all()
        # --register: an MLflow model of the pre-training run, with its config and metrics
        assert "registered models:/vit-e2e/1" in r.out, str(r)
        client = scenario.tracking_client()
        registered = cfg["_export"]["registered"]
        assert (registered["name"], registered["version"]) == ("vit-e2e", "1")
        assert client.get_model_version("vit-e2e", "1").source == f"models:/{registered['model_id']}"
        model = client.get_logged_model(registered["model_id"])
        assert model.source_run_id == scenario.facts["pretrain_run"]
        assert model.params["train.steps"] == "4" and {m.key for m in model.metrics} >= {"train/loss", "val/top1"}

    def test_import_of_the_export_keeps_the_weights(self, scenario):
        scenario.need("export")
        sd = load_tensors(scenario.export / "model.safetensors")
        for fmt, src in (("ours", scenario.export), ("auto", scenario.export / "model.safetensors")):
            out = scenario.work / f"reimported-{fmt}"
            r = ok(scenario.vitp("import", str(src), "--out", str(out), "--format", fmt))
            assert f"wrote {out}" in r.out
            got = load_tensors(out / "model.safetensors")
            assert got.keys() == sd.keys() and all(np.array_equal(got[k], sd[k]) for k in sd), fmt

    def test_attention_draws_both_plots(self, scenario):
        scenario.need("export")
        image = sorted(sorted(scenario.synth.iterdir())[0].iterdir())[0]  # one of the corpus images
        out = scenario.work / "attention"
        r = ok(scenario.vitp("attention", str(scenario.export), str(image), "--out", str(out)))
        assert f"wrote {out}/rollout.png and {out}/attention_distance.png" in r.out, str(r)
        assert is_png(out / "rollout.png") and is_png(out / "attention_distance.png")

    def test_finetune_from_the_export_records_its_lineage(self, scenario):
        r = scenario.need("finetune")  # with --log-format json
        logged = [json.loads(line[line.index("{"):]) for line in r.out.splitlines()  # less Ray's "(pid=..) "
                  if line.rstrip().endswith("}") and '"level": ' in line]
        assert {e["rank"] for e in logged} == {None, 0}, r.out  # the driver's lines and rank 0's
        assert all(set(e) == {"time", "level", "rank", "logger", "message"} and e["time"].endswith("Z")
                   for e in logged), logged
        assert any(e["rank"] == 0 and re.search(r"\] step \d+/\d+ ", e["message"]) for e in logged), logged
        assert any(e["rank"] is None and " MLflow run " in e["message"] for e in logged), logged
        top1 = float(re.search(r"val/top1 (\d+\.\d+)", r.out).group(1))
        assert 0.0 <= top1 <= 1.0, str(r)
        ckpt = re.search(r"^\s*checkpoint:\s+(\S+)", r.out, re.M).group(1)
        assert Path(ckpt).is_dir()
        run = scenario.tracking_client().get_run(scenario.facts["finetune_run"])
        assert run.info.status == "FINISHED"
        assert run.data.tags["source"] == str(scenario.export)
        assert run.data.tags["source_run_id"] == scenario.facts["pretrain_run"]  # one click to the pre-training
        assert run.data.tags["source_model"] == "models:/vit-e2e/1"  # the registered version it started from
        assert [m.model_id for m in run.inputs.model_inputs] == [run.data.tags["source_model_id"]]

    def test_export_leaves_for_timm_and_hugging_face(self, scenario):
        """--format timm --headless on the pre-training checkpoint, --format hf on the fine-tuned one:
        the files timm and transformers read, holding our weights (renamed only) and computing our
        logits; a pre-training head for timm or HF without --headless is refused with that fix."""
        import torch
        import transformers
        from safetensors.numpy import load_file

        from vitp.train.export import load_model

        scenario.need("export")
        ckpt = re.search(r"^\s*checkpoint:\s+(\S+)", scenario.need("finetune").out, re.M).group(1)
        timm_file = scenario.work / "timm" / "vit.safetensors"
        r = ok(scenario.vitp("export", scenario.facts["checkpoint"], "--format", "timm", "--headless",
                             "--out", str(timm_file)))
        assert f"wrote {timm_file}" in r.out, str(r)
        ours, timm = load_file(str(scenario.export / "model.safetensors")), load_file(str(timm_file))
        body = {k: v for k, v in ours.items() if not k.startswith(("head.", "pre_logits."))}
        assert len(body) < len(ours) and timm.keys() == body.keys()
        assert all(np.array_equal(timm[k], body[k]) for k in timm)
        one_line_error(scenario.vitp("export", str(scenario.export), "--format", "timm", "--out",
                                     str(scenario.work / "refused.safetensors")), "export", 2, "add --headless")

        hf_dir = scenario.work / "hf"
        ok(scenario.vitp("export", ckpt, "--format", "hf", "--out", str(hf_dir)))
        hf = transformers.ViTForImageClassification.from_pretrained(str(hf_dir)).eval()
        mine = load_model(ckpt)
        x = torch.randn(2, 3, mine.image_size, mine.image_size, generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            torch.testing.assert_close(hf(pixel_values=x).logits, mine(x), atol=1e-5, rtol=0)  # depth 2: see test_convert
        one_line_error(scenario.vitp("export", scenario.facts["checkpoint"], "--format", "hf", "--out",
                                     str(scenario.work / "hf-refused")), "export", 2,
                       "no counterpart for the pre-training head (tanh pre-logits): add --headless")
        one_line_error(scenario.vitp("export", ckpt, "--format", "hf", "--register", "x"), "export", 2,
                       "--register logs our export format")

    def test_fewshot_reports_every_shot_count(self, scenario):
        r = scenario.need("fewshot")
        got = {int(k): float(v) for k, v in re.findall(r"^fewshot/(\d+)shot_top1: (\d\.\d{4})$", r.out, re.M)}
        assert sorted(got) == [1, 5, 10, 25] and all(0.0 <= v <= 1.0 for v in got.values()), str(r)
        run_id = re.search(r"^MLflow run: (\S+)", r.out, re.M).group(1)
        metrics = scenario.tracking_client().get_run(run_id).data.metrics
        assert metrics["fewshot/25shot_top1"] == pytest.approx(got[25], abs=1e-4)
        # the pre-training's last probe scored the same weights (its final checkpoint, exported) on
        # the same digits: the same accuracies, but for a test prediction a float32 feature's last
        # bits may flip between batchings
        import pyarrow.parquet as pq

        val = sum(pq.ParquetFile(f).metadata.num_rows for f in (scenario.work / "shards" / "digits" / "val").glob("*.parquet"))
        probes = scenario.tracking_client().get_run(scenario.facts["pretrain_run"]).data.metrics
        for k, v in got.items():
            assert probes[f"fewshot/digits_{k}shot_top1"] == pytest.approx(v, abs=1.01 / val + 1e-4), (k, probes, got)

    def test_sweep_runs_both_sources_and_names_the_best(self, scenario):
        r = scenario.need("sweep")
        assert re.search(r"^best on digits: \S+ val/top1 \d\.\d{4}$", r.out, re.M), str(r)
        assert "trial(s) failed" not in r.err, str(r)

    def test_compare_reads_everything_back(self, scenario):
        for step in ("pretrain", "finetune", "fewshot", "sweep"):
            scenario.need(step)
        sets = scenario.sets(scenario.finetune_sets()[:2])  # work_dir, tracking.uri
        rows = json.loads(ok(scenario.vitp("compare", *sets, "--format", "json")).out)
        by_id = {row["run_id"]: row for row in rows}
        assert scenario.facts["pretrain_run"] in by_id and scenario.facts["finetune_run"] in by_id
        assert by_id[scenario.facts["finetune_run"]]["source"] == str(scenario.export)
        assert any(row.get("fewshot_25") is not None for row in rows)
        trials = [row for row in rows if row["sweep"] == scenario.SWEEP]
        assert sorted(row["source"] for row in trials) == sorted([str(scenario.export), "scratch"])
        assert all(row["status"] == "FINISHED" and row["lr"] in (0.1, "0.1") for row in trials), \
            [(row["source"], row["status"], row["lr"]) for row in trials]

        plot = scenario.work / "compare.png"
        r = ok(scenario.vitp("compare", *sets, "--sweep", scenario.SWEEP, "--plot", str(plot)))
        search_png = scenario.work / "compare-search.png"
        assert is_png(plot) and is_png(search_png) and f"wrote {search_png}" in r.err
        lines = [line for line in r.out.splitlines() if line.strip()]
        search = [line for line in lines if line.startswith(("best so far on ", "best configuration on ",
                                                             "the trials side by side in MLflow"))]
        table = [line for line in lines if line not in search]
        assert "best top-1" in table[0] and len(table) == 1 + 1 + 2  # header, rule, two trials
        assert len(search) == 3 and "after each of 2 trial(s)" in search[0], search
        assert search[1].startswith("best configuration on ") and "(trial " in search[1], search
        assert f"(parallel coordinates of the params they differ in): {scenario.uri}/#/compare-runs?runs=" in search[2]
        csv_out = ok(scenario.vitp("compare", *sets, "--sweep", scenario.SWEEP, "--format", "csv")).out
        csv_rows = [line for line in csv_out.splitlines() if line]
        assert csv_rows[0].startswith("best,recipe,variant,dataset,source,lr") and len(csv_rows) == 3

    def test_compare_ends_a_run_without_a_heartbeat_killed(self, scenario):
        """`vitp compare --stale-after SECONDS` (docs/failures.md, docs/training.md) first ends KILLED,
        never FINISHED, each RUNNING run whose last heartbeat is older than SECONDS, and shows it so;
        a run that beat within SECONDS stays RUNNING. The runs are left as a SIGKILLed driver and a
        live one leave them, their heartbeat tags written here (a real SIGKILL:
        tests/tracking/test_outage.py): 400 s old, past the 300 given and short of the default 600."""
        from vitp.tracking.spool import HEARTBEAT_TAG
        from vitp.tracking.stale import STALE_TAG

        client = scenario.tracking_client()
        experiment, beat = client.create_experiment("cli-stale"), time.time()
        dead = client.create_run(experiment, run_name="driver-killed", tags={HEARTBEAT_TAG: str(beat - 400)})
        alive = client.create_run(experiment, run_name="driver-alive", tags={HEARTBEAT_TAG: str(beat)})
        try:
            r = ok(scenario.vitp("compare", *scenario.sets(scenario.finetune_sets()[:2]), "--stale-after", "300",
                                 "--format", "json"))
            marked = re.findall(r"^marked run (\S+) \((.*)\) KILLED: no heartbeat for (\d+) s$", r.err, re.M)
            assert [m[:2] for m in marked] == [(dead.info.run_id, "driver-killed")], str(r)
            assert int(marked[0][2]) >= 400, str(r)
            shown = {row["run_id"]: row["status"] for row in json.loads(r.out)}
            assert (shown[dead.info.run_id], shown[alive.info.run_id]) == ("KILLED", "RUNNING"), shown
            after = client.get_run(dead.info.run_id)
            assert "no heartbeat" in after.data.tags[STALE_TAG]
            assert after.info.end_time == int((beat - 400) * 1000)  # it ended when it last beat
            assert client.get_run(alive.info.run_id).info.status == "RUNNING"
        finally:
            client.set_terminated(alive.info.run_id)  # leaves no RUNNING run to the commands after


# --- submit / jobs against a local Ray cluster (cluster/local.sh: one head node, no auth)


@dataclass
class LocalCluster:
    address: str  # the dashboard (Jobs API)
    state: Path  # its nodes' directories: Ray's logs, sessions, working dirs


@pytest.fixture(scope="module")
def local_cluster(scenario):
    """Started in the chain's environment (its secrets too), as a user starts one from their shell."""
    import tempfile

    port, dash = free_port(), free_port()
    state = Path(tempfile.mkdtemp(prefix="vitp-c", dir="/tmp"))  # short: Ray's socket paths are limited
    env = {**scenario.env, "PYTHON": sys.executable}
    script = ROOT / "cluster" / "local.sh"
    start = subprocess.run([str(script), "start", "--workers", "0", "--num-cpus", "1", "--port", str(port),
                            "--dashboard-port", str(dash), "--state-dir", str(state)],
                           env=env, capture_output=True, text=True, timeout=300)
    try:
        assert start.returncode == 0, start.stdout[-3000:] + start.stderr[-3000:]
        yield LocalCluster(f"http://127.0.0.1:{dash}", state)
    finally:
        subprocess.run([str(script), "stop", "--state-dir", str(state)], env=env, capture_output=True,
                       text=True, timeout=180)


@pytest.mark.e2e
@pytest.mark.ray
@pytest.mark.slow
def test_submit_and_jobs_against_a_local_cluster(scenario, local_cluster, tmp_path):
    spec = tmp_path / "job.yaml"
    spec.write_text("# the smallest job: resolve a recipe on the cluster and print it\n"
                    "entrypoint: vitp config debug --set train.steps=7\n"
                    "metadata:\n  stage: test\n"
                    # this machine's loopback goes to a cluster only when every node is this machine
                    "runtime_env:\n  env_vars:\n    MLFLOW_TRACKING_URI: ${MLFLOW_TRACKING_URI:-http://127.0.0.1:9}\n")
    address = ["--address", local_cluster.address]
    r = ok(scenario.vitp("submit", str(spec), *address, "--follow", timeout=600))
    assert "job spec" in r.out and "debug" in r.out.splitlines()[0], str(r)
    job_id = re.search(r"^submitted (\S+) to ", r.out, re.M).group(1)
    assert f"job {job_id} SUCCEEDED" in r.out and '"steps": 7' in r.out  # --follow streamed the job's output

    listed = ok(scenario.vitp("jobs", "list", *address)).out
    assert re.search(rf"^{re.escape(job_id)}\s+SUCCEEDED\s", listed, re.M), listed
    logs = ok(scenario.vitp("jobs", "logs", job_id, *address)).out
    assert '"recipe": "debug"' in logs and '"steps": 7' in logs
    assert ok(scenario.vitp("jobs", "stop", job_id, *address)).out.strip() == f"{job_id}: already finished"


# --- no secret leaves the chain


def _forms(secret: str) -> set[bytes]:
    """A secret as it could be written: as is, URL-encoded (a URI), JSON-escaped, base64-encoded
    (standard or URL-safe alphabet), alone or inside a longer base64 text such as a Basic auth
    header's "user:password" (the characters fixed by the secret alone, at each of 3 alignments)."""
    import base64
    from urllib.parse import quote, quote_plus

    forms = {secret, quote(secret, safe=""), quote_plus(secret), json.dumps(secret)[1:-1]}
    for encode in (base64.b64encode, base64.urlsafe_b64encode):
        for shift in range(3):
            text = encode(b"\0" * shift + secret.encode()).decode()
            forms.add(text[-(-shift * 8 // 6):(shift + len(secret)) * 8 // 6])
    return {f.encode() for f in forms}


def _files(*roots: Path):
    for root in roots:
        for path in root.rglob("*"):
            if path.is_file() and not path.is_symlink():
                yield path


@pytest.mark.e2e
@pytest.mark.ray
@pytest.mark.slow
def test_no_secret_leaves_the_chain(scenario, local_cluster, s3, tmp_path):
    """The whole chain above, then doctor, submit and jobs on a cluster started in the same shell,
    with the secrets of SECRETS in the environment and the database URI: none of them, in any
    form (base64 too), is in a printed line, an MLflow run (params, tags, metrics, inputs, artifacts), a
    registered or logged model, a job record, the tracking database's files, the S3 bucket, or
    any file the chain, the MLflow server or the cluster wrote (Ray's logs included)."""
    from urllib.parse import quote, urlparse

    from mlflow.tracking import MlflowClient
    from ray.job_submission import JobSubmissionClient

    for step in ("pretrain", "export", "finetune", "fewshot", "sweep"):
        scenario.need(step)
    address = ["--address", local_cluster.address]
    sets = scenario.sets(scenario.finetune_sets()[:2])
    ok(scenario.vitp("compare", *sets))
    r = scenario.vitp("doctor", "debug", *address, *sets)
    assert r.rc == 0, str(r)
    spec = tmp_path / "job.yaml"
    spec.write_text(f"entrypoint: vitp compare --set work_dir={scenario.work} --set tracking.uri={scenario.uri}\n")
    job_id = re.search(r"^submitted (\S+) to ", ok(scenario.vitp("submit", str(spec), *address, "--follow")).out,
                       re.M).group(1)
    ok(scenario.vitp("jobs", "list", *address))
    ok(scenario.vitp("jobs", "logs", job_id, *address))
    # a URI with credentials in it, where a path is expected: refused in one line that does not repeat them
    key = SECRETS["S3 secret key"]
    bad = scenario.vitp("preprocess", "debug", "--set", f"data.shards=s3://AKIAFAKE:{quote(key, safe='')}@b/shards")
    assert bad.rc == 2 and "data.shards: a storage URI with credentials in it" in bad.err, str(bad)

    found = []  # (secret, where)

    def search(where: str, data: bytes) -> None:
        for name, secret in SECRETS.items():
            if any(form in data for form in _forms(secret)):
                found.append((name, where))

    for i, text in enumerate(scenario.printed):
        search(f"printed output #{i}", text.encode())
    # every object in the S3 server, MLflow's artifacts among them (the server stores each one,
    # byte for byte, under its --artifacts-destination)
    objects = s3.client().get_paginator("list_objects_v2")
    stored = {}  # s3 key (bucket/key) -> size
    for bucket in s3.client().list_buckets()["Buckets"]:
        for page in objects.paginate(Bucket=bucket["Name"]):
            for obj in page.get("Contents", []):
                stored[f"{bucket['Name']}/{obj['Key']}"] = obj["Size"]
                search(f"s3://{bucket['Name']}/{obj['Key']}",
                       s3.client().get_object(Bucket=bucket["Name"], Key=obj["Key"])["Body"].read())
    client = MlflowClient(scenario.uri)
    n_artifacts = 0
    for exp in client.search_experiments():
        search(f"experiment {exp.name}", json.dumps(dict(exp.tags)).encode())
        for run in client.search_runs([exp.experiment_id]):
            search(f"run {run.info.run_name}", json.dumps(run.to_dictionary(), default=str).encode())
            # each artifact MLflow lists is one of the objects searched above (same size); read
            # there, not downloaded through the server (about 2 s each through its proxy)
            assert run.info.artifact_uri.startswith("mlflow-artifacts:"), run.info.artifact_uri  # served by it
            root = f"{scenario.artifacts_bucket}/artifacts/{urlparse(run.info.artifact_uri).path.strip('/')}"
            for artifact in _all_artifacts(client, run.info.run_id):
                assert stored.get(f"{root}/{artifact.path}") == artifact.file_size, (run.info.run_name, artifact)
                n_artifacts += 1
    assert n_artifacts > 10, n_artifacts  # analysis, plots, configs, models: all were there to search
    for model in client.search_registered_models():
        search(f"registered model {model.name}", str(model).encode())
    jobs = JobSubmissionClient(local_cluster.address)
    for job in jobs.list_jobs():
        search(f"job record {job.submission_id}", job.model_dump_json().encode())
        if job.submission_id:
            search(f"job logs {job.submission_id}", jobs.get_job_logs(job.submission_id).encode())
    n = 0
    for path in _files(scenario.base, scenario.tmp, scenario.db_dir, local_cluster.state):
        n += 1
        search(str(path), path.read_bytes())
    assert n > 100, n  # the chain's files, the database's, Ray's logs: all were there to search
    assert not found, "\n".join(f"{name} in {where}" for name, where in found)


def _all_artifacts(client, run_id: str, path: str = "") -> list:
    """The run's artifacts (FileInfo: path, file_size), at every depth."""
    out = []
    for item in client.list_artifacts(run_id, path or None):
        out.extend(_all_artifacts(client, run_id, item.path) if item.is_dir else [item])
    return out
