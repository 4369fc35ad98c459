"""The token of a local Ray (vitp.cluster.ray_token, used by connect_ray) is a file only its user can
read: Ray 2.60 would write ~/.ray/auth_token 0644 under umask 022 (any local user could read it and
run code through that Ray); vitp makes <tmp>/vitp-<uid>/ray/auth_token 0600 in a 0700 folder and
hands it to Ray by RAY_AUTH_TOKEN_PATH, and Ray's own start-up steps then take that token and write
none. Real files, the real umask; Ray's token steps run in a subprocess (no Ray is started)."""
import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from vitp.cluster.ray_token import local_auth_env, private_token, token_path
from vitp.errors import InputError
from vitp.tracking.redact import mask_known_secrets

ROOT = Path(__file__).resolve().parents[2]

# What ray.init does for a new local cluster before it starts one (ray/_private/worker.py, init):
# token auth on by default, then a token found or, where none is, made and saved.
RAY_NEW_CLUSTER_TOKEN = """
import json, os
os.umask(0o022)
from ray._private.authentication.authentication_token_setup import (
    enable_token_auth_by_default, ensure_token_if_auth_enabled)
from ray._raylet import AuthenticationTokenLoader
enable_token_auth_by_default()
ensure_token_if_auth_enabled({}, create_token_if_missing=True)
print(json.dumps({"token": AuthenticationTokenLoader.instance().get_raw_token()}))
"""


@pytest.fixture
def tmp(tmp_path, monkeypatch) -> Path:
    """This test's own temp dir (TMPDIR, read again by tempfile), home, and the usual umask 022."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)
    (tmp_path / "home").mkdir()
    old = os.umask(0o022)
    yield tmp_path
    os.umask(old)


def _ray_token_steps(home: Path, **env: str) -> str:
    """The token Ray's own new-cluster steps take, run with HOME=home and `env` (no RAY_AUTH_* else)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_AUTH", "RAY_ADDRESS"))}
    p = subprocess.run([sys.executable, "-c", RAY_NEW_CLUSTER_TOKEN], cwd=ROOT, capture_output=True, text=True,
                       env={**base, "HOME": str(home), **env}, timeout=120)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])["token"]


def _mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_a_local_rays_token_is_a_private_file_and_ray_writes_none(tmp):
    home = tmp / "home"
    env, line = local_auth_env({})
    path = Path(env["RAY_AUTH_TOKEN_PATH"])
    assert path == tmp / f"vitp-{os.geteuid()}" / "ray" / "auth_token"
    assert _mode(path) == 0o600 and _mode(path.parent) == 0o700 and _mode(path.parent.parent) == 0o700
    token = path.read_text()
    assert re.fullmatch(r"[0-9a-f]{64}", token)
    assert str(path) in line and "0600" in line and "Token authentication" not in line  # one line of ours
    assert token not in mask_known_secrets(f"a log line with {token} in it")  # and never printed
    # Ray's start-up takes this token and writes no file of its own
    assert _ray_token_steps(home, **env) == token
    assert not (home / ".ray").exists()
    # ... where without it Ray writes one any local user can read
    assert _ray_token_steps(home) == (home / ".ray" / "auth_token").read_text()
    assert _mode(home / ".ray" / "auth_token") & 0o044


def test_the_token_is_kept_made_private_again_and_a_planted_one_refused(tmp):
    path = Path(private_token())
    token = path.read_text()
    path.chmod(0o644)  # ours, opened up (a chmod, a copy): kept, made private again
    assert private_token() == str(path) and path.read_text() == token and _mode(path) == 0o600
    path.unlink()
    path.symlink_to(tmp / "elsewhere")  # a link is never followed: refused, nothing written there
    with pytest.raises(InputError) as e:
        private_token()
    assert str(e.value).count("\n") == 0 and f"{path} is a symlink" in str(e.value) and "remove it" in str(e.value)
    assert not (tmp / "elsewhere").exists()
    path.unlink()
    path.write_text("")
    with pytest.raises(InputError, match="is empty: .*remove it"):
        private_token()


def test_a_token_or_mode_the_user_chose_is_theirs(tmp):
    for chosen in ({"RAY_AUTH_MODE": "disabled"}, {"RAY_AUTH_TOKEN": "x" * 32},
                   {"RAY_AUTH_TOKEN_PATH": str(tmp / "mine")}):
        assert local_auth_env(chosen) == ({}, ""), chosen
    assert not os.path.lexists(token_path())  # nothing made for them
    assert local_auth_env({"RAY_AUTH_MODE": "token"})[0] == {"RAY_AUTH_TOKEN_PATH": token_path()}
