"""One writer per output, and the job's edges around it (issue 30): two runs started onto one
output (one finishes with a true manifest, the other refuses at once and writes nothing),
the lease itself (local lock and S3 conditional puts: a dead or lapsed holder taken over,
of many takers only one), Ctrl-C (one line, exit status 130, the rerun resumes), an S3
endpoint with credentials in its URL, an output bucket that does not exist, and the commit
group that --rows-per-file sets."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from mist_core.data.demo import demo_corpus
from pipelines.job import compress
from pipelines.common.errors import AccountingError, OutputBusy
from pipelines.job import lease
from pipelines.job.output import Output
from conftest import committed, job_in_process, partial_files
from s3_server import environ_patch, keys, moto_s3, s3_client, s3_env

REPO = Path(__file__).resolve().parents[1]
BUDGETS = (0.5, 0.8)


def corpus(path: Path, n: int) -> list[str]:
    rows = demo_corpus(n, seed=5)
    for i, r in enumerate(rows):
        r["id"] = f"w{i}"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return [r["id"] for r in rows]


def command(inp, out, model, *extra) -> list[str]:
    return [sys.executable, "-m", "pipelines.compress", "--input", str(inp), "--output", str(out),
            "--model", str(model), "--budgets", ",".join(map(str, BUDGETS)), "--unit", "token",
            "--progress-interval", "0", *extra]


def job_env(**more) -> dict:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "MIST_FAULT"))}
    e.update({"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "PYTHONUNBUFFERED": "1"}, **more)
    return e


def start(cmd, log: Path, **env) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=REPO, env=job_env(**env), stdout=open(log, "w"),
                            stderr=subprocess.STDOUT, start_new_session=True, text=True)


def pairs(tables) -> Counter:
    return Counter(p for t in tables for p in zip(t.column("id").to_pylist(),
                                                  t.column("budget").to_pylist()))


def two_at_once(cmd, tmp_path, **env) -> tuple[list[int], list[str], float]:
    """Start the same command twice together; (exit statuses, logs, seconds the first one
    to end took)."""
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    t = time.monotonic()
    procs = [start(cmd, log, **env) for log in logs]
    first = None
    while any(p.poll() is None for p in procs):
        if first is None and any(p.poll() is not None for p in procs):
            first = time.monotonic() - t
        assert time.monotonic() - t < 300, "the runs did not end"
        time.sleep(0.2)
    return [p.returncode for p in procs], [log.read_text() for log in logs], first or 0.0


def assert_one_refused(codes, logs, first_s, display: str) -> str:
    """One run exited 0, the other 2 with one line naming the holder; returns the winner's log."""
    assert sorted(codes) == [0, 2], "\n----\n".join(log[-3000:] for log in logs)
    won, lost = (logs[0], logs[1]) if codes[0] == 0 else (logs[1], logs[0])
    errors = [ln for ln in lost.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in lost, lost
    assert errors[0].startswith(f"error: {display} is being written by run ")
    assert "pid " in errors[0] and "wait for it to finish" in errors[0]
    assert first_s < 60, f"the refusal took {first_s:.0f}s"  # it starts no Ray
    return won


# ------------------------------------------------------------------ concurrent runs


@pytest.mark.integration
def test_two_runs_onto_one_local_output_one_refuses_and_rows_are_written_once(model_dir, tmp_path):
    ids = corpus(tmp_path / "g8.jsonl", 8)
    out = tmp_path / "out" / "conc"
    codes, logs, first_s = two_at_once(command(tmp_path / "g8.jsonl", out, model_dir,
                                               "--rows-per-file", "2"), tmp_path)
    assert_one_refused(codes, logs, first_s, str(out))
    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["totals"]["rows_per_budget"] == {"0.5": 8, "0.8": 8}
    assert manifest["totals"]["duplicate_rows"] == 0 and manifest["counts"]["scored"] == 8
    data = [pq.read_table(f, columns=["id", "budget"]) for f in committed(out / "data")]
    assert pairs(data) == Counter((i, b) for i in ids for b in BUDGETS)
    sft = [(r["id"], r["budget"]) for f in (out / "sft").glob("*.jsonl")
           for r in map(json.loads, f.read_text().splitlines())]
    assert Counter(sft) == Counter((i, b) for i in ids for b in BUDGETS + (1.0,))
    # --rows-per-file 2: every commit group holds two input rows (issue 30, case 8)
    assert sorted(len(set(t.column("id").to_pylist())) for t in data) == [2, 2, 2, 2]
    assert not (out / lease.LEASE).exists()  # given back


@pytest.fixture(scope="module")
def s3():
    with moto_s3() as url:
        with environ_patch(s3_env(url)):
            client = s3_client(url)
            client.create_bucket(Bucket="writers")
            yield client


@pytest.mark.integration
def test_two_runs_onto_one_s3_output_one_refuses_and_rows_are_written_once(s3, model_dir, tmp_path):
    ids = corpus(tmp_path / "g8.jsonl", 8)
    out = "s3://writers/conc"
    codes, logs, first_s = two_at_once(command(tmp_path / "g8.jsonl", out, model_dir), tmp_path)
    assert_one_refused(codes, logs, first_s, out)
    manifest = json.loads(s3.get_object(Bucket="writers", Key="conc/_manifest.json")["Body"].read())
    assert manifest["totals"]["rows_per_budget"] == {"0.5": 8, "0.8": 8}
    import io
    data = [pq.read_table(io.BytesIO(s3.get_object(Bucket="writers", Key=k)["Body"].read()),
                          columns=["id", "budget"])
            for k in keys(s3, "writers", "conc/data/") if k.endswith(".parquet") and "/_" not in k]
    assert pairs(data) == Counter((i, b) for i in ids for b in BUDGETS)
    assert "conc/" + lease.LEASE not in keys(s3, "writers", "conc/")


# ------------------------------------------------------------------ the lease itself


def test_local_lease_refuses_a_second_holder_until_given_back(tmp_path):
    out = Output(str(tmp_path / "out"))
    first = lease.acquire(out, "run-a")
    with pytest.raises(OutputBusy, match=r"is being written by run run-a \(pid \d+ on "):
        lease.acquire(out, "run-b")
    first.release()
    lease.acquire(out, "run-b").release()
    assert not (tmp_path / "out" / lease.LEASE).exists()


@pytest.mark.integration  # a subprocess
def test_local_lease_of_a_killed_run_is_free(tmp_path):
    out = tmp_path / "out"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pipelines.job import lease; "
         "from pipelines.job.output import Output; lease.acquire(Output(sys.argv[1]), 'dead'); "
         "print('held', flush=True); time.sleep(600)", str(out)],
        cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(OutputBusy, match="run dead"):
            lease.acquire(Output(str(out)), "next")
    finally:
        holder.kill()
        holder.wait()
    assert (out / lease.LEASE).exists()  # a killed run leaves its file, not its lock
    lease.acquire(Output(str(out)), "next").release()


def s3_record(s3, key: str, **fields) -> None:
    rec = {"run_id": "old", "host": "elsewhere", "pid": 1, "started_at": "2026-01-01T00:00:00",
           "ttl_s": 300} | fields
    s3.put_object(Bucket="writers", Key=key, Body=json.dumps(rec).encode())


@pytest.mark.integration
def test_s3_lease_refuses_a_live_holder_and_takes_over_a_dead_or_lapsed_one(s3):
    out = Output("s3://writers/primitive")
    key = "primitive/" + lease.LEASE
    held = lease.acquire(out, "run-a")
    with pytest.raises(OutputBusy, match=r"by run run-a .*delete s3://writers/primitive/"
                                         r"_lease\.json and rerun"):
        lease.acquire(out, "run-b")
    held.check()
    held.release()
    assert key not in keys(s3, "writers", "primitive/")

    s3_record(s3, key)  # another host's live run
    with pytest.raises(OutputBusy, match="run old"):
        lease.acquire(out, "run-c")
    s3_record(s3, key, ttl_s=0)  # ... that stopped renewing its lease
    lease.acquire(out, "run-c").release()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    s3_record(s3, key, host=__import__("socket").gethostname(), pid=int(dead))
    lease.acquire(out, "run-d").release()  # a process of this host that is gone


@pytest.mark.integration
def test_s3_lease_of_many_takers_only_one_wins_and_a_lost_lease_writes_no_manifest(s3):
    out = Output("s3://writers/race")
    won, refused = [], []

    def take(n: int) -> None:
        try:
            won.append(lease.acquire(Output("s3://writers/race"), f"run-{n}"))
        except OutputBusy:
            refused.append(n)

    threads = [threading.Thread(target=take, args=(n,)) for n in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert (len(won), len(refused)) == (1, 5)
    # taken over behind the holder's back (as after its lease lapsed): its check fails
    s3_record(s3, "race/" + lease.LEASE, run_id="thief", ttl_s=0)
    lease.acquire(out, "run-x")
    with pytest.raises(AccountingError, match="held by run run-x"):
        won[0].check()
    won[0].release()
    assert "race/" + lease.LEASE in keys(s3, "writers", "race/")  # not the loser's to delete


# ------------------------------------------------------------------ bad settings, Ctrl-C


def one_error_line(capsys) -> str:
    out, err = capsys.readouterr()
    lines = [ln for ln in (out + err).splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in out + err, out + err
    return lines[0]


def test_endpoint_with_credentials_is_a_setting_error_that_does_not_echo_them(
        model_dir, tmp_path, capsys, monkeypatch):
    corpus(tmp_path / "in.jsonl", 2)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://mistuser:hunter2pw@127.0.0.1:9")
    monkeypatch.setenv("MIST_STORAGE_RETRY_S", "1")
    rc = compress.main(["--input", str(tmp_path / "in.jsonl"), "--output", "s3://bkt/out",
                        "--model", str(model_dir)])
    line = one_error_line(capsys)
    assert rc == 2 and "AWS_ENDPOINT_URL holds a user name or password" in line
    assert "mistuser" not in line and "hunter2pw" not in line


@pytest.mark.integration
def test_missing_output_bucket_fails_before_scoring(s3, model_dir, tmp_path, capsys):
    corpus(tmp_path / "in.jsonl", 2)
    t = time.monotonic()
    rc = compress.main(["--input", str(tmp_path / "in.jsonl"), "--output", "s3://no-such-bkt/out",
                        "--model", str(model_dir)])
    assert rc == 2 and time.monotonic() - t < 30
    assert one_error_line(capsys) == ("error: the output bucket no-such-bkt does not exist: "
                                      "create it or choose another --output")


def test_output_that_is_a_file_fails_before_scoring(model_dir, tmp_path, capsys):
    corpus(tmp_path / "in.jsonl", 2)
    (tmp_path / "taken").write_text("someone's file\n")
    t = time.monotonic()
    rc = compress.main(["--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "taken"),
                        "--model", str(model_dir)])
    assert rc == 2 and time.monotonic() - t < 30
    assert one_error_line(capsys).startswith(f"error: --output {tmp_path / 'taken'} is a file")
    assert (tmp_path / "taken").read_text() == "someone's file\n"


@pytest.mark.integration
def test_ctrl_c_is_one_line_and_exit_130_and_the_rerun_resumes(local_ray, model_dir, tmp_path):
    ids = corpus(tmp_path / "in.jsonl", 48)
    out = tmp_path / "out"
    cmd = command(tmp_path / "in.jsonl", out, model_dir, "--batch-size", "1",
                  "--rows-per-file", "2")
    # Six scoring calls of 8 rows, 2 s each, whose rows are written as each call ends: the
    # first files land one call into scoring, with five calls left for the Ctrl-C to land
    # in (before each call was its own block, they all landed at the end, and the run
    # finished first on an idle machine).
    proc = start(cmd, tmp_path / "first.log", MIST_FAULT_SLEEP_S="2")
    deadline = time.monotonic() + 180
    while not committed(out / "data"):  # a file written, not one being written
        assert proc.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
        assert time.monotonic() < deadline, "no output after 180 s"
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C sends: the whole group
    assert proc.wait(60) == 130, (tmp_path / "first.log").read_text()[-3000:]
    log = (tmp_path / "first.log").read_text()
    assert "Traceback" not in log and "KeyboardInterrupt" not in log, log[-3000:]
    errors = [ln for ln in log.splitlines() if ln.startswith("error:")]
    assert errors == ["error: " + compress.INTERRUPTED], log[-3000:]
    assert not (out / "_manifest.json").exists() and not (out / lease.LEASE).exists()
    assert not partial_files(out), partial_files(out)  # every folder reads as it is

    job_in_process(cmd)  # the same command again, in this process: it resumes
    c = json.loads((out / "_manifest.json").read_text())["counts"]
    assert c["already_done"] > 0 and c["scored"] + c["already_done"] == 48
    data = [pq.read_table(f, columns=["id", "budget"]) for f in committed(out / "data")]
    assert pairs(data) == Counter((i, b) for i in ids for b in BUDGETS)


@pytest.mark.parametrize("ray_was", ["started", "joined", "started, lease lost"])
def test_a_stopped_run_on_its_own_ray_leaves_no_partial_files(ray_was, model_dir, tmp_path,
                                                                monkeypatch, caplog):
    """On the way out of a stopped run (Ctrl-C here) that started its own Ray, Ray stops
    first (no write task is left to finish a group), then the partial files go, while the
    lease is held; committed groups stay. On a Ray it joined (a cluster, whose write tasks may
    still be running), or once its lease is lost (the files may be another run's), nothing
    is touched: the rerun cleans."""
    from pipelines.common.errors import AccountingError
    from pipelines.common.settings import validate
    from pipelines.job.config import JobConfig

    corpus(tmp_path / "in.jsonl", 2)
    out = tmp_path / "out"
    seen = []

    def stopped_run(r, held):
        r.own_ray = ray_was != "joined"
        if ray_was == "started, lease lost":
            def lost():
                raise AccountingError("the lease is held by another run")
            held.check = lost
        for d in ("data", "sft", "scores", "rejects"):
            (out / d).mkdir(parents=True)
        pq.write_table(pa.table({"id": ["w0"]}), out / "data" / "g1.parquet")
        (out / "sft" / "g1.jsonl").write_text("{}\n")
        (out / "sft" / "g2.jsonl").write_text("{}\n")  # its data/ file never came
        (out / "scores" / "g2.parquet").write_bytes(b"PAR1")
        (out / "rejects" / "_tmp-g3.parquet").write_bytes(b"")  # a write cut short
        raise KeyboardInterrupt

    monkeypatch.setattr(compress, "_run", stopped_run)
    monkeypatch.setattr(compress.ray, "shutdown",
                        lambda: seen.append((partial_files(out), (out / lease.LEASE).exists())))
    cfg = validate(JobConfig(input=[str(tmp_path / "in.jsonl")], output=str(out),
                             model=str(model_dir)))
    with pytest.raises(KeyboardInterrupt):
        compress.run(cfg)
    left = ["rejects/_tmp-g3.parquet", "scores/g2.parquet", "sft/g2.jsonl"]
    if ray_was == "started":
        assert seen == [(left, True)]  # Ray stopped before anything was deleted, lease held
        assert partial_files(out) == []
    elif ray_was == "joined":
        assert seen == [] and partial_files(out) == left
    else:
        assert seen == [(left, True)] and partial_files(out) == left
        assert "partial files stay until the rerun: the lease is held by another run" in caplog.text
    assert (out / "data" / "g1.parquet").exists() and (out / "sft" / "g1.jsonl").exists()
    assert not (out / lease.LEASE).exists()


# ------------------------------------------------------------------ commit groups


def test_rows_per_file_is_the_commit_group_whatever_block_ray_hands_the_writer(tmp_path):
    """Ray Data gives a write task whole blocks (12 rows here) even with min_rows_per_write
    2: the sink cuts them into groups of --rows-per-file rows, each committed by its own
    data/ file (issue 30, case 8)."""
    from pipelines.job.sink import OutputSink
    from pipelines.job.stages import OK, STREAM_SCHEMA
    from pipelines.job.config import JobConfig
    from pipelines.common.settings import validate

    cfg = validate(JobConfig(input=["x.jsonl"], output=str(tmp_path), budgets=[0.5],
                             rows_per_file=2))
    rows = [dict(input=0, source="x.jsonl", row=n, status=OK, id=f"i{n}", question="q",
                 cot="a b c d", answer="1", extra=None, source_ids=[1, 2, 3, 4], chain_start=0,
                 chain_len=4, n_tokens=4, score_s=0.1, compressed=["a b"], kept_tokens=[2],
                 tokens=["a", "b", "c", "d"]) for n in range(12, 0, -1)]
    block = pa.Table.from_pylist(rows, schema=STREAM_SCHEMA)
    sink = OutputSink(cfg, fs=pafs.LocalFileSystem(), root=str(tmp_path), run_id="r", model="m",
                      extras=pa.schema([]), known_rejects=frozenset())
    sink.on_write_start()
    stats = sink.write([block], None)
    assert (stats.rows, stats.scored, stats.files) == (12, 12, 12)  # 6 groups: data/ and sft/
    groups = sorted(sorted(pq.read_table(f).column("id").to_pylist())
                    for f in (tmp_path / "data").glob("*.parquet"))
    assert groups == sorted(sorted([f"i{n}", f"i{n + 1}"]) for n in range(1, 13, 2))
    again = sink.write([block.slice(6), block.slice(0, 6)], None)  # a retried task, other blocks
    assert again.files == 12 and len(list((tmp_path / "data").glob("*.parquet"))) == 6


@pytest.mark.integration
def test_s3_lease_is_renewed_while_held_and_a_renewal_refused_marks_it_lost(s3, monkeypatch):
    monkeypatch.setenv(lease.TTL_ENV, "0.4")  # renewed every 0.1 s
    held = lease.acquire(Output("s3://writers/renew"), "run-r")
    try:
        first = held.version
        deadline = time.monotonic() + 10
        while held.version == first:
            assert time.monotonic() < deadline, "never renewed"
            time.sleep(0.05)
        s3_record(s3, "renew/" + lease.LEASE, run_id="thief")  # its If-Match now fails
        while held.lost is None:
            assert time.monotonic() < deadline, "the lost lease went unnoticed"
            time.sleep(0.05)
        with pytest.raises(AccountingError, match="another run took over"):
            held.check()
    finally:
        held.release()


def test_duplicated_rows_name_their_remedy():
    """An output that two runs wrote at once before the lease fails every later run (exit
    status 3): the message says how to rebuild it."""
    from collections import Counter as C

    from pipelines.job.compress import Plan, reconcile
    from pipelines.job.output import Existing
    from pipelines.job.sink import WriteStats
    from pipelines.job.config import JobConfig
    from pipelines.common.settings import validate

    cfg = validate(JobConfig(input=["x.jsonl"], output="out", budgets=[0.5]))
    plan = Plan(read=0, examples=0, invalid=0, done=0, duplicates=0, to_score=0,
                row_limits=None, dup_rows=frozenset(), extras=pa.schema([]), seconds=0.0)
    existing = Existing(per_budget=C({"0.5": 16}), sft=16)
    totals = {"rows_per_budget": {"0.5": 16}, "duplicate_rows": 8, "sft_records": 16,
              "rejects": 0}
    with pytest.raises(AccountingError, match="rebuild it with --mode overwrite"):
        reconcile(cfg, plan, WriteStats(), existing, totals)


def test_lease_without_conditional_writes_refuses_a_second_holder(tmp_path, monkeypatch):
    """gs:// has no conditional put through pyarrow: the lease is checked, written and read
    back (here through the same code on a local filesystem)."""
    monkeypatch.setattr(lease, "_local", lambda out: False)
    out = Output(str(tmp_path / "out"))
    held = lease.acquire(out, "run-g")
    try:
        with pytest.raises(OutputBusy, match=r"by run run-g .*delete .*_lease\.json and rerun"):
            lease.acquire(out, "run-h")
        held.check()
    finally:
        held.release()
    assert not (tmp_path / "out" / lease.LEASE).exists()
