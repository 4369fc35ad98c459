"""Free ports: chosen below the ephemeral range, so no client's connect can take one meanwhile."""
import socket
import subprocess
import sys

from vitp.net import _ephemeral_low, free_port, free_ports


def test_a_free_port_is_bindable_outside_the_ephemeral_range_and_not_taken():
    low = _ephemeral_low()
    ports = free_ports(20)
    assert len(set(ports)) == 20
    for p in ports:
        assert p < low, (p, low)
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))
    held = socket.create_server(("127.0.0.1", ports[0]))
    try:
        assert all(free_port(taken={ports[1]}) not in (ports[0], ports[1]) for _ in range(50))
    finally:
        held.close()


def test_the_shell_launcher_gets_a_port_from_the_module():
    out = subprocess.run([sys.executable, "-m", "vitp.net", "6390", "8275"], capture_output=True, text=True,
                         check=True).stdout
    assert int(out) not in (6390, 8275) and int(out) < _ephemeral_low()


def test_the_test_forwarder_cuts_a_service_off_and_restores_it():
    """tests/netproxy.py's cut (the chaos soak's S3 outage): open connections are reset, new ones
    refused, until restore; the service itself keeps running."""
    import http.server
    import threading
    import urllib.request

    from netproxy import PortForward  # tests/netproxy.py

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    forward = PortForward(server.server_address[1])
    try:
        def status():
            try:
                return urllib.request.urlopen(forward.uri, timeout=10).status
            except urllib.error.HTTPError as e:  # the bare handler answers 501: reached
                return e.code
            except OSError:  # reset (or refused) by the forwarder, whichever way urllib words it
                return "cut"

        assert status() == 501
        forward.cut()
        assert status() == "cut" and forward.is_cut
        forward.restore()
        assert status() == 501
    finally:
        forward.close()
        server.shutdown()


def test_the_test_forwarder_slows_only_the_uploads_to_one_key(s3):
    """tests/netproxy.py's slow (the node-lost drill holds one checkpoint mid-upload): a PUT to the
    slowed key is still going after a PUT to another key, started later, has landed; ending the
    slowing lets it finish."""
    import threading
    import time

    import boto3

    bucket = s3.bucket().removeprefix("s3://")
    client = boto3.client("s3", endpoint_url=s3.endpoint)
    s3.proxy.slow("held/checkpoint", 20_000)  # 200 kB at 20 kB/s: 10 s, unless ended
    try:
        slow = threading.Thread(target=client.put_object,
                                kwargs=dict(Bucket=bucket, Key="held/checkpoint", Body=b"x" * 200_000))
        sent, deadline = s3.proxy.up, time.time() + 60
        slow.start()
        while s3.proxy.up < sent + 1_000 and time.time() < deadline:  # it is under way
            time.sleep(0.05)
        client.put_object(Bucket=bucket, Key="other/checkpoint", Body=b"y" * 400_000)
        keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket).get("Contents", [])]
        assert keys == ["other/checkpoint"], keys
    finally:
        s3.proxy.slow("", 0)
    slow.join(timeout=60)
    assert not slow.is_alive()
    assert client.head_object(Bucket=bucket, Key="held/checkpoint")["ContentLength"] == 200_000
