"""Faults injected into real runs of the job: a scoring actor that dies mid-batch, a model
that cannot load, and a driver killed part-way (a subprocess with its own local Ray) and then
re-run. Every input row must end up exactly once. What needs no process of its own runs in
this one, on the tests' Ray (conftest.job_in_process)."""
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

import psutil
import pyarrow.parquet as pq
import pytest

from conftest import committed, job_in_process
from mist_core.data.demo import demo_corpus

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[1]
BUDGETS = "0.5,0.8"


def corpus(path: Path, n: int) -> list[str]:
    rows = demo_corpus(n, seed=11)
    for i, r in enumerate(rows):
        r["id"] = f"r{i}"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return [r["id"] for r in rows]


def command(corpus_path, out, model, *extra) -> list[str]:
    return [sys.executable, "-m", "pipelines.compress", "--input", str(corpus_path),
            "--output", str(out), "--model", str(model), "--budgets", BUDGETS, "--unit", "token",
            *extra]


def env(**faults) -> dict:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "MIST_FAULT"))}
    e.update({"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "PYTHONUNBUFFERED": "1"}, **faults)
    return e


def output_rows(out: Path) -> tuple[Counter, Counter]:
    """(id, budget) -> count in data/ and in sft/."""
    data = Counter()
    for f in committed(out / "data"):
        t = pq.read_table(f, columns=["id", "budget"])
        data.update(zip(t.column("id").to_pylist(), t.column("budget").to_pylist()))
    sft = Counter((r["id"], r["budget"]) for f in (out / "sft").glob("*.jsonl")
                  for r in (json.loads(x) for x in f.read_text().splitlines() if x.strip()))
    return data, sft


def assert_exactly_once(out: Path, ids: list[str]) -> None:
    data, sft = output_rows(out)
    assert data == Counter({(i, b): 1 for i in ids for b in (0.5, 0.8)})
    assert sft == Counter({(i, b): 1 for i in ids for b in (0.5, 0.8, 1.0)})  # sft_mix "all"


def test_scoring_actor_dying_mid_batch_is_replaced(local_ray, model_dir, tmp_path, monkeypatch):
    ids = corpus(tmp_path / "corpus.jsonl", 48)
    out, marker = tmp_path / "out", tmp_path / "fault-fired"
    monkeypatch.setenv("MIST_FAULT_EXIT_BATCH", "2")
    monkeypatch.setenv("MIST_FAULT_ONCE", str(marker))
    manifest = job_in_process(command(tmp_path / "corpus.jsonl", out, model_dir, "--batch-size", "2"))
    assert marker.exists(), "the fault never fired: the test proves nothing"
    assert manifest == json.loads((out / "_manifest.json").read_text())
    c = manifest["counts"]
    assert (c["read"], c["scored"], c["rejected"]) == (48, 48, 0)
    assert_exactly_once(out, ids)


def test_a_model_that_cannot_load_fails_once_and_clearly(local_ray, model_dir, tmp_path):
    from pipelines.common import exits

    broken = tmp_path / "broken-model"
    broken.mkdir()
    for f in model_dir.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    (broken / "model.safetensors").write_bytes(b"\x00" * 64)  # the tokenizer still loads
    corpus(tmp_path / "corpus.jsonl", 8)
    raised = []

    def job():
        try:
            job_in_process(command(tmp_path / "corpus.jsonl", tmp_path / "out", broken))
        except Exception as e:  # noqa: BLE001
            raised.append(e)

    # A restart loop would never end: the time limit is the check (no timing is asserted,
    # the machine may be busy).
    running = threading.Thread(target=job, daemon=True)
    running.start()
    running.join(300)
    assert not running.is_alive(), "the run did not stop: a restart loop?"
    assert raised, "the run did not fail"
    status, line = exits.classify(raised[0])  # what the command prints, and exits with
    assert status == 2 and "\n" not in line, line
    assert line.startswith("a scoring actor could not load --model") and "broken-model" in line
    assert not (tmp_path / "out" / "_manifest.json").exists()


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the driver and everything it started (its local Ray), as a lost node would."""
    family = psutil.Process(proc.pid).children(recursive=True)
    os.killpg(proc.pid, signal.SIGKILL)
    for p in family:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait(30)


def test_killed_driver_then_rerun_finishes_without_loss_or_duplicates(local_ray, model_dir, tmp_path):
    ids = corpus(tmp_path / "corpus.jsonl", 160)
    out = tmp_path / "out"
    cmd = command(tmp_path / "corpus.jsonl", out, model_dir, "--batch-size", "2",
                  "--rows-per-file", "16", "--scores")
    log = open(tmp_path / "first.log", "w")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env(MIST_FAULT_SLEEP_S="0.4"), stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while len(committed(out / "data")) < 2:
            assert proc.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "no output after 180 s"
            time.sleep(0.2)
    finally:
        kill_tree(proc)
        log.close()
    assert not (out / "_manifest.json").exists()
    done_before, _ = output_rows(out)
    assert 0 < len({i for i, _ in done_before}) < len(ids)

    job_in_process(cmd)  # the same command: refresh is the default mode
    manifest = json.loads((out / "_manifest.json").read_text())
    c = manifest["counts"]
    assert c["read"] == 160 and c["rejected"] == 0
    assert c["already_done"] == len({i for i, _ in done_before}) and c["scored"] == 160 - c["already_done"]
    assert manifest["runs"][0]["run_id"] is None  # the killed run, noted
    assert_exactly_once(out, ids)
    scores = Counter(i for f in (out / "scores").glob("*.parquet")
                     for i in pq.read_table(f, columns=["id"]).column("id").to_pylist())
    assert scores == Counter({i: 1 for i in ids})
    assert not [f for f in out.rglob("_tmp-*")]
