"""The job as users submit it: `ray start --head` on loopback with token authentication, as
the README's block starts it (one head for the module), `ray job submit --working-dir` with
the job's command line, its log and outputs checked, then the cluster stopped."""
from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import shlex
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
from mist_core.data.demo import demo_corpus
from s3_server import free_ports
from test_docs import block, commands

pytestmark = pytest.mark.integration  # `ray start --head` and `ray job submit`

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
# Never uploaded with the job: the virtual environment alone is gigabytes.
EXCLUDES = [".venv", ".git", "outputs", "*.egg-info", "__pycache__", ".pytest_cache"]


def _wait_started(log: Path, proc: subprocess.Popen, timeout: float) -> None:
    """Until `ray start` says it started its node. Its dashboard may answer before that and
    then go down with it: under load the raylet can miss Ray's fixed 30 s to register."""
    deadline = time.monotonic() + timeout
    while b"Ray runtime started." not in log.read_bytes():
        if proc.poll() is not None:
            raise RuntimeError(f"ray start exited with {proc.returncode}:\n"
                               + log.read_text(errors="replace")[-2000:])
        if time.monotonic() > deadline:
            raise RuntimeError(f"ray start did not start its node in {timeout:.0f}s")
        time.sleep(0.5)


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


def _stop(proc: subprocess.Popen, temp: str) -> None:
    proc.send_signal(signal.SIGTERM)  # ray start --block then stops what it started
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # anything of its group still around
    except ProcessLookupError:
        pass
    shutil.rmtree(temp, ignore_errors=True)


def _start(tmp_path: Path, env: dict, command, attempt: int):
    temp = tempfile.mkdtemp(prefix="mistray-", dir="/tmp")  # short: Ray puts sockets in it
    log = tmp_path / f"ray-start-{attempt}.log"
    # Every port Ray would otherwise take at a fixed default (the job agent's is 52365) is a
    # free one, so that another Ray on this machine does not get in the way.
    names = ("port", "ray-client-server-port", "dashboard-agent-listen-port",
             "dashboard-agent-grpc-port", "runtime-env-agent-port", "metrics-export-port",
             "node-manager-port", "object-manager-port")
    dash, *numbers = free_ports(len(names) + 1)
    ports = [f"--{name}={n}" for name, n in zip(names, numbers)]
    with open(log, "wb") as sink:
        proc = subprocess.Popen(
            [str(BIN / command[0]), *command[1:], "--block", "--node-ip-address=127.0.0.1",
             *ports, "--num-cpus=2", "--include-dashboard=true", "--dashboard-host=127.0.0.1",
             f"--dashboard-port={dash}", "--disable-usage-stats", f"--temp-dir={temp}"],
            env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
    address = f"http://127.0.0.1:{dash}"
    try:
        _wait_started(log, proc, timeout=180)
        _wait_http(f"{address}/api/version", proc, timeout=120)
        deadline = time.monotonic() + 120
        while ray_cli("job", "list", "--address", address, timeout=60, env=env).returncode != 0:
            assert time.monotonic() < deadline, "the job API did not come up"
            time.sleep(1)
    except BaseException:
        _stop(proc, temp)
        raise
    return proc, SimpleNamespace(address=address, temp=temp, log=log)


@contextlib.contextmanager
def head(tmp_path: Path, env: dict, command=("ray", "start", "--head")):
    """A one-node Ray cluster of our own: `command` (`ray start --head`, as a test or the
    README gives it) with --block, in its own process group, so that stopping it ends
    exactly the processes it started, and with its own temp dir, so that no later
    `ray.init()` on this machine takes it for the current cluster. A start that Ray itself
    fails (its node not up in its fixed 30 s, on a loaded machine) is tried once more."""
    try:
        proc, cluster = _start(tmp_path, env, command, 1)
    except RuntimeError:
        proc, cluster = _start(tmp_path, env, command, 2)
    try:
        yield cluster
    finally:
        _stop(proc, cluster.temp)


def ray_logs(temp: str, names=("dashboard_agent.log", "raylet.out", "dashboard_JobHead.log")) -> str:
    """The ends of the cluster's own logs, to say why a submission failed."""
    out = []
    for name in names:
        for path in Path(temp).glob(f"session_*/logs/{name}"):
            out.append(f"--- {path.name}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-15:]))
    return "\n".join(out)


def ray_cli(*args: str, env: dict, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "ray"), *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def readme_cluster(tmp_path_factory, tokenizer):
    """The README's *Submitting on one machine* block up to its `ray start --head`, run as
    written, with what a test machine needs substituted: free ports and a temp dir for the
    head (and --block, so that the test stops exactly the head it started, in place of the
    README's `ray stop`, which would stop every Ray of this user) and the dashboard's port in
    the address. HOME is a folder of the test's own, so the token the block makes is not the
    user's. One head for the module's submissions: (cluster, env, the block's submit line,
    a tiny model)."""
    tmp = tmp_path_factory.mktemp("readme-head")
    as_written = commands(block("ray get-auth-token --generate"))
    words = [shlex.split(line) for line in as_written]
    kinds = [" ".join(w[:3] if w[:2] == ["ray", "job"] else w[:2] if w[0] == "ray" else w[:1])
             for w in words]
    assert kinds == ["export", "ray get-auth-token", "ray start", "ray job submit",
                     "ray stop"], kinds
    home = tmp / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(HOME=str(home), RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
               RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="5", NO_PROXY="127.0.0.1,localhost",
               no_proxy="127.0.0.1,localhost", PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}")
    name, _, value = words[0][1].partition("=")  # export NAME=VALUE
    env[name] = value
    made = subprocess.run(["bash", "-c", as_written[1]], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert made.returncode == 0 and (home / ".ray" / "auth_token").is_file(), made.stderr
    model = tmp / "tiny-llama"
    make_model("llama", len(tokenizer)).save_pretrained(model)
    tokenizer.save_pretrained(model)
    with head(tmp, env, words[2]) as cluster:
        yield SimpleNamespace(cluster=cluster, env=env, submit=as_written[3], model=model)


def test_one_machine_submission_as_the_readme_writes_it(readme_cluster, tmp_path):
    """The block's `ray job submit` as written (readme_cluster), with the output under the
    test's folder and the tiny model; then the same submission with a relative --output,
    which the job refuses."""
    r = readme_cluster
    cluster, env, submit = r.cluster, r.env, r.submit
    assert '"$PWD/outputs/submitted"' in submit and "--working-dir ." in submit
    out = tmp_path / "outputs" / "submitted"

    def run(output: str) -> subprocess.CompletedProcess:
        line = (submit.replace("http://127.0.0.1:8265", cluster.address)
                .replace('"$PWD/outputs/submitted"', output) + f" --model {r.model}")
        deadline = time.monotonic() + 240
        while True:  # the node's job agent may still be starting: Ray says so
            p = subprocess.run(["bash", "-c", line], cwd=REPO, env=env,
                               capture_output=True, text=True, timeout=600)
            if "please try again later" not in p.stdout + p.stderr \
                    or time.monotonic() > deadline:
                return p
            time.sleep(5)

    p = run(str(out))
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:] + ray_logs(cluster.temp)
    assert re.search(r"Job 'raysubmit_\w+' succeeded", p.stdout), p.stdout[-3000:]
    assert "MIST compression finished" in p.stdout
    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["output"] == str(out) and manifest["counts"]["scored"] == 24

    refused = run("outputs/submitted-relative")
    assert refused.returncode == 1, refused.stdout[-3000:] + refused.stderr[-3000:]
    assert "error: --output outputs/submitted-relative is a relative path, but this run " \
           "was started by `ray job submit`" in refused.stdout, refused.stdout[-3000:]
    assert re.search(r"Job 'raysubmit_\w+' failed", refused.stdout), refused.stdout[-3000:]


def test_ray_job_submit(readme_cluster, tmp_path):
    """A submission as a pipeline would make it: the checkout as --working-dir with the
    excludes, a submission id, a corpus with a bad row; the job's log, counts and rows."""
    cluster, env, model = readme_cluster.cluster, readme_cluster.env, readme_cluster.model
    corpus = tmp_path / "corpus.jsonl"
    records = demo_corpus(6, seed=5)
    corpus.write_text("".join(json.dumps(r) + "\n" for r in records) + "not json\n")
    out = tmp_path / "out"

    started = cluster.log.read_text()
    assert re.search(r"Local node IP\S*: \S*127\.0\.0\.1", started), started

    deadline = time.monotonic() + 240
    for attempt in itertools.count():  # the node's job agent may still be starting: Ray says so
        job_id = f"mist-test-{os.getpid()}-{attempt}"
        submit = ray_cli(
            "job", "submit", "--address", cluster.address, "--submission-id", job_id,
            "--working-dir", str(REPO), "--runtime-env-json", json.dumps({"excludes": EXCLUDES}),
            "--", "python", "-m", "pipelines.compress", "--input", str(corpus),
            "--model", str(model), "--output", str(out), "--budgets", "0.5,0.9",
            "--batch-size", "4", env=env)
        if "please try again later" not in submit.stdout + submit.stderr \
                or time.monotonic() > deadline:
            break
        time.sleep(5)
    assert submit.returncode == 0, submit.stdout + submit.stderr + ray_logs(cluster.temp)
    status = ray_cli("job", "status", "--address", cluster.address, job_id, timeout=60, env=env)
    logs = ray_cli("job", "logs", "--address", cluster.address, job_id, timeout=60, env=env).stdout
    assert f"Job '{job_id}' succeeded" in status.stdout, status.stdout + status.stderr + logs

    assert "plan: 7 rows read, 6 to score" in logs  # progress is in the job's log
    assert "[score]" not in logs  # the workers' own lines come only with --verbose
    assert "MIST compression finished" in logs and str(out) in logs
    assert "1 budgets" not in logs and "x 2 budgets (parquet)" in logs
    assert not (out / "scores").exists()  # made only with --scores

    manifest = json.loads((out / "_manifest.json").read_text())
    c = manifest["counts"]
    assert (c["read"], c["scored"], c["rejected"]) == (7, 6, 1)
    assert c["rejected_by_reason"] == {"invalid_json": 1}
    data = pq.read_table(out / "data")
    assert sorted(data.column("budget").to_pylist()) == [0.5] * 6 + [0.9] * 6
    assert set(data.column("id").to_pylist()) == {r["id"] for r in records}
    assert set(data.column("topic").to_pylist()) == {r["topic"] for r in records}
