"""What the launchers' nodes need on their first real run, checked offline: boot disks their machine
family takes (cluster/machines.yaml), GPUs handed to the container explicitly (through Ray's own
docker command), an image the nodes can pull, no change to project IAM from `ray up` on GCP (Ray's
bootstrap, run against a recording Google API), and the multi-node fabric: EFA on p5, GPUDirect-TCPX
NICs on a3, one placement group each."""
import json
import os
import re
import shlex
import stat
import subprocess
from pathlib import Path

import pytest
import yaml

from .conftest import ROOT

AWS = yaml.safe_load((ROOT / "cluster" / "aws.yaml").read_text())
GCP = yaml.safe_load((ROOT / "cluster" / "gcp.yaml").read_text())
MACHINES = yaml.safe_load((ROOT / "cluster" / "machines.yaml").read_text())
LAUNCHERS = {"aws.yaml": AWS, "gcp.yaml": GCP}


def _gpu(config: dict) -> bool:
    return lambda name: bool(config["available_node_types"][name].get("resources", {}).get("GPU"))


# ------------------------------------------------------------------------------------ boot disks


@pytest.mark.parametrize("name", sorted(GCP["available_node_types"]))
def test_every_gcp_boot_disk_names_a_type_its_machine_family_takes(name):
    """Without diskType the Compute API makes pd-standard, which A3 machines refuse: every node
    type names one, in the provider's zone, that cluster/machines.yaml lists for its family."""
    node = GCP["available_node_types"][name]["node_config"]
    family = node["machineType"].split("-")[0]
    assert family in MACHINES["gcp"], f"{name}: add machine family {family} to cluster/machines.yaml"
    (disk,) = node["disks"]
    disk_type = disk["initializeParams"].get("diskType")
    assert disk_type, f"{name}: no diskType, so pd-standard"
    zone, kind = re.fullmatch(r"zones/([a-z0-9-]+)/diskTypes/([a-z-]+)", disk_type).groups()
    assert zone == GCP["provider"]["availability_zone"], (name, zone)
    assert kind in MACHINES["gcp"][family]["boot_disk_types"], (name, kind)


def test_the_machine_table_keeps_pd_standard_off_a3():
    assert "pd-standard" not in MACHINES["gcp"]["a3"]["boot_disk_types"]


# ------------------------------------------------------------------------- GPUs in the container


def _docker_config(config: dict, node_type: str) -> dict:
    """The docker settings Ray gives a node of this type: `ray up` starts the head with the global
    ones (commands.get_or_create_head_node), the head's autoscaler starts a worker with its type's
    over them (StandardAutoscaler._get_node_specific_docker_config, called here on a bare instance)."""
    from ray.autoscaler._private.autoscaler import StandardAutoscaler
    from ray.autoscaler.tags import TAG_RAY_USER_NODE_TYPE

    if node_type == config["head_node_type"]:
        return config["docker"]
    autoscaler = object.__new__(StandardAutoscaler)
    autoscaler.config = config
    autoscaler.available_node_types = config["available_node_types"]
    autoscaler.provider = type("Tags", (), {"node_tags": lambda self, _id: {TAG_RAY_USER_NODE_TYPE: node_type}})()
    return autoscaler._get_node_specific_docker_config("node-1")


def _docker_run(config: dict, node_type: str) -> list[str]:
    """The `docker run` Ray sends to a node of this type, as the node's shell splits it: the global
    run_options and the head's or workers' (DockerCommandRunner.run_init), through Ray's own
    docker_start_cmds."""
    from ray.autoscaler._private.docker import docker_start_cmds

    docker = _docker_config(config, node_type)
    role = "head" if node_type == config["head_node_type"] else "worker"
    options = docker.get("run_options", []) + docker.get(f"{role}_run_options", [])
    cmd = docker_start_cmds("ubuntu", docker["image"], config["file_mounts"], docker["container_name"], options,
                            config["cluster_name"], "/home/ubuntu", "docker")
    return shlex.split(cmd)


@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_gpu_containers_get_every_gpu_explicitly_and_the_others_none(launcher):
    """Ray adds --runtime=nvidia only when nvidia-smi answers at start-up; the GPU types ask Docker
    for the GPUs themselves. The head and CPU types ask for none (Docker refuses --gpus there)."""
    config = LAUNCHERS[launcher]
    for name in config["available_node_types"]:
        argv = _docker_run(config, name)
        gpus = [a for a in argv if a.startswith("--gpus")]
        if _gpu(config)(name):
            assert gpus == ["--gpus=all"], (name, argv)
        else:
            assert not gpus, (name, argv)
        assert "--net=host" in argv and argv[-2:] == [config["docker"]["image"], "bash"], argv


def test_p5_containers_see_the_efa_devices_and_use_the_ofi_plugin():
    argv = _docker_run(AWS, "gpu")
    assert "--device=/dev/infiniband" in argv and "memlock=-1:-1" in argv, argv
    env = dict(argv[i + 1].split("=", 1) for i, a in enumerate(argv) if a == "--env")
    assert env["FI_PROVIDER"] == "efa" and env["NCCL_NET_PLUGIN"] == "ofi", env
    dockerfile = (ROOT / "cluster" / "Dockerfile").read_text()
    assert re.search(r"ARG EFA_INSTALLER_VERSION=\d+\.\d+\.\d+", dockerfile)
    assert "efa_installer.sh -y --skip-kmod" in dockerfile and "--skip-plugin" not in dockerfile
    (path,) = re.findall(r"ENV LD_LIBRARY_PATH=(\S+)", dockerfile)
    assert path.split(":")[:2] == ["/opt/amazon/ofi-nccl/nccl-lib", "/opt/amazon/efa/lib"], path
    assert "tcpx" not in path  # its older NCCL core must not replace torch's


def test_a3_containers_get_the_tcpx_plugin_socket_and_settings_the_host_prepares():
    argv = _docker_run(GCP, "gpu")
    volumes = {argv[i + 1] for i, a in enumerate(argv) if a == "--volume"}
    assert {"/var/lib/tcpx/lib64:/usr/local/tcpx/lib64", "/run/tcpx:/run/tcpx"} <= volumes, argv
    assert argv[argv.index("--env-file") + 1] == "/run/tcpx/nccl.env"
    init = GCP["available_node_types"]["gpu"]["initialization_commands"]
    assert init[:-1] == GCP["initialization_commands"]  # the type's list replaces the global one
    mount = next(t for t, src in GCP["file_mounts"].items() if src == "cluster/gcp")  # a folder: updated in place
    assert init[-1] == f"bash /tmp/ray_tmp_mount/{GCP['cluster_name']}{mount}/tcpx.sh"
    assert (ROOT / "cluster" / "gcp" / "tcpx.sh").exists()


# --------------------------------------------------------------------------- pulling the image


def _fake_tools(tmp_path: Path) -> Path:
    """aws, docker and gcloud that only write down how they were called."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("aws", "docker", "gcloud"):
        script = bin_dir / tool
        script.write_text(f'#!/bin/sh\necho "{tool} $*" >> "{tmp_path}/calls"\necho token\n')
        script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return bin_dir


def _login(config: dict) -> str:
    (cmd,) = [c for c in config["initialization_commands"] if "IMAGE=" in c]
    return cmd


@pytest.mark.parametrize("launcher,image,expected", [
    ("aws.yaml", "123456789012.dkr.ecr.eu-west-1.amazonaws.com/vit-pipeline:1",
     ["aws ecr get-login-password --region eu-west-1",
      "docker login --username AWS --password-stdin 123456789012.dkr.ecr.eu-west-1.amazonaws.com"]),
    ("gcp.yaml", "europe-west4-docker.pkg.dev/proj/repo/vit-pipeline:1",
     ["gcloud auth configure-docker europe-west4-docker.pkg.dev --quiet"]),
    ("aws.yaml", "ghcr.io/someone/vit-pipeline:1", []),
    ("gcp.yaml", "ghcr.io/someone/vit-pipeline:1", []),
])
def test_nodes_log_in_to_their_clouds_registry_with_their_own_identity(launcher, image, expected, tmp_path):
    """The host command before the container: an image in the cloud's registry is pulled with the
    node's own role or account; any other registry is taken as public (no login, no secret)."""
    config = LAUNCHERS[launcher]
    cmd = _login(config)
    assert re.search(r"IMAGE=(\S+) ", cmd).group(1) == config["docker"]["image"]  # kept in step
    cmd = re.sub(r"IMAGE=\S+ ", f"IMAGE={image} ", cmd)
    env = {"PATH": f"{_fake_tools(tmp_path)}:/usr/bin:/bin", "HOME": str(tmp_path)}
    out = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, env=env, timeout=30)
    assert out.returncode == 0, out.stderr
    calls = (tmp_path / "calls").read_text().splitlines() if (tmp_path / "calls").exists() else []
    assert sorted(calls) == sorted(expected)  # the two sides of a pipe run at once


def test_the_nodes_identities_may_pull_from_the_registry():
    for who in ("head", "worker"):
        policy = json.loads((ROOT / "cluster" / "aws" / f"{who}-policy.json").read_text())
        actions = {a for s in policy["Statement"] for a in ([s["Action"]] if isinstance(s["Action"], str) else s["Action"])}
        assert {"ecr:GetAuthorizationToken", "ecr:BatchGetImage", "ecr:GetDownloadUrlForLayer"} <= actions, who
    assert "roles/artifactregistry.reader" in (ROOT / "cluster" / "gcp" / "setup.sh").read_text()


# --------------------------------------------------------------------------- GCP project IAM


class _Google:
    """Google's APIs as far as `ray up`'s bootstrap asks them, each request written down."""

    def __init__(self, log: list):
        self.log = log

    def request(self, uri, method="GET", body=None, headers=None, redirections=1, connection_type=None):
        import httplib2

        path = uri.split("?")[0]
        self.log.append(f"{method} {path}")

        def reply(obj, status=200):
            return httplib2.Response({"status": str(status)}), json.dumps(obj).encode()

        project = GCP["provider"]["project_id"]
        if "cloudresourcemanager" in path:
            return reply({"bindings": [], "etag": "BwX"} if path.endswith(":getIamPolicy") else
                         {} if path.endswith(":setIamPolicy") else {"projectId": project, "lifecycleState": "ACTIVE"})
        if "iam.googleapis.com" in path:
            return (reply({"error": {"code": 404}}, 404) if method == "GET" else
                    reply({"email": f"ray-autoscaler-sa-v1@{project}.iam.gserviceaccount.com", "projectId": project}))
        if path.endswith("/subnetworks"):
            return reply({"items": [{"selfLink": f"https://compute.googleapis.com/compute/v1/projects/{project}/"
                                                 "regions/us-central1/subnetworks/default"}]})
        return reply({"error": {"code": 500, "message": f"not expected here: {method} {path}"}}, 500)


def _ray_up_bootstrap(config: dict, monkeypatch, tmp_path) -> tuple[dict, list[str]]:
    """Ray's own `ray up` bootstrap (commands._bootstrap_config) of `config`, against _Google."""
    from googleapiclient import discovery
    from ray.autoscaler._private import commands
    from ray.autoscaler._private.gcp import config as ray_gcp

    from vitp.cluster import gcp_provider

    log: list[str] = []

    def clients(_provider):
        build = lambda api: discovery.build(api, "v1", http=_Google(log), cache_discovery=False,  # noqa: E731
                                            static_discovery=True)
        return build("cloudresourcemanager"), build("iam"), build("compute"), None

    monkeypatch.setattr(gcp_provider, "construct_clients_from_provider_config", clients)
    monkeypatch.setattr(ray_gcp, "construct_clients_from_provider_config", clients)
    config = json.loads(json.dumps(config))
    key = tmp_path / "key.pem"  # an SSH key of the user's: Ray then leaves project metadata alone
    key.write_text("-")
    config["auth"]["ssh_private_key"] = str(key)
    return commands._bootstrap_config(config, no_config_cache=True), log


def test_ray_up_on_gcp_changes_no_project_iam(monkeypatch, tmp_path):
    """gcp.yaml's provider runs Ray's GCP bootstrap without its IAM step: no service account is
    read or made, the project's IAM policy is neither read nor set, every node keeps the account
    setup.sh makes. Ray's own provider, on the same file, makes ray-autoscaler-sa-v1 and sets it."""
    resolved, log = _ray_up_bootstrap(GCP, monkeypatch, tmp_path)
    project = GCP["provider"]["project_id"]
    # the project is read (the rest of the bootstrap ran); no subnet list: every type names its NICs
    assert log == [f"GET https://cloudresourcemanager.googleapis.com/v1/projects/{project}"], log
    for name, t in resolved["available_node_types"].items():  # never a GPU network by accident
        assert t["node_config"]["networkInterfaces"][0]["subnetwork"].endswith("/subnetworks/default"), name
    accounts = {a["email"] for t in resolved["available_node_types"].values() for a in t["node_config"]["serviceAccounts"]}
    assert accounts == {f"vit-pipeline-ray@{GCP['provider']['project_id']}.iam.gserviceaccount.com"}
    assert resolved["provider"]["module"] == "vitp.cluster.gcp_provider.NodeProvider"
    ray_own = {**GCP, "provider": {k: v for k, v in GCP["provider"].items() if k != "module"} | {"type": "gcp"}}
    _, log = _ray_up_bootstrap(ray_own, monkeypatch, tmp_path)
    assert any(c.endswith(":setIamPolicy") for c in log) and any("serviceAccounts" in c for c in log), log


def test_a_gcp_node_type_without_an_account_is_refused_in_one_line():
    from vitp.cluster.gcp_provider import NodeProvider

    config = json.loads(json.dumps(GCP))
    del config["available_node_types"]["cpu-data"]["node_config"]["serviceAccounts"]
    with pytest.raises(ValueError, match=r"^node type\(s\) cpu-data name no serviceAccounts: .*setup\.sh") as err:
        NodeProvider.bootstrap_config(config)
    assert "\n" not in str(err.value)


def test_ray_up_on_aws_takes_the_subnets_and_security_group_setup_makes(s3, tmp_path):
    """Ray's own `ray up` bootstrap of aws.yaml against EC2's API (moto's server): a VPC as
    setup.sh and the docs leave it (a public subnet for the head, a NAT subnet without public
    addresses for the workers, the shared security group) passes, every type keeps its subnet and
    group; with `use_internal_ips: false` Ray refuses the workers' subnet, as it would on AWS."""
    import boto3
    import click
    from ray.autoscaler._private import commands

    ec2 = boto3.client("ec2", region_name=AWS["provider"]["region"])  # AWS_ENDPOINT_URL: moto
    vpc = ec2.create_vpc(CidrBlock="10.0.0.0/16")["Vpc"]["VpcId"]
    zone = AWS["provider"]["region"] + "a"
    public = ec2.create_subnet(VpcId=vpc, CidrBlock="10.0.1.0/24", AvailabilityZone=zone)["Subnet"]["SubnetId"]
    ec2.modify_subnet_attribute(SubnetId=public, MapPublicIpOnLaunch={"Value": True})
    private = ec2.create_subnet(VpcId=vpc, CidrBlock="10.0.2.0/24", AvailabilityZone=zone)["Subnet"]["SubnetId"]
    group = ec2.create_security_group(GroupName=f"vit-pipeline-nodes-{vpc}", Description="test", VpcId=vpc)["GroupId"]
    text = ((ROOT / "cluster" / "aws.yaml").read_text().replace("subnet-PUBLIC_REPLACE_ME", public)
            .replace("subnet-PRIVATE_REPLACE_ME", private).replace("sg-REPLACE_ME", group))
    config = yaml.safe_load(text)
    key = tmp_path / "key.pem"  # the user's own key pair: Ray then creates none
    key.write_text("-")
    config["auth"]["ssh_private_key"] = str(key)
    for node_type in config["available_node_types"].values():
        node_type["node_config"]["KeyName"] = "vit"
    resolved = commands._bootstrap_config(json.loads(json.dumps(config)), no_config_cache=True)
    subnets = {n: set(t["node_config"]["SubnetIds"]) for n, t in resolved["available_node_types"].items()}
    assert subnets == {"head": {public}, "gpu": {private}, "cpu-data": {private}}, subnets
    assert all(set(t["node_config"]["SecurityGroupIds"]) == {group} for t in resolved["available_node_types"].values())
    config["provider"]["use_internal_ips"] = False
    with pytest.raises(click.ClickException, match="No usable subnets found for node type"):
        commands._bootstrap_config(config, no_config_cache=True)


# ---------------------------------------------------------------------------- multi-node fabric


def test_p5_nodes_have_every_efa_interface_in_one_cluster_placement_group():
    node = AWS["available_node_types"]["gpu"]["node_config"]
    facts = MACHINES["aws"][node["InstanceType"]]
    nics = node["NetworkInterfaces"]
    assert len(nics) == facts["efa_interfaces"] == 32
    assert sorted(n["NetworkCardIndex"] for n in nics) == list(range(32))
    assert all(n["InterfaceType"] == "efa" and n["DeviceIndex"] == (0 if n["NetworkCardIndex"] == 0 else 1)
               for n in nics), nics
    assert len({(n["SubnetId"], tuple(n["Groups"])) for n in nics}) == 1  # one subnet: one zone
    setup = (ROOT / "cluster" / "aws" / "setup.sh").read_text()
    group = node["Placement"]["GroupName"]
    assert f"create-placement-group --group-name {group} --strategy cluster" in setup
    for name, t in AWS["available_node_types"].items():  # the same security group everywhere
        groups = t["node_config"].get("SecurityGroupIds") or nics[0]["Groups"]
        assert groups == nics[0]["Groups"], name
        if name != "gpu":
            assert MACHINES["aws"][t["node_config"]["InstanceType"]]["efa_interfaces"] == 0


def test_a3_nodes_have_their_tcpx_nics_and_a_compact_placement_policy():
    node = GCP["available_node_types"]["gpu"]["node_config"]
    nics = node["networkInterfaces"]
    assert len(nics) == 1 + MACHINES["gcp"]["a3"]["gpu_nics"]
    assert all(n["nicType"] == "GVNIC" for n in nics) and "accessConfigs" in nics[0]
    region = GCP["provider"]["region"]
    setup = (ROOT / "cluster" / "gcp" / "setup.sh").read_text()
    for i, nic in enumerate(nics[1:], start=1):
        assert nic["subnetwork"] == f"regions/{region}/subnetworks/vit-pipeline-gpu-{i}", nic
        assert "accessConfigs" not in nic
    assert 'net="vit-pipeline-gpu-$i"' in setup and "--mtu 8244" in setup
    (policy,) = node["resourcePolicies"]
    assert policy == f"projects/{GCP['provider']['project_id']}/regions/{region}/resourcePolicies/vit-pipeline-a3"
    assert "group-placement vit-pipeline-a3" in setup and "--collocation collocated" in setup


def _host(tmp_path: Path, nics: list[str], default: str) -> dict:
    """A VM's /sys/class/net and /proc/net/route as tcpx.sh reads them."""
    for name in nics:
        (tmp_path / "sys" / "class" / "net" / name / "device").mkdir(parents=True)
    for name in ("lo", "docker0"):  # no PCI device: never a NIC
        (tmp_path / "sys" / "class" / "net" / name).mkdir(parents=True)
    (tmp_path / "proc" / "net").mkdir(parents=True)
    (tmp_path / "run").mkdir()
    (tmp_path / "proc" / "net" / "route").write_text(
        f"Iface\tDestination\tGateway\n{default}\t0000000A\t00000000\n{default}\t00000000\t0100000A\n")
    return {**os.environ, "TCPX_ENV_ONLY": "1", "TCPX_SYSFS": str(tmp_path / "sys"),
            "TCPX_PROCFS": str(tmp_path / "proc"), "TCPX_DIR": str(tmp_path / "run")}


# A gVNIC VM's names follow the PCI slot (nic0 on bus 0; the GPU NICs on buses 6 and 12, near the
# first CPU socket, and 134 and 140, near the second): in name order, the bindings' CPU ranges fit.
A3_NICS = ["enp0s12", "enp6s0", "enp12s0", "enp134s0", "enp140s0"]


def test_tcpx_settings_name_this_vms_own_nics(tmp_path):
    env = _host(tmp_path, A3_NICS, default="enp0s12")
    out = subprocess.run(["bash", str(ROOT / "cluster" / "gcp" / "tcpx.sh")], capture_output=True, text=True,
                         env=env, timeout=30)
    assert out.returncode == 0, out.stderr
    settings = dict(line.split("=", 1) for line in (tmp_path / "run" / "nccl.env").read_text().splitlines())
    assert settings["NCCL_GPUDIRECTTCPX_CTRL_DEV"] == settings["NCCL_SOCKET_IFNAME"] == "enp0s12"
    gpu_nics = ["enp6s0", "enp12s0", "enp134s0", "enp140s0"]  # bus order, not text order
    assert settings["NCCL_GPUDIRECTTCPX_SOCKET_IFNAME"] == ",".join(gpu_nics)
    tx = dict(b.split(":") for b in settings["NCCL_GPUDIRECTTCPX_TX_BINDINGS"].split(";"))
    assert list(tx) == gpu_nics and tx["enp12s0"] == "8-21,112-125" and tx["enp134s0"] == "60-73,164-177"
    assert settings["NCCL_NET_PLUGIN"] == "/usr/local/tcpx/lib64/libnccl-net.so"
    assert settings["NCCL_GPUDIRECTTCPX_UNIX_CLIENT_PREFIX"] == "/run/tcpx"


def test_tcpx_refuses_a_vm_without_its_four_gpu_nics(tmp_path):
    env = _host(tmp_path, A3_NICS[:2], default="enp0s12")
    out = subprocess.run(["bash", str(ROOT / "cluster" / "gcp" / "tcpx.sh")], capture_output=True, text=True,
                         env=env, timeout=30)
    assert out.returncode == 1 and "found 1 (enp6s0)" in out.stderr and "networkInterfaces" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr


def _docker_answering(tmp_path: Path, inspect: str) -> dict:
    """PATH with a `docker` whose `inspect` prints `inspect` and which writes down every call, and
    a silent `gcloud`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "docker").write_text(f'#!/bin/sh\necho "docker $*" >> "{tmp_path}/calls"\n'
                                    f'[ "$1" = inspect ] && echo "{inspect}"\nexit 0\n')
    (bin_dir / "gcloud").write_text("#!/bin/sh\nexit 0\n")
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    return {"PATH": f"{bin_dir}:/usr/bin:/bin", "TCPX_SETTLE_S": "0"}


def _rxdm() -> str:
    return re.search(r"^RXDM=(\S+)$", (ROOT / "cluster" / "gcp" / "tcpx.sh").read_text(), re.M).group(1)


def test_tcpx_leaves_a_running_manager_alone_when_ray_runs_it_again(tmp_path):
    """Ray reruns a type's initialization_commands when the config changes, maybe under a job: the
    manager already running the pinned image is neither replaced nor stopped."""
    env = {**_host(tmp_path, A3_NICS, default="enp0s12"), "TCPX_ENV_ONLY": ""}
    env.update(_docker_answering(tmp_path, f"{_rxdm()} true"))
    out = subprocess.run(["bash", str(ROOT / "cluster" / "gcp" / "tcpx.sh")], capture_output=True, text=True,
                         env=env, timeout=30)
    assert out.returncode == 0 and "already running" in out.stdout, out.stderr
    calls = (tmp_path / "calls").read_text().splitlines()
    assert all(c.startswith("docker inspect") for c in calls), calls


def test_tcpx_fails_when_the_manager_does_not_stay_up(tmp_path):
    env = {**_host(tmp_path, A3_NICS, default="enp0s12"), "TCPX_ENV_ONLY": ""}
    env.update(_docker_answering(tmp_path, "false 3"))  # neither running before nor after its start
    out = subprocess.run(["bash", str(ROOT / "cluster" / "gcp" / "tcpx.sh")], capture_output=True, text=True,
                         env=env, timeout=30)
    assert out.returncode == 1 and "did not stay up" in out.stderr, (out.stdout, out.stderr)
    calls = (tmp_path / "calls").read_text()
    assert "--restart unless-stopped --name receive-datapath-manager" in calls and _rxdm() in calls
    assert "docker logs" in calls


@pytest.mark.parametrize("args,word", [
    (["123456789012", "bucket", "vpc-1", "203.0.113.7/32"], "VPC_ID"),
    (["123456789012", "bucket", "vpc-0123456789abcdef0", "203.0.113.7"], "SSH_CIDR"),
    (["123456789012", "bucket", "vpc-0123456789abcdef0", "0.0.0.0/0"], "every address"),
])
def test_aws_setup_refuses_a_bad_network_before_any_call(args, word):
    out = subprocess.run(["bash", str(ROOT / "cluster" / "aws" / "setup.sh"), *args], capture_output=True,
                         text=True, env={"PATH": "/usr/bin:/bin"})  # no aws CLI on this PATH: refused first
    assert out.returncode == 2 and word in out.stderr, out.stderr
