"""Storage faults end to end: the compression job on a local Ray reads and writes S3 through a
proxy (tests/fault_proxy.py) that takes the endpoint down. An outage of a few seconds is
ridden out; one that does not end fails the job with exit status 4 and a one-line message,
leaves no manifest and no credential anywhere, and the same command then resumes."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pyarrow.parquet as pq
import pytest
import ray

from conftest import job_in_process, loopback_ray
from fault_proxy import FaultProxy
from mist_core.data.demo import demo_corpus
from pipelines.job import compress
from pipelines.job.config import JobConfig
from pipelines.common.settings import validate
from s3_server import SECRET_KEY, environ_patch, keys, moto_s3, s3_client, s3_env

pytestmark = pytest.mark.integration  # moto_server, the job on Ray and in subprocesses

REPO = Path(__file__).resolve().parents[1]
BUCKET = "mist-fault-test"
BUDGETS = [0.5, 0.8]
OUTAGE_S = 4


@pytest.fixture(scope="module")
def s3():
    """moto_server behind the fault proxy. The job (and Ray's workers, which inherit the
    environment) reach S3 through the proxy; `client` talks to moto directly. A short retry
    budget keeps the persistent-failure test quick; it still outlasts OUTAGE_S."""
    with moto_s3() as url:
        proxy = FaultProxy(url)
        try:
            with environ_patch(s3_env(proxy.url) | {"MIST_STORAGE_RETRY_S": "8"}):
                client = s3_client(url)
                client.create_bucket(Bucket=BUCKET)
                yield SimpleNamespace(client=client, proxy=proxy)
        finally:
            proxy.close()


@pytest.fixture(scope="module")
def local_ray(s3):
    """Started after the S3 variables are set, so that its workers inherit them."""
    with loopback_ray():
        yield


def put_corpus(client, name: str, seed: int, n: int = 8) -> list[dict]:
    records = demo_corpus(n, seed=seed)
    for i, r in enumerate(records):
        r["id"] = f"{name}{i}"
    client.put_object(Bucket=BUCKET, Key=f"{name}/corpus/part-1.jsonl",
                      Body="".join(json.dumps(r) + "\n" for r in records).encode())
    return records


def config(name: str, model_dir) -> JobConfig:
    return validate(JobConfig(input=[f"s3://{BUCKET}/{name}/corpus/"],
                              output=f"s3://{BUCKET}/{name}/out", model=str(model_dir),
                              budgets=BUDGETS, unit="token", batch_size=4, actors=(1, 1)))


def body(client, key: str) -> bytes:
    return client.get_object(Bucket=BUCKET, Key=key)["Body"].read()


def assert_each_row_once(client, name: str, records: list[dict]) -> None:
    """data/ (read from moto directly) holds every (id, budget) exactly once."""
    pairs = Counter()
    for key in keys(client, BUCKET, f"{name}/out/data/"):
        if key.endswith(".parquet") and "/_" not in key:
            t = pq.read_table(io.BytesIO(body(client, key)), columns=["id", "budget"])
            pairs.update(zip(t.column("id").to_pylist(), t.column("budget").to_pylist()))
    assert pairs == Counter((r["id"], b) for r in records for b in BUDGETS)


def test_outage_at_first_write_is_ridden_out(s3, local_ray, model_dir):
    """The endpoint goes down when a Ray write task sends its first file, and all live
    connections with it: the write task retries until it is back."""
    records = put_corpus(s3.client, "a", seed=11)
    outages = s3.proxy.outages
    s3.proxy.fail_at(f"PUT /{BUCKET}/a/out/sft/_tmp-", OUTAGE_S)
    manifest = compress.run(config("a", model_dir))
    assert s3.proxy.outages == outages + 1
    c = manifest["counts"]
    assert (c["read"], c["scored"], c["rejected"]) == (8, 8, 0)
    assert manifest["totals"]["rows_per_budget"] == {"0.5": 8, "0.8": 8}
    assert_each_row_once(s3.client, "a", records)


def test_outage_at_start_is_ridden_out(s3, local_ray, model_dir):
    """Down when the job starts: the driver's listing of the input waits for it."""
    records = put_corpus(s3.client, "b", seed=12)
    refused = s3.proxy.refused
    s3.proxy.down(OUTAGE_S)
    manifest = compress.run(config("b", model_dir))
    assert s3.proxy.refused > refused  # the job did meet the outage
    assert manifest["counts"]["scored"] == 8
    assert_each_row_once(s3.client, "b", records)


def test_persistent_outage_fails_clearly_then_resumes(s3, model_dir, capfd):
    """Down for good from the first data file a write task sends: exit 4 with one clear
    line, no manifest, no secret anywhere; once storage is back the same command finishes."""
    # The job as users run it starts its own local Ray, with this environment (the proxy's
    # endpoint, the short retry budget); the tests' Ray would only compete for the 2 CPUs.
    ray.shutdown()
    records = put_corpus(s3.client, "c", seed=13)
    cmd = [sys.executable, "-m", "pipelines.compress", "--input", f"s3://{BUCKET}/c/corpus/",
           "--output", f"s3://{BUCKET}/c/out", "--model", str(model_dir), "--budgets", "0.5,0.8",
           "--unit", "token", "--batch-size", "4"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # a single-machine Ray on loopback

    s3.proxy.fail_at(f"PUT /{BUCKET}/c/out/sft/_tmp-")
    t = time.monotonic()
    failed = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=180)
    failed_s = time.monotonic() - t
    s3.proxy.up()
    assert failed.returncode == 4, failed.stdout + failed.stderr
    assert s3.proxy.trigger is None, "the outage never started"
    last = failed.stderr.strip().splitlines()[-1]
    assert last.startswith("error: storage unavailable: "), failed.stderr
    assert "rerun the same command" in last
    assert failed_s < 120
    written = keys(s3.client, BUCKET)
    assert "c/out/_manifest.json" not in written
    assert not [k for k in written if k.startswith("c/out/data/") and k.endswith(".parquet")
                and "/_" not in k]
    everything = failed.stdout + failed.stderr + "".join(
        body(s3.client, k).decode("utf-8", "replace") for k in written)
    assert SECRET_KEY not in everything

    # The same command once storage is back, in this process on a Ray of its own that
    # inherits the proxy's variables (a second subprocess would cost ~40 CPU-s more).
    with loopback_ray():
        again = job_in_process(cmd)
    printed = capfd.readouterr()
    assert SECRET_KEY not in printed.out + printed.err + json.dumps(again)
    manifest = json.loads(body(s3.client, "c/out/_manifest.json"))
    assert manifest == again
    assert manifest["counts"]["scored"] == 8
    assert_each_row_once(s3.client, "c", records)
