"""connect_ray's local Ray beside another one on the same machine (the test session's): its
processes find their own cluster, not "multiple active Ray instances" (Ray's state API scans the
machine when RAY_ADDRESS is unset; Train's placement-group cleaner calls it every second)."""
import json
import os
import subprocess
import sys

import pytest

from .conftest import ROOT

PROBE = """
import json, os, ray
from vitp.cluster.connect import connect_ray
from vitp.recipes import resolve

connect_ray(resolve("debug", check_paths=False))

@ray.remote(num_cpus=0)
def found():
    from ray._private.services import canonicalize_bootstrap_address_or_die
    return canonicalize_bootstrap_address_or_die(None)

mine = ray.get_runtime_context().gcs_address
print(json.dumps({"mine": mine, "found": ray.get(found.remote()), "driver_env": os.environ.get("RAY_ADDRESS")}))
"""


@pytest.mark.long(reason="checks the synthetic data or import costs, whose subjects change rarely")
def test_a_local_ray_beside_another_is_the_one_its_processes_find(ray_session):
    other = ray_session.get_runtime_context().gcs_address  # a second Ray on this machine, running
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    p = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["mine"] != other
    assert got["found"].rsplit(":", 1)[1] == got["mine"].rsplit(":", 1)[1], got  # its own, by port
    assert got["driver_env"] is None  # the driver's environment is left as it was
