"""Files other users of the machine must not reach: the node-local roots (checkpoint staging,
metric spools) are this user's own 0700 directories under the temp dir, and one planted there
first (a symlink, another user's directory, a file) is refused, never followed; the MLflow
basic-auth config (it names the user store, a password in its URI perhaps) is a fresh 0600 file
in a fresh 0700 directory, nothing is written through a file or link planted at its name, and it
is gone once the server stops (Ctrl-C or SIGTERM to `vitp mlflow-server`, or a failed start)."""
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from vitp.errors import InputError
from vitp.paths import spool_root, staging_root, user_tmp
from vitp.tracking.server import AuthSettings, _auth_env, start_server
from vitp.tracking.spoolfile import MetricSpool, spool_dir_for
from vitp.tracking.store import TrackingError
from vitp.train.staging import new_stage

ROOT = Path(__file__).resolve().parents[2]
PASSWORD = "a-long-test-password-7f3k"


@pytest.fixture
def tmp(tmp_path, monkeypatch) -> Path:
    """A temp dir of this test's own, as TMPDIR (read again by tempfile)."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)
    return tmp_path


def _private(path) -> bool:
    st = os.lstat(path)
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o700


def test_the_node_local_roots_are_the_users_own_private_directories(tmp):
    mine = tmp / f"vitp-{os.geteuid()}"
    assert user_tmp() == str(mine)
    assert staging_root() == str(mine / "ckpt-staging") and spool_root() == str(mine / "mlflow-spool")
    assert all(_private(p) for p in (mine, mine / "ckpt-staging", mine / "mlflow-spool"))
    # what lands there: a checkpoint's stage and a run's spool file
    assert new_stage("run-a", 10, 0).startswith(str(mine / "ckpt-staging" / "run-a") + "/")
    spool = MetricSpool(spool_dir_for("run-id-1"))
    try:
        assert spool.path.parent == mine / "mlflow-spool" / "run-id-1"
        assert stat.S_IMODE(spool.path.stat().st_mode) == 0o600
    finally:
        spool.close()
    # a spool_dir the user names is taken as it is
    assert spool_dir_for("run-id-1", tmp / "elsewhere") == tmp / "elsewhere" / "run-id-1"


@pytest.mark.parametrize("where", ["user", "root"])
def test_a_symlink_planted_at_a_root_is_refused_not_followed(tmp, where):
    """Another user makes <tmp>/vitp-<uid> (or a root inside it) a link to a directory of theirs,
    hoping our staged checkpoints and spooled metrics land where they can read or plant them."""
    theirs = tmp / "attacker"
    theirs.mkdir()
    os.chmod(theirs, 0o777)
    mine = tmp / f"vitp-{os.geteuid()}"
    planted = mine if where == "user" else mine / "mlflow-spool"
    if where == "root":
        user_tmp()
    planted.symlink_to(theirs)
    with pytest.raises(InputError, match=rf"{planted} is a symlink: .*TMPDIR"):
        spool_root()
    with pytest.raises(InputError, match="is a symlink"):
        MetricSpool(spool_dir_for("run-id-1"))
    if where == "user":
        with pytest.raises(InputError, match="is a symlink"):
            new_stage("run-a", 10, 0)
    assert list(theirs.iterdir()) == []  # nothing made, nothing written through the link
    assert stat.S_IMODE(theirs.stat().st_mode) == 0o777  # and the mode of its target left alone


def test_a_root_someone_else_owns_is_refused(tmp, monkeypatch):
    """<tmp>/vitp-<uid> made first by another user: not ours to use (seen here as another uid)."""
    (tmp / f"vitp-{os.geteuid() + 1}").mkdir(mode=0o700)
    theirs = os.geteuid()
    monkeypatch.setattr(os, "geteuid", lambda: theirs + 1)
    with pytest.raises(InputError, match=rf"vitp-{theirs + 1} is owned by uid {theirs}, not by you "
                                         rf"\(uid {theirs + 1}\).*remove it"):
        staging_root()


def test_a_root_open_to_others_is_made_private_and_a_file_there_refused(tmp):
    mine = tmp / f"vitp-{os.geteuid()}"
    mine.mkdir()
    os.chmod(mine, 0o777)  # an older vitp's umask, or a chmod: ours, so made private
    (mine / "mlflow-spool").mkdir(mode=0o755)
    os.chmod(mine / "mlflow-spool", 0o755)
    assert spool_root() == str(mine / "mlflow-spool")
    assert _private(mine) and _private(mine / "mlflow-spool")
    (mine / "ckpt-staging").write_text("not a directory")
    with pytest.raises(InputError, match="ckpt-staging is not a directory"):
        staging_root()


# ------------------------------------------------------------------------------ the auth config


def test_the_auth_config_is_a_fresh_0600_file_in_a_fresh_0700_directory(tmp):
    env, private = _auth_env(AuthSettings(admin_password=PASSWORD), f"sqlite:///{tmp}/m.db", {})
    ini = Path(env["MLFLOW_AUTH_CONFIG_PATH"])
    assert ini.parent == private and private.parent == tmp and private.name.startswith("vitp-mlflow-auth-")
    assert _private(private) and stat.S_IMODE(ini.stat().st_mode) == 0o600 and ini.stat().st_uid == os.geteuid()
    assert f"database_uri = sqlite:///{tmp}/auth.db" in ini.read_text() and PASSWORD not in ini.read_text()


@pytest.mark.parametrize("planted", ["file", "symlink"])
def test_nothing_is_written_through_a_file_or_link_planted_at_the_auth_config(tmp, monkeypatch, planted):
    """As if another process got into the directory first: the config is created with O_EXCL and
    O_NOFOLLOW, so the start fails and the planted file (or the link's target) is left as it was."""
    victim = tmp / "readable-by-others.txt"
    victim.write_text("theirs")
    there = tmp / "taken"
    there.mkdir(mode=0o700)
    if planted == "file":
        (there / "auth.ini").write_text("theirs")
    else:
        (there / "auth.ini").symlink_to(victim)
    monkeypatch.setattr("tempfile.mkdtemp", lambda **kw: str(there))
    with pytest.raises(TrackingError, match=r"auth.ini: the basic-auth config could not be created afresh"):
        _auth_env(AuthSettings(admin_password=PASSWORD), f"sqlite:///{tmp}/m.db", {})
    assert victim.read_text() == "theirs"
    assert not there.exists()  # the directory the config was to go in is removed again


def _auth_dirs(tmp: Path) -> list[Path]:
    return sorted(tmp.glob("vitp-mlflow-auth-*"))


@pytest.mark.slow
def test_the_auth_config_is_removed_when_a_start_fails(tmp):
    with pytest.raises(TrackingError, match="did not answer /health"):
        start_server(f"sqlite:///{tmp}/m.db", str(tmp / "art"), auth=AuthSettings(admin_password=PASSWORD),
                     extra_args=["--no-such-flag"], log_path=tmp / "server.log", timeout=60)
    assert _auth_dirs(tmp) == [] and list(tmp.rglob("*.ini")) == []  # nor beside the log


@pytest.mark.slow
def test_the_auth_config_is_removed_when_vitp_mlflow_server_is_stopped(tmp_path):
    """`vitp mlflow-server --auth` stopped by a process manager (SIGTERM, which the command turns
    into the KeyboardInterrupt of a Ctrl-C): the server's process group ends and the config's
    directory goes with it."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env.update(TMPDIR=str(tmp), MLFLOW_AUTH_ADMIN_PASSWORD=PASSWORD)
    proc = subprocess.Popen(
        [sys.executable, "-m", "vitp.cli", "mlflow-server", "--auth", "--port", "0", "--workers", "1",
         "--backend-store-uri", f"sqlite:///{tmp_path}/m.db", "--artifacts-destination", str(tmp_path / "a"),
         "--log", str(tmp_path / "server.log")],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if "Ctrl-C stops it" in line:
                break
        assert "Ctrl-C stops it" in "".join(lines), "".join(lines)
        (private,) = _auth_dirs(tmp)
        assert _private(private) and stat.S_IMODE((private / "auth.ini").stat().st_mode) == 0o600
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert _auth_dirs(tmp) == [] and list(tmp_path.rglob("*.ini")) == [], (tmp_path / "server.log").read_text()[-2000:]


# ------------------------------------------------------------------- cluster/local.sh's state dir


@pytest.mark.parametrize("planted", ["symlink", "someone else's"])
def test_local_sh_refuses_a_state_dir_planted_by_another_user(tmp_path, planted):
    """The default state dir is a fixed name in /tmp: another user's link or directory there, with a
    pids file naming a process of ours, must not get that process signalled by `stop`."""
    if planted == "someone else's" and os.geteuid() != 0:
        pytest.skip("making a directory another user owns needs root")
    victim = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        theirs = tmp_path / "theirs"
        theirs.mkdir()
        (theirs / "pids").write_text(f"{victim.pid}\n")
        state = tmp_path / "vitp-ray-6390"
        if planted == "symlink":
            state.symlink_to(theirs)
        else:
            state = theirs
            os.chown(theirs, 65534, 65534)
        for cmd in ("stop", "status", "start"):
            p = subprocess.run([str(ROOT / "cluster" / "local.sh"), cmd, "--state-dir", str(state)],
                               capture_output=True, text=True, timeout=60)
            assert p.returncode == 2 and "--state-dir DIR" in p.stderr and str(state) in p.stderr, (cmd, p.stderr)
            assert len(p.stderr.strip().splitlines()) == 1
        assert victim.poll() is None  # not signalled
        assert sorted(os.listdir(theirs)) == ["pids"]  # nothing written there
    finally:
        victim.kill()
        victim.wait()
