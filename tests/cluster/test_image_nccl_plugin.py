"""cluster/image/nccl_net_plugin.sh, run for real on folder trees laid out as each EFA installer did,
and cluster/Dockerfile's two calls of it: the image build must fail when NCCL would not find the
aws-ofi-nccl plugin on the path the image gives it (NCCL itself only falls back to TCP sockets).
A rehearsal replays the Dockerfile's link step, LD_LIBRARY_PATH and final verify step on a tree."""
import os
import re
import shutil
import subprocess
from fnmatch import fnmatch
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "cluster" / "image" / "nccl_net_plugin.sh"
DOCKERFILE = ROOT / "cluster" / "Dockerfile"
# the folders the script searches, in its order (lib: installer >= 1.44; lib/<triplet>: before)
LAYOUTS = ["lib", "lib64", "lib/x86_64-linux-gnu", "lib/aarch64-linux-gnu"]


def _run(*args: str, env: dict | None = None, sh: str = "sh") -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "NCCL_NET_PLUGIN")}
    return subprocess.run([sh, str(SCRIPT), *args], env={**base, **(env or {})},
                          capture_output=True, text=True, timeout=30)


def _one_error_line(p: subprocess.CompletedProcess) -> str:
    assert p.returncode != 0 and not p.stdout, (p.returncode, p.stdout)
    lines = p.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("nccl_net_plugin.sh: "), p.stderr
    return lines[0]


@pytest.fixture(scope="module")
def shared_object(tmp_path_factory) -> bytes:
    """A real, tiny shared object for this machine: compiled when a C compiler is here, else the
    smallest one the system has."""
    tmp = tmp_path_factory.mktemp("elf")
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc:
        (tmp / "plugin.c").write_text("int ncclNetPluginStub(void) { return 0; }\n")
        subprocess.run([cc, "-shared", "-fPIC", "-o", str(tmp / "plugin.so"), str(tmp / "plugin.c")],
                       check=True, capture_output=True, timeout=60)
        return (tmp / "plugin.so").read_bytes()
    found = []
    for folder in ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/lib64"):
        for path in Path(folder).glob("*.so*"):
            if path.is_file() and path.stat().st_size < 1 << 20:
                head = path.read_bytes()[:18]
                if head[:4] == b"\x7fELF" and head[16:18] == b"\x03\x00":
                    found.append((path.stat().st_size, path))
    assert found, "no C compiler and no small shared object in the system's lib folders"
    return min(found)[1].read_bytes()


def _install(prefix: Path, layout: str, data: bytes, names=("libnccl-net-ofi.so", "libnccl-net.so")) -> Path:
    """The plugin as the installer leaves it: libnccl-net-ofi.so and libnccl-net.so in one folder."""
    folder = prefix / layout
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        (folder / name).write_bytes(data)
    return folder


# --------------------------------------------------------------------------- find and link


@pytest.mark.parametrize("sh", ["sh", "dash", "bash"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_find_prints_the_folder_holding_the_plugin_in_each_installer_layout(tmp_path, shared_object, layout, sh):
    if not shutil.which(sh):
        pytest.skip(f"no {sh} here")  # Ubuntu's /bin/sh (what RUN uses) is dash
    folder = _install(tmp_path, layout, shared_object)
    p = _run("find", str(tmp_path), sh=sh)
    assert p.returncode == 0 and p.stdout == f"{folder}\n", p.stderr


@pytest.mark.parametrize("layout", LAYOUTS)
def test_link_points_the_stable_name_at_the_plugins_folder(tmp_path, shared_object, layout):
    folder = _install(tmp_path, layout, shared_object)
    p = _run("link", str(tmp_path))
    assert p.returncode == 0, p.stderr
    link = Path(p.stdout.strip())
    assert link.parent == tmp_path and link.is_symlink()
    assert os.readlink(link) == layout  # relative: valid wherever the tree is mounted
    assert link.resolve() == folder.resolve()
    again = _run("link", str(tmp_path))  # a rebuild step that runs twice replaces the link
    assert again.returncode == 0 and again.stdout == p.stdout and link.resolve() == folder.resolve()


def test_link_refuses_to_write_into_a_real_folder_of_the_stable_name(tmp_path, shared_object):
    _install(tmp_path, "lib", shared_object)
    link = Path(_run("link", str(tmp_path)).stdout.strip())
    link.unlink()
    link.mkdir()
    assert "is not a symlink" in _one_error_line(_run("link", str(tmp_path)))


def test_a_missing_plugin_fails_in_one_line_naming_every_folder_it_searched(tmp_path, shared_object):
    _install(tmp_path, "lib", shared_object, names=["libnccl-net.so"])  # aws-ofi-nccl < 1.15's only name
    line = _one_error_line(_run("find", str(tmp_path)))
    assert f"no libnccl-net-ofi.so in {tmp_path}/" in line
    assert all(layout in line for layout in LAYOUTS), line
    assert _run("link", str(tmp_path)).returncode != 0 and not (tmp_path / "nccl-lib").exists()


def _patched(data: bytes, offset: int, value: bytes) -> bytes:
    return data[:offset] + value + data[offset + len(value):]


REFUSED = {  # what dlopen would refuse, and the words that say why
    "text": (lambda so: b"INPUT(libnccl-net-ofi.so.1)\n", "not an ELF shared object"),
    "empty": (lambda so: b"", "not an ELF shared object"),
    "32-bit": (lambda so: _patched(so, 4, b"\x01"), "not a 64-bit little-endian"),
    "executable": (lambda so: _patched(so, 16, b"\x02\x00"), "not a shared object"),
    "other-machine": (lambda so: _patched(so, 18, b"\x28\x00"), "built for ELF machine 40"),  # EM_ARM
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_file_dlopen_would_refuse_is_refused(tmp_path, shared_object, case):
    make, words = REFUSED[case]
    _install(tmp_path, "lib", make(shared_object))
    line = _one_error_line(_run("find", str(tmp_path)))
    assert f"{tmp_path}/lib/libnccl-net-ofi.so: " in line and words in line, line


# --------------------------------------------------------------------------- verify


def test_verify_finds_the_plugin_ncclnetplugin_ofi_names_on_ld_library_path(tmp_path, shared_object):
    folder = _install(tmp_path / "p", "lib/x86_64-linux-gnu", shared_object)
    path = f"/nonexistent:{tmp_path / 'empty'}::{folder}"
    p = _run("verify", "ofi", env={"LD_LIBRARY_PATH": path})
    assert p.returncode == 0 and p.stdout == f"{folder}/libnccl-net-ofi.so\n", p.stderr


def test_verify_fails_when_ld_library_path_lacks_the_plugins_folder(tmp_path, shared_object):
    """The issue's case: the installer put the plugin in lib/x86_64-linux-gnu, the image named lib."""
    _install(tmp_path, "lib/x86_64-linux-gnu", shared_object)
    for env in ({"LD_LIBRARY_PATH": f"{tmp_path}/lib:/usr/local/nvidia/lib64"}, {}):
        line = _one_error_line(_run("verify", "ofi", env=env))
        assert "libnccl-net-ofi.so is in no LD_LIBRARY_PATH folder" in line and "TCP" in line, line


def test_verify_checks_the_first_match_the_one_dlopen_loads(tmp_path, shared_object):
    bad = _install(tmp_path / "bad", "lib", b"not a library")
    good = _install(tmp_path / "good", "lib", shared_object)
    line = _one_error_line(_run("verify", "ofi", env={"LD_LIBRARY_PATH": f"{bad}:{good}"}))
    assert f"{bad}/libnccl-net-ofi.so: not an ELF" in line


def test_verify_resolves_names_as_nccl_does(tmp_path, shared_object):
    """No name: this environment's NCCL_NET_PLUGIN, unset -> libnccl-net.so; a path (GCP's TCPX
    plugin, cluster/gcp/tcpx.sh) is checked as it stands; none loads nothing."""
    folder = _install(tmp_path, "lib", shared_object)
    tcpx = _install(tmp_path / "tcpx", "lib64", shared_object, names=["libnccl-net.so"]) / "libnccl-net.so"
    env = {"LD_LIBRARY_PATH": str(folder)}
    assert _run("verify", env=env).stdout == f"{folder}/libnccl-net.so\n"
    assert _run("verify", env={**env, "NCCL_NET_PLUGIN": "ofi"}).stdout == f"{folder}/libnccl-net-ofi.so\n"
    assert _run("verify", "libnccl-net-ofi.so", env=env).stdout == f"{folder}/libnccl-net-ofi.so\n"
    assert _run("verify", env={**env, "NCCL_NET_PLUGIN": str(tcpx)}).stdout == f"{tcpx}\n"
    assert _run("verify", "none", env={}).returncode == 0
    assert "does not exist" in _one_error_line(_run("verify", str(tmp_path / "gone.so"), env=env))
    assert "libnccl-net-tcpx.so is in no" in _one_error_line(_run("verify", "tcpx", env=env))


def test_an_unknown_mode_fails_with_the_usage():
    assert "usage: nccl_net_plugin.sh find" in _one_error_line(_run("install"))


# --------------------------------------------------------------------------- the Dockerfile's calls


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of cluster/Dockerfile, continuation lines joined, comments dropped."""
    out, pending = [], ""
    for line in DOCKERFILE.read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        keyword, _, args = pending.strip().partition(" ")
        out.append((keyword.upper(), args.strip()))
        pending = ""
    return out


def _script_calls(args: str) -> list[list[str]]:
    """Each `... nccl_net_plugin.sh MODE ARG` in a RUN line, as [script path, mode, args...]."""
    calls = re.findall(r"(\S*nccl_net_plugin\.sh) (find|link|verify)\b([^&;|]*)", args)
    return [[script, mode, *rest.split()] for script, mode, rest in calls]


def _ld_library_path(instructions) -> list[str]:
    (value,) = [a.split("=", 1)[1] for k, a in instructions if k == "ENV" and a.startswith("LD_LIBRARY_PATH=")]
    return value.strip('"').split(":")


def test_the_efa_step_links_the_plugin_and_ld_library_path_names_that_link(tmp_path, shared_object):
    ins = _instructions()
    (i, efa), = [(i, a) for i, (k, a) in enumerate(ins) if k == "RUN" and "efa_installer.sh" in a]
    calls = [c for c in _script_calls(efa) if c[1] == "link"]
    assert len(calls) == 1 and efa.index("efa_installer.sh") < efa.index("nccl_net_plugin.sh link"), efa
    script, _, prefix = calls[0]
    # the script reaches the image before the step, from the build context's copy of this file
    copies = [a.split() for k, a in ins[:i] if k == "COPY"]
    assert ["cluster/image/nccl_net_plugin.sh", script] in [c[-2:] for c in copies], copies
    # the name the script links is the first folder on the image's path (the script owns the name)
    _install(tmp_path, "lib/x86_64-linux-gnu", shared_object)
    link = Path(_run("link", str(tmp_path)).stdout.strip())
    path = _ld_library_path(ins)
    assert path[0] == f"{prefix}/{link.relative_to(tmp_path)}", path
    assert path[1] == "/opt/amazon/efa/lib" and path[-1] == "${LD_LIBRARY_PATH}", path
    assert not [e for e in path if "tcpx" in e]  # TCPX's older NCCL core must not replace torch's


def test_the_last_step_verifies_the_plugin_against_the_images_final_environment():
    ins = _instructions()
    last_env = max(i for i, (k, a) in enumerate(ins) if k == "ENV")
    kind, args = ins[-1]
    assert kind == "RUN" and len(ins) - 1 > last_env, ins[-1]
    calls = _script_calls(args)
    # ofi: what cluster/aws.yaml's NCCL_NET_PLUGIN names on p5; none: what an unset one loads
    assert [c[1:] for c in calls] == [["verify", "ofi"], ["verify"]], calls
    dest = next(a.split()[-1] for k, a in ins if k == "COPY" and a.split()[-2:-1] == ["."])
    assert {c[0] for c in calls} == {f"{dest}/cluster/image/nccl_net_plugin.sh"}, calls


def test_the_image_leaves_ncclnetplugin_to_the_nodes_config():
    """a3 names TCPX's plugin through docker --env-file, p5 names ofi through --env: an image ENV
    would only be a default, but one that is wrong on every node but one."""
    assert not [a for k, a in _instructions() if k in ("ENV", "ARG") and "NCCL_NET_PLUGIN" in a]


def test_the_build_context_carries_the_script():
    ignore = (ROOT / "cluster" / "Dockerfile.dockerignore").read_text().splitlines()
    patterns = [p.strip() for p in ignore if p.strip() and not p.startswith("#")]
    rel = SCRIPT.relative_to(ROOT).parts
    for n in range(1, len(rel) + 1):
        part = "/".join(rel[:n])
        hits = [p for p in patterns
                if fnmatch(part, p) or (p.startswith("**/") and fnmatch(rel[n - 1], p[3:]))]
        assert not hits, (part, hits)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_rehearsal_of_the_build_passes_for_every_layout_and_fails_on_the_old_path(tmp_path, shared_object, layout):
    """The Dockerfile's own link and verify calls, run on a tree under tmp_path standing in for /:
    the layout the installer chose does not matter; the old LD_LIBRARY_PATH (lib) fails the build
    whenever the plugin is elsewhere."""
    ins = _instructions()
    efa = next(a for k, a in ins if k == "RUN" and "efa_installer.sh" in a)
    (_, mode, prefix), = [c for c in _script_calls(efa) if c[1] == "link"]
    _install(Path(f"{tmp_path}{prefix}"), layout, shared_object)
    assert _run(mode, f"{tmp_path}{prefix}").returncode == 0

    def verify(path: list[str]) -> list[subprocess.CompletedProcess]:
        base = "/usr/local/nvidia/lib:/usr/local/nvidia/lib64"  # the Ray image's own
        env = {"LD_LIBRARY_PATH": ":".join(base if e == "${LD_LIBRARY_PATH}" else f"{tmp_path}{e}" for e in path)}
        return [_run(*call[1:], env=env) for call in _script_calls(ins[-1][1])]

    assert all(p.returncode == 0 for p in verify(_ld_library_path(ins)))
    old = verify(["/opt/amazon/ofi-nccl/lib", "/opt/amazon/efa/lib", "${LD_LIBRARY_PATH}"])
    assert all(p.returncode == 0 for p in old) == (layout == "lib"), [p.stderr for p in old]
