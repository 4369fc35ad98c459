"""moto's S3 server on 127.0.0.1 behind a TCP forwarder (tests/netproxy.py), for tests and
benchmarks: pyarrow, boto3, Ray and MLflow talk to it as to S3, at the endpoint AWS_ENDPOINT_URL
names (set before anything starts, so every process inherits it)."""
import os
import subprocess
import sys
import time
import urllib.request
import uuid

from vitp.net import free_port

from netproxy import PortForward

ENV_KEYS = ("AWS_ENDPOINT_URL", "MLFLOW_S3_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
            "AWS_DEFAULT_REGION")


def s3_environment(port: int) -> dict[str, str]:
    """What every process needs to reach the server at 127.0.0.1:`port` with moto's credentials."""
    endpoint = f"http://127.0.0.1:{port}"
    return {"AWS_ENDPOINT_URL": endpoint, "MLFLOW_S3_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


class S3Server:
    """moto_server, reached through `proxy` (tests/netproxy.py) on the port chosen in pytest_configure:
    a test can count the bytes a run downloaded (`proxy.down`) or slow its uploads (`proxy.up_rate`).
    `bucket()` makes a fresh bucket."""

    def __init__(self, log_dir):
        self.endpoint = os.environ["AWS_ENDPOINT_URL"]
        port = free_port()
        moto = os.path.join(os.path.dirname(sys.executable), "moto_server")
        self.log = open(os.path.join(log_dir, "moto.log"), "w")
        self.proc = subprocess.Popen([moto, "-H", "127.0.0.1", "-p", str(port)], stdout=self.log,
                                     stderr=subprocess.STDOUT)
        self.proxy = PortForward(port, listen_port=int(self.endpoint.rsplit(":", 1)[1]))
        deadline = time.time() + 60
        while True:
            try:
                urllib.request.urlopen(self.endpoint, timeout=2).read()
                break
            except Exception:
                if self.proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"moto_server did not start; see {self.log.name}")
                time.sleep(0.2)
        self._n = 0

    @property
    def env(self) -> dict[str, str]:
        return {k: os.environ[k] for k in ENV_KEYS}

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint)

    def bucket(self, prefix: str = "vitp") -> str:
        """A new empty bucket; returns its URI s3://name."""
        self._n += 1
        name = f"{prefix}-{self._n}-{uuid.uuid4().hex[:8]}".lower()
        self.client().create_bucket(Bucket=name)
        return f"s3://{name}"

    def stop(self):
        self.proxy.close()
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except Exception:
            self.proc.kill()
        self.log.close()
