"""A moto S3 server on 127.0.0.1 for the pipeline tests: a subprocess started on a free
port and stopped by its own handle, with throwaway credentials in the environment."""
from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

# Throwaway values; the tests check that the secret never reaches logs or the manifest.
ACCESS_KEY = "AKIATESTPIPELINE0001"
SECRET_KEY = "pipeline-test-secret-never-logged"


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """n distinct free ports: all held open while they are picked (one at a time, the system
    may hand out the same port twice)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


@contextlib.contextmanager
def moto_s3(timeout: float = 30.0, auth: bool = False):
    """Yield the endpoint URL of a fresh moto_server. `auth`: it checks credentials (moto's
    IAM authentication from the first request on), so that only keys made through its IAM
    API work and any other key is refused."""
    port = free_port()
    exe = Path(sys.executable).with_name("moto_server")
    env = dict(os.environ, **({"INITIAL_NO_AUTH_ACTION_COUNT": "0"} if auth else {}))
    proc = subprocess.Popen([str(exe), "-H", "127.0.0.1", "-p", str(port)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback, no proxy
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                opener.open(url, timeout=2).close()
                break
            except urllib.error.HTTPError:  # refused, so it is up (auth)
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto_server did not start on {url}") from None
                time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def s3_env(endpoint: str) -> dict[str, str]:
    """The environment a job needs to reach the server (credentials via the AWS chain)."""
    return {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true", "NO_PROXY": "127.0.0.1,localhost",
            "no_proxy": "127.0.0.1,localhost"}


def s3_client(endpoint: str):
    import boto3

    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                        aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY)


def keys(client, bucket: str, prefix: str = "") -> dict[str, str]:
    """key -> ETag of every object under a prefix."""
    out = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for obj in page.get("Contents", []):
            out[obj["Key"]] = obj["ETag"]
    return out


def environ_patch(values: dict[str, str]):
    """Set environment variables for a `with` block, restoring them after."""
    @contextlib.contextmanager
    def patch():
        old = {k: os.environ.get(k) for k in values}
        os.environ.update(values)
        try:
            yield
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    return patch()
