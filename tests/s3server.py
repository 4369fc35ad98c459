"""moto's S3 server on 127.0.0.1 behind a TCP forwarder (tests/netproxy.py), for tests and
benchmarks: pyarrow, boto3, Ray and MLflow talk to it as to S3, at the endpoint AWS_ENDPOINT_URL
names (set before anything starts, so every process inherits it)."""
import os
import re
import subprocess
import sys
import time
import urllib.request
import uuid


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
    a test can count the bytes a run downloaded (`proxy.down`) or slow its uploads (`proxy.up_rate`,
    or one key's: `proxy.slow`). `bucket()` makes a fresh bucket."""

    def __init__(self, log_dir):
        self.endpoint = os.environ["AWS_ENDPOINT_URL"]
        moto = os.path.join(os.path.dirname(sys.executable), "moto_server")
        self.log = open(os.path.join(log_dir, "moto.log"), "w")
        # port 0: moto binds a port of its own and prints it, so no other process can take the port
        # between its choice and moto's bind (a port chosen here first was once answered by
        # something else for a whole minute)
        self.proc = subprocess.Popen([moto, "-H", "127.0.0.1", "-p", "0"], stdout=self.log,
                                     stderr=subprocess.STDOUT)
        deadline = time.time() + 120
        port = self._wait(deadline, self._bound_port)
        self.proxy = PortForward(port, listen_port=int(self.endpoint.rsplit(":", 1)[1]))
        self._wait(deadline, lambda: urllib.request.urlopen(self.endpoint, timeout=10).read())
        self._n = 0

    def _bound_port(self) -> int:
        with open(self.log.name, errors="replace") as f:
            found = re.search(r"Running on http://127\.0\.0\.1:(\d+)", f.read())
        if not found:
            raise LookupError("moto_server has not printed its port yet")
        return int(found.group(1))

    def _wait(self, deadline: float, attempt):
        """attempt()'s value once it returns; fails, with moto's log, if moto exits or time runs out."""
        while True:
            try:
                return attempt()
            except Exception as e:
                if self.proc.poll() is not None or time.time() > deadline:
                    self.log.flush()
                    with open(self.log.name, errors="replace") as f:
                        tail = f.read()[-2000:]
                    raise RuntimeError(f"moto_server did not start ({e!r}; exit {self.proc.poll()}); "
                                       f"its log {self.log.name}:\n{tail}") from e
                time.sleep(0.2)

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
