"""benchmarks/s3_disk_server.py (the benchmarks' S3 server: moto completing multipart uploads on
disk) is still S3: a multipart object reads back byte for byte with S3's multipart ETag, a per-part
checksum is kept, parts that are not in the upload or too small are refused, and pyarrow's
filesystem (what storage.py uses) round-trips a directory through it."""
import base64
import hashlib
import os
import subprocess
import sys
import time
import urllib.request
import zlib

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MB = 1 << 20


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory):
    from vitp.net import free_port

    port = free_port()
    log = open(tmp_path_factory.mktemp("s3d") / "server.log", "w")
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "benchmarks", "s3_disk_server.py"),
                             "-H", "127.0.0.1", "-p", str(port)], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while True:
        try:
            urllib.request.urlopen(url, timeout=2).read()
            break
        except Exception:
            assert proc.poll() is None and time.time() < deadline, "s3_disk_server.py did not start"
            time.sleep(0.2)
    yield url
    proc.terminate()
    proc.wait(timeout=20)
    log.close()


def _client(url):
    import boto3

    return boto3.client("s3", endpoint_url=url, aws_access_key_id="bench", aws_secret_access_key="bench",
                        region_name="us-east-1")


def _multipart(c, bucket, key, parts, **create):
    up = c.create_multipart_upload(Bucket=bucket, Key=key, **create)["UploadId"]
    done = []
    for n, body in enumerate(parts, 1):
        extra = {"ChecksumAlgorithm": create["ChecksumAlgorithm"]} if "ChecksumAlgorithm" in create else {}
        r = c.upload_part(Bucket=bucket, Key=key, UploadId=up, PartNumber=n, Body=body, **extra)
        done.append({"PartNumber": n, "ETag": r["ETag"], **({"ChecksumCRC32": r["ChecksumCRC32"]} if extra else {})})
    return up, done


def test_a_multipart_object_reads_back_with_s3s_etag_and_bad_parts_are_refused(endpoint):
    from botocore.exceptions import ClientError

    c = _client(endpoint)
    c.create_bucket(Bucket="parts")
    parts = [os.urandom(5 * MB), os.urandom(5 * MB), b"tail"]
    up, done = _multipart(c, "parts", "obj", parts)
    c.complete_multipart_upload(Bucket="parts", Key="obj", UploadId=up, MultipartUpload={"Parts": done})
    body = c.get_object(Bucket="parts", Key="obj")["Body"].read()
    assert body == b"".join(parts)
    etag = hashlib.md5(b"".join(hashlib.md5(p).digest() for p in parts)).hexdigest() + "-3"
    assert c.head_object(Bucket="parts", Key="obj")["ETag"].strip('"') == etag
    assert c.head_object(Bucket="parts", Key="obj")["ContentLength"] == len(body)

    up, done = _multipart(c, "parts", "composite", parts, ChecksumAlgorithm="CRC32")
    c.complete_multipart_upload(Bucket="parts", Key="composite", UploadId=up, MultipartUpload={"Parts": done})
    head = c.head_object(Bucket="parts", Key="composite", ChecksumMode="ENABLED")
    per_part = b"".join(zlib.crc32(p).to_bytes(4, "big") for p in parts)  # S3's composite: a CRC of the parts' CRCs
    assert head["ChecksumCRC32"].split("-")[0] == base64.b64encode(zlib.crc32(per_part).to_bytes(4, "big")).decode()
    assert c.get_object(Bucket="parts", Key="composite")["Body"].read() == body

    up, done = _multipart(c, "parts", "bad", parts)
    with pytest.raises(ClientError, match="InvalidPart"):
        c.complete_multipart_upload(Bucket="parts", Key="bad", UploadId=up, MultipartUpload={
            "Parts": [done[0], {"PartNumber": 2, "ETag": '"' + "0" * 32 + '"'}]})
    up, done = _multipart(c, "parts", "small", [b"x" * 100, b"y"])
    with pytest.raises(ClientError, match="EntityTooSmall"):
        c.complete_multipart_upload(Bucket="parts", Key="small", UploadId=up, MultipartUpload={"Parts": done})


def test_pyarrow_round_trips_a_directory_through_it(endpoint, tmp_path, monkeypatch):
    from vitp import storage

    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "bench")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "bench")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    _client(endpoint).create_bucket(Bucket="dirs")
    src = tmp_path / "src"
    (src / "a").mkdir(parents=True)
    (src / "a" / "big").write_bytes(os.urandom(23 * MB))  # several of pyarrow's upload parts
    (src / "small").write_bytes(b"1")
    storage.upload_dir(str(src), "s3://dirs/ck")
    assert storage.file_sizes("s3://dirs/ck") == {"a/big": 23 * MB, "small": 1}
    storage.download_dir("s3://dirs/ck", str(tmp_path / "back"))
    assert (tmp_path / "back" / "a" / "big").read_bytes() == (src / "a" / "big").read_bytes()
    assert (tmp_path / "back" / "small").read_bytes() == b"1"
