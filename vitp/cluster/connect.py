"""Join a Ray cluster or start a local Ray sized for a config (loopback only unless $VITP_RAY_BIND says
otherwise; its token a private file, ray_token.py; telemetry off, vitp.net), and watch for placement
groups left holding CPUs (orphans.py): `connect_ray`; how much of Ray's own output a user sees
(vitp.console: errors and our lines, unless `vitp --verbose`). The one place a command calls
`ray.init`; never submits jobs or trains."""
from __future__ import annotations

import contextlib
import ipaddress
import json
import os
from typing import Iterator, Optional

import ray

from ..config import ExperimentConfig
from ..console import get_logger, library_log_level, log_env, quiet_env, verbose
from ..errors import ClusterError, ConfigError
from ..net import free_port, telemetry_env
from . import orphans, output
from .ray_token import local_auth_env

log = get_logger(__name__)


# Logical CPUs a local Ray has beside its Train workers' own: Train's controller and Ray Data's
# read/augment tasks (1 CPU each) need slots there.
READER_CPUS = 2


@contextlib.contextmanager
def _environ(**values: str) -> Iterator[None]:
    """os.environ with `values` set, restored afterwards."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


BIND_ENV = "VITP_RAY_BIND"
_LOOPBACK = ("", "127.0.0.1", "localhost", "loopback")


def local_bind() -> Optional[str]:
    """The address a local Ray's node takes, from $VITP_RAY_BIND: 127.0.0.1 when unset (every
    server of the node then listens on loopback only); `node` = Ray's own choice (this machine's
    routable address; several of Ray's servers then listen on all interfaces): None; or an IP
    address of this machine (::1 counts as loopback). ConfigError naming the choices for anything else."""
    value = os.environ.get(BIND_ENV, "").strip()
    if value.lower() in _LOOPBACK:
        return "127.0.0.1"
    if value.lower() == "node":
        return None
    try:
        addr = ipaddress.ip_address(value)
    except ValueError:
        addr = None
    if addr is None or addr.is_unspecified:
        raise ConfigError(f"{BIND_ENV}={value!r} is not an address a local Ray can take: use 127.0.0.1 (the "
                          "default: loopback only), `node` (Ray's choice, this machine's address) or an IP "
                          "address of this machine")
    return "127.0.0.1" if addr.is_loopback else str(addr)


@contextlib.contextmanager
def _node_address(ip: Optional[str]) -> Iterator[dict]:
    """ray.init's arguments for a local node at `ip` (None: Ray's choice), with Ray set up to keep it.

    Ray 2.60 replaces a loopback node address, given or not, with this machine's routable one
    (services.resolve_ip_for_localhost, get_node_ip_address), except where its multi-node support
    is off (ray_constants.ENABLE_RAY_CLUSTER, from RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER; off by default
    on Windows and macOS only). With it off the node is 127.0.0.1, and GCS, raylet, agents, metrics
    and every worker bind 127.0.0.1 (each checks for a loopback node address). It is off for this
    ray.init (read at import, so set here too) and in the environment its processes inherit; it
    only stops other nodes joining, which a loopback node cannot serve anyway."""
    if ip != "127.0.0.1":
        yield {} if ip is None else {"_node_ip_address": ip}
        return
    from ray._private import ray_constants

    before = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        with _environ(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0"):
            yield {"_node_ip_address": ip}
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = before


def local_cpus(cfg: ExperimentConfig) -> int:
    """Logical CPUs of a local Ray for `cfg`: the machine's, and at least the Train workers' plus
    READER_CPUS, times the trials a sweep was told to run at once (tune.max_concurrent_trials: each
    trial's readers need their slots too, or its data never comes)."""
    p = cfg.parallel
    per_run = int(p.num_workers * p.cpus_per_worker + 0.999) + READER_CPUS
    return max(os.cpu_count() or 1, per_run * max(1, cfg.tune.max_concurrent_trials))


def _submitted_job_env() -> dict:
    """The env_vars of the runtime_env this process's Ray job was submitted with (Ray's job manager
    hands the entrypoint its job config in RAY_JOB_CONFIG_JSON_ENV_VAR); {} outside a submitted job."""
    try:
        config = json.loads(os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR") or "{}")
        return dict((config.get("runtime_env") or {}).get("env_vars") or {})
    except (ValueError, AttributeError, TypeError):
        return {}


def connect_ray(cfg: ExperimentConfig, address: Optional[str] = None) -> None:
    """Join the cluster at `address` (or $RAY_ADDRESS); else start a local Ray sized for `cfg`.

    Locally the CPU count is logical: Train's controller and Ray Data's read/augment tasks need
    slots beside the workers, so we ask for at least workers x cpus_per_worker + READER_CPUS.
    """
    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    # telemetry_env: MLflow's telemetry and Ray's usage stats off (unless the user set them) in
    # every Train worker and trial, which import MLflow
    env = {**quiet_env(), **log_env(), **telemetry_env()}
    os.environ.update(env)  # this process (Ray Data on the driver) and local Ray's workers
    # every Ray process of this job: Ray's and Ray Train's own INFO lines stay in the log files
    logging_config = None if verbose() else ray.LoggingConfig(log_level="WARNING")
    if address:
        # the job's processes get the same environment, but the package (and so the Ray Data
        # YAML) may live elsewhere on the nodes: Ray Data's level instead (its INFO lines then
        # leave ray-data.log as well as the console)
        remote_env = {k: v for k, v in env.items() if k != "RAY_DATA_LOGGING_CONFIG"}
        if not verbose():
            remote_env["RAY_DATA_LOG_LEVEL"] = "WARNING"
        # inside a submitted job Ray refuses a ray.init that sets a variable the job's own
        # runtime_env sets too (a job spec's telemetry switches): the job's value stands
        job_env = _submitted_job_env()
        remote_env = {k: v for k, v in remote_env.items() if k not in job_env}
        try:
            ray.init(address=address, log_to_driver=True, logging_level=library_log_level(),
                     logging_config=logging_config, runtime_env={"env_vars": remote_env})
        except (ConnectionError, ray.exceptions.AuthenticationError) as e:
            raise ClusterError(
                f"cannot join the Ray cluster at {address}: {(str(e).strip().splitlines() or [''])[0]}; "
                "check that it is up (`ray status --address ...`) and, for a cluster started with token "
                "authentication, export RAY_AUTH_TOKEN_PATH=<its token file> (or RAY_AUTH_TOKEN) here") from None
        orphans.watch()  # placement groups our killed drivers' trials left holding CPUs
    else:
        # Its address is chosen here and given to the processes it starts, which inherit this
        # environment: Ray's state API (Train's placement-group cleaner calls it every second)
        # finds the cluster by scanning the machine when RAY_ADDRESS is unset, and fails with a
        # traceback when another Ray runs beside this one. This process keeps its own environment
        # (a later local start must not join a cluster that is gone); address="local" starts a
        # new Ray whatever RAY_ADDRESS says.
        # Its token likewise (RAY_AUTH_TOKEN_PATH): a private file of ours, not the ~/.ray/auth_token
        # Ray would write for others to read (ray_token.py); the driver keeps the token Ray loaded.
        ip = local_bind()
        port = free_port()
        auth_env, auth_line = local_auth_env()
        with _environ(RAY_GCS_SERVER_PORT=str(port), RAY_ADDRESS=f"127.0.0.1:{port}", **auth_env), \
                _node_address(ip) as node:
            # the driver's own ray logger at ERROR unless verbose: ray.init's notices (that token
            # auth is on, ...) are not for the user to act on; auth_line says what we did instead
            ray.init(address="local", num_cpus=local_cpus(cfg), include_dashboard=False,
                     logging_level="INFO" if verbose() else "ERROR", logging_config=logging_config, **node)
        if auth_line:
            log.info(auth_line)
    orphans.watch_job()  # placement groups of Train runs whose trials Tune stopped or paused
    if not verbose():
        output.install()
