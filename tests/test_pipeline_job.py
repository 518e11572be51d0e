"""The job as users submit it: `ray start --head` on loopback, `ray job submit --working-dir`
with the job's command line, its log and outputs checked, then the cluster stopped."""
from __future__ import annotations

import itertools
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pyarrow.parquet as pq
import pytest

from conftest import make_model
from mist_core.demo import demo_corpus
from s3_server import free_ports

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
# Never uploaded with the job: the virtual environment alone is gigabytes.
EXCLUDES = [".venv", ".git", "outputs", "*.egg-info", "__pycache__", ".pytest_cache"]


TOKEN = secrets.token_hex(32)  # this test cluster's own token, for Ray's token authentication


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["RAY_AUTH_MODE"] = "token"
    env["RAY_AUTH_TOKEN"] = TOKEN
    # A single-machine cluster on the loopback address (Ray otherwise swaps 127.0.0.1 for
    # the machine's outward address so that other nodes could join).
    env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    env["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"] = "5"  # a test cluster: no 30 s drain on stop
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"  # `python` is this venv's
    env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost"
    return env


def _wait_http(url: str, proc: subprocess.Popen, timeout: float) -> None:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    deadline = time.monotonic() + timeout
    while True:
        try:
            opener.open(url, timeout=2).close()
            return
        except urllib.error.HTTPError:  # it answers (401 before a token is given): it is up
            return
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(f"ray start exited with {proc.returncode}") from None
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} did not answer in {timeout:.0f}s") from None
            time.sleep(0.5)


@pytest.fixture
def cluster(tmp_path):
    """A one-node Ray cluster of our own: `ray start --head --block` in its own process
    group, so that stopping it ends exactly the processes it started, and with its own temp
    dir, so that no later `ray.init()` on this machine takes it for the current cluster."""
    temp = tempfile.mkdtemp(prefix="mistray-", dir="/tmp")  # short: Ray puts sockets in it
    log = open(tmp_path / "ray-start.log", "wb")
    # Every port Ray would otherwise take at a fixed default (the job agent's is 52365) is a
    # free one, so that another Ray on this machine does not get in the way.
    names = ("port", "ray-client-server-port", "dashboard-agent-listen-port",
             "dashboard-agent-grpc-port", "runtime-env-agent-port", "metrics-export-port",
             "node-manager-port", "object-manager-port")
    dash, *numbers = free_ports(len(names) + 1)
    ports = [f"--{name}={n}" for name, n in zip(names, numbers)]
    proc = subprocess.Popen(
        [str(BIN / "ray"), "start", "--head", "--block", "--node-ip-address=127.0.0.1", *ports,
         "--num-cpus=2", "--include-dashboard=true", "--dashboard-host=127.0.0.1",
         f"--dashboard-port={dash}", "--disable-usage-stats", f"--temp-dir={temp}"],
        env=_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    address = f"http://127.0.0.1:{dash}"
    try:
        _wait_http(f"{address}/api/version", proc, timeout=120)
        deadline = time.monotonic() + 120
        while ray_cli("job", "list", "--address", address, timeout=60).returncode != 0:
            assert time.monotonic() < deadline, "the job API did not come up"
            time.sleep(1)
        yield SimpleNamespace(address=address, temp=temp)
    finally:
        proc.send_signal(signal.SIGTERM)  # ray start --block then stops what it started
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # anything of its group still around
        except ProcessLookupError:
            pass
        shutil.rmtree(temp, ignore_errors=True)


def ray_logs(temp: str, names=("dashboard_agent.log", "raylet.out", "dashboard_JobHead.log")) -> str:
    """The ends of the cluster's own logs, to say why a submission failed."""
    out = []
    for name in names:
        for path in Path(temp).glob(f"session_*/logs/{name}"):
            out.append(f"--- {path.name}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-15:]))
    return "\n".join(out)


def ray_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "ray"), *args], env=_env(), capture_output=True, text=True,
                          timeout=timeout)


def test_ray_job_submit(cluster, tmp_path, tokenizer):
    model = tmp_path / "tiny-llama"
    make_model("llama", len(tokenizer)).save_pretrained(model)
    tokenizer.save_pretrained(model)
    corpus = tmp_path / "corpus.jsonl"
    records = demo_corpus(6, seed=5)
    corpus.write_text("".join(json.dumps(r) + "\n" for r in records) + "not json\n")
    out = tmp_path / "out"

    started = (tmp_path / "ray-start.log").read_text()
    assert re.search(r"Local node IP\S*: \S*127\.0\.0\.1", started), started

    deadline = time.monotonic() + 240
    for attempt in itertools.count():  # the node's job agent may still be starting: Ray says so
        job_id = f"mist-test-{os.getpid()}-{attempt}"
        submit = ray_cli(
            "job", "submit", "--address", cluster.address, "--submission-id", job_id,
            "--working-dir", str(REPO), "--runtime-env-json", json.dumps({"excludes": EXCLUDES}),
            "--", "python", "-m", "pipelines.compress", "--input", str(corpus),
            "--model", str(model), "--output", str(out), "--budgets", "0.5,0.9",
            "--batch-size", "4")
        if "please try again later" not in submit.stdout + submit.stderr \
                or time.monotonic() > deadline:
            break
        time.sleep(5)
    assert submit.returncode == 0, submit.stdout + submit.stderr + ray_logs(cluster.temp)
    status = ray_cli("job", "status", "--address", cluster.address, job_id, timeout=60)
    logs = ray_cli("job", "logs", "--address", cluster.address, job_id, timeout=60).stdout
    assert f"Job '{job_id}' succeeded" in status.stdout, status.stdout + status.stderr + logs

    assert "plan: 7 rows read, 6 to score" in logs  # progress is in the job's log
    assert "[score]" in logs
    assert "MIST compression finished" in logs and str(out) in logs

    manifest = json.loads((out / "_manifest.json").read_text())
    c = manifest["counts"]
    assert (c["read"], c["scored"], c["rejected"]) == (7, 6, 1)
    assert c["rejected_by_reason"] == {"invalid_json": 1}
    data = pq.read_table(out / "data")
    assert sorted(data.column("budget").to_pylist()) == [0.5] * 6 + [0.9] * 6
    assert set(data.column("id").to_pylist()) == {r["id"] for r in records}
    assert set(data.column("topic").to_pylist()) == {r["topic"] for r in records}
