"""Shared fixtures: one local Ray instance per pytest run (tests marked `ray` use it)."""
import os
import sys
from pathlib import Path

import pytest

# the suites' helpers beside this file (netproxy, postgres, numerics, ...) import by their names
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from s3server import S3Server, s3_environment
from tiers import mark_long
from vitp.net import free_port
from vitp.config import Run

# A test that uses one of these (directly or through another fixture) starts or joins Ray: it is
# marked `ray` here, so `make test-fast` (-m "not ray ...") leaves it out without anyone having to
# remember the marker.
RAY_FIXTURES = {"ray_session", "two_node_cluster", "auth_cluster", "rehearsal"}
# The session's real `mlflow server` (tests/tracking/conftest.py) costs a server start: a test on it
# is marked `slow` the same way, and `make test-fast` keeps the SQLite twin of each parametrized one.
SERVER_FIXTURES = {"mlflow_server"}


@pytest.hookimpl(tryfirst=True)  # before -m deselection, which reads the marker
def pytest_collection_modifyitems(config, items):
    mark_long(items, config.args)  # the long tier: tests/tiers.py
    for item in items:
        if RAY_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.ray)
        params = getattr(getattr(item, "callspec", None), "params", {})
        if SERVER_FIXTURES & set(getattr(item, "fixturenames", ())) or "server" in params.values():
            item.add_marker(pytest.mark.slow)


# after -m/-k deselection: only what runs is weighed
@pytest.hookimpl(trylast=True, specname="pytest_collection_modifyitems")
def pytest_collection_modifyitems_longest_files_first(items):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # pytest -n --dist loadfile --no-loadscope-reorder hands out whole files in collection
        # order: the longest first, so no long file starts last while the other worker has run out
        # of work. A file's length: the seconds its selected tests took (tests/durations.json, by
        # tests/durations.py), 1 s for a test not in it; with no such file, 30 s per slow or Ray test.
        measured = _durations()
        file_of = lambda item: item.nodeid.split("::")[0]  # noqa: E731
        weight: dict[str, float] = {}
        for item in items:
            heavy = item.get_closest_marker("slow") or item.get_closest_marker("ray")
            guess = measured.get(item.nodeid, 1.0) if measured else (30.0 if heavy else 0.1)
            weight[file_of(item)] = weight.get(file_of(item), 0.0) + guess
        items.sort(key=lambda item: -weight[file_of(item)])  # stable: the order within a file is kept


def _durations() -> dict[str, float]:
    """{test id: seconds it took}, as tests/durations.py last recorded them."""
    import json

    path = Path(__file__).with_name("durations.json")
    return json.loads(path.read_text()) if path.exists() else {}


@pytest.fixture(scope="session")
def ray_session():
    """A local Ray with 4 logical CPUs, started once and shut down at the end of the run. Always a
    new one: without address="local", ray.init connects to the cluster named in
    /tmp/ray/ray_current_cluster, which a script using ray.cluster_utils that did not end cleanly
    leaves behind (every e2e test that takes this fixture then errored)."""
    import ray
    from ray.data import DataContext

    started = False
    if not ray.is_initialized():
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
                 configure_logging=True, logging_level="WARNING")
        started = True
    DataContext.get_current().enable_progress_bars = False  # quiet logs
    yield ray
    if started:
        ray.shutdown()


# ---------------------------------------------------------------- shards shared by the whole run
# Preprocessed once per pytest process and only read by the tests that take them: a test that would
# change its shards makes its own (or copies these first).


def _preprocessed(tmp_path_factory, recipe: str) -> str:
    """`vitp preprocess RECIPE` into a fresh directory; returns the shards' path."""
    from vitp.data.commands import run_preprocess
    from vitp.recipes import resolve

    root = tmp_path_factory.mktemp(f"{recipe}-shards")
    run_preprocess(Run.of(resolve(recipe, [f"data.shards={root}"])), log=lambda s: None)
    return str(root)


@pytest.fixture(scope="session")
def debug_shards(ray_session, tmp_path_factory) -> str:
    """The `debug` recipe's synthetic fractal corpus as shards."""
    return _preprocessed(tmp_path_factory, "debug")


@pytest.fixture(scope="session")
def digits_shards(ray_session, tmp_path_factory) -> str:
    """scikit-learn's digits as shards (`debug_finetune`): the fine-tuning and few-shot set of the
    debug chain."""
    return _preprocessed(tmp_path_factory, "debug_finetune")


# --------------------------------------------------------------------------- S3 on 127.0.0.1
# A real S3 HTTP API (moto in server mode) that pyarrow, boto3, Ray and MLflow talk to as to S3.
# The endpoint and credentials go into the environment before any Ray or cluster starts, so
# every process of the test run (Ray workers, `vitp` subprocesses, cluster nodes) inherits them;
# the server itself starts on first use of the `s3` fixture.


def pytest_configure(config):
    import tempfile

    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:  # under pytest -n: each worker its own TMPDIR (checkpoint staging, spools, conversions)
        config._vitp_tmpdir = tempfile.mkdtemp(prefix=f"vitp-{worker}-", dir="/tmp")  # short: Ray's sockets
        os.environ["TMPDIR"] = config._vitp_tmpdir
        tempfile.tempdir = None

    # Ray Train's controller polls its workers every 2 s (its default): each run waits on that poll
    # at every state change (start, checkpoint registration, the end). At 0.5 s a debug-sized run
    # ends 6-7 s (~17%) sooner; every process of the test run (Ray, clusters, vitp) inherits it.
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")

    os.environ.update(s3_environment(free_port()))


def pytest_unconfigure(config):
    import shutil
    from multiprocessing import util

    if getattr(config, "_vitp_tmpdir", None):  # made by pytest_configure above, for this worker only
        # at exit, after multiprocessing removed its own pymp-* folder in it (exitpriority -100):
        # removed before, multiprocessing prints a FileNotFoundError traceback as the worker ends
        util.Finalize(None, shutil.rmtree, args=(config._vitp_tmpdir, True), exitpriority=-101)


@pytest.fixture(scope="session")
def s3(tmp_path_factory):
    """A running S3 server on 127.0.0.1 (moto); `s3.bucket()` -> 's3://<new bucket>'."""
    server = S3Server(str(tmp_path_factory.mktemp("s3")))
    yield server
    server.stop()
