"""Failures that are not the input's fault: a model that returns NaN fails its chains as
`nonfinite_scores` instead of passing them as flat scores, and the job's error budget
(--max-error-share, default 0) turns a run whose rows failed past it into exit status 5, one
line, no manifest, and a re-run that redoes those rows.

Everything runs in this process; the job tests (marked integration) run the job on the
tests' Ray (conftest.job_in_process), with faults injected through pipelines/common/faults.py,
and check the exit status and line through exits.classify."""
from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from conftest import committed, job_in_process, make_model, partial_files
from mist_core import InvalidExample, MistScorer, NonFiniteScores, get_scorer
from mist_core import reasons
from mist_core.data.formats import REJECT_SCHEMA
from mist_core.models import wrap_model
from mist_core.scoring.scorer import combine, zscore
from pipelines.job.compress import parse_args
from pipelines.common import exits
from pipelines.common.errors import ErrorBudgetExceeded
from pipelines.common.settings import ConfigError
from pipelines.job.output import Output
from pipelines.job.budget import ErrorBudget
from pipelines.job.sink import WriteStats
from test_faults import assert_exactly_once, command, corpus, output_rows


# ------------------------------------------------------------------ the library

@pytest.fixture(scope="module")
def nan_lm(tokenizer):
    """The tiny Llama with every weight NaN."""
    model = make_model("llama", len(tokenizer))
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    return wrap_model(model, tokenizer, "tiny-nan")


@pytest.mark.parametrize("method", ["mist", "necessity", "sufficiency", "perplexity", "gogi_l1",
                                    "h2o", "attention_rollout"])
def test_a_nan_model_fails_every_chain_as_nonfinite_scores(nan_lm, examples, method):
    scorer = get_scorer(method, nan_lm)
    encs = [scorer.encode(ex) for ex in examples]
    got = scorer.score_encoded(encs, errors="return")
    assert len(got) == len(examples)
    for ex, res in zip(examples, got):
        assert isinstance(res, NonFiniteScores) and isinstance(res, InvalidExample), res
        assert res.reason == "nonfinite_scores" and "NaN or inf" in res.detail
        assert res.example_id == ex.id
    with pytest.raises(NonFiniteScores, match="nonfinite_scores"):
        scorer.score(examples)


def test_mist_names_what_went_nonfinite(nan_lm, examples):
    [res] = MistScorer(nan_lm).score_encoded([MistScorer(nan_lm).encode(examples[0])],
                                             errors="return")
    assert res.detail.startswith("log p(answer | question, chain) is NaN or inf")


def test_one_nan_chain_fails_alone(tiny_lm, examples, monkeypatch):
    """A chain whose raw axis holds NaN fails; the chains of its batch keep their scores."""
    scorer = MistScorer(tiny_lm)
    encs = [scorer.encode(ex) for ex in examples]
    want = scorer.score_encoded(encs)
    real = torch.Tensor.abs
    poisoned = {"n": 0}

    def abs_(t):  # the first |per-layer| of the batch's second chain is NaN at one token
        out = real(t)
        if t.dim() == 2 and t.shape[1] == encs[1].chain_len and poisoned["n"] == 0:
            poisoned["n"] += 1
            out = out.clone()
            out[0, 0] = float("nan")
        return out

    monkeypatch.setattr(torch.Tensor, "abs", abs_)
    got = scorer.score_encoded(encs, errors="return")
    monkeypatch.undo()
    assert poisoned["n"] == 1
    bad = [i for i, g in enumerate(got) if isinstance(g, NonFiniteScores)]
    assert len(bad) == 1 and encs[bad[0]].chain_len == encs[1].chain_len
    assert "at 1 of" in got[bad[0]].detail
    for i, g in enumerate(got):
        if i not in bad:
            np.testing.assert_allclose(g.scores, want[i].scores, rtol=1e-6, atol=1e-9)


def test_normalisation_never_turns_nan_into_zeros():
    assert np.isnan(zscore(np.array([1.0, np.nan, 3.0]))).all()
    assert np.isnan(zscore(np.array([1.0, np.inf, 3.0]))).all()
    assert np.isnan(combine(np.array([1.0, np.nan]), np.array([1.0, 2.0]), 0.6)).all()
    assert (zscore(np.array([2.0, 2.0, 2.0])) == 0).all()  # a flat chain is still flat


# ------------------------------------------------------------------ the budget

def test_failure_reasons_are_the_jobs_not_the_inputs():
    assert {"score_error", "prune_error", "nonfinite_scores",
            "unexpected_error"} <= reasons.FAILURE_REASONS
    assert NonFiniteScores.REASON in reasons.FAILURE_REASONS
    for reason in ("invalid_json", "missing_column", "too_long", "duplicate_id", "empty_cot",
                   "too_long_for_memory", "unreadable_file", "no_final_answer"):
        assert reason not in reasons.FAILURE_REASONS


def stats(**reasons) -> WriteStats:
    s = WriteStats()
    s.reasons.update(reasons)
    s.rejected = sum(reasons.values())
    return s


def test_budget_counts_failures_only_against_the_share_of_rows():
    assert ErrorBudget(0.0, 12).allowed == 0
    assert ErrorBudget(0.25, 12).allowed == 3 and ErrorBudget(0.1, 10).allowed == 1
    assert ErrorBudget(1.0, 12).allowed == 12
    # input-quality rejects, however many, never trip it
    inputs = stats(invalid_json=5, too_long=3, duplicate_id=2, too_long_for_memory=2)
    assert inputs.failures == 0 and not ErrorBudget(0.0, 12).exceeded(inputs.failures)
    assert ErrorBudget(0.0, 12).exceeded(stats(invalid_json=5, score_error=1).failures)
    assert not ErrorBudget(0.25, 12).exceeded(stats(score_error=2, nonfinite_scores=1).failures)
    assert ErrorBudget(0.25, 12).exceeded(
        stats(score_error=2, nonfinite_scores=1, prune_error=1).failures)
    assert not ErrorBudget(1.0, 12).exceeded(stats(score_error=12).failures)


def test_budget_message_is_one_line_with_counts_share_and_first_error():
    first = {"reason": "score_error", "detail": "RuntimeError: boom\n  at line 2",
             "source": "file:///c.jsonl", "row": 4, "id": "r3"}
    msg = ErrorBudget(0.1, 12).message(5, first)
    assert "\n" not in msg
    assert msg.startswith("5 of 12 rows failed, more than --max-error-share 0.1 allows (1)")
    assert "first: score_error: RuntimeError: boom at line 2 (file:///c.jsonl row 4, id r3)" in msg
    assert "no manifest" in msg and "rerun" in msg
    assert ErrorBudget(0.1, 12).message(5, first, seen=12) == msg  # it got to the end
    early = ErrorBudget(0.0, 12).message(1, None, seen=4)
    assert early.startswith("1 of 12 rows failed (the run stopped after 4), more than")


def test_max_error_share_setting(tmp_path):
    assert parse_args([]).max_error_share == 0.0
    assert parse_args(["--max-error-share", "0.25"]).max_error_share == 0.25
    yaml_file = tmp_path / "job.yaml"
    yaml_file.write_text("max-error-share: 0.5\n")
    assert parse_args(["--config", str(yaml_file)]).max_error_share == 0.5
    yaml_file.write_text("max_error_share: 1\n")
    assert parse_args(["--config", str(yaml_file)]).max_error_share == 1.0
    for bad in ("1.5", "-0.1", "nan"):
        with pytest.raises(ConfigError, match="max_error_share"):
            parse_args(["--max-error-share", bad])
    yaml_file.write_text("max_error_share: lots\n")
    with pytest.raises(ConfigError, match="max_error_share"):
        parse_args(["--config", str(yaml_file)])


def write_rejects(out: Path, name: str, rows: list[dict]) -> None:
    (out / "rejects").mkdir(parents=True, exist_ok=True)
    full = [{"source": "file:///c.jsonl", "id": None, "detail": "d", "run_id": "r"} | r
            for r in rows]
    pq.write_table(pa.Table.from_pylist(full, schema=REJECT_SCHEMA), out / "rejects" / name)


def test_failed_rejects_are_not_final(tmp_path):
    """A re-run drops the rejects of rows that failed (they are redone), and keeps those of
    bad input, file by file."""
    out = tmp_path / "out"
    write_rejects(out, "a.parquet", [{"row": 1, "reason": "invalid_json", "raw": "{"},
                                     {"row": 2, "reason": "score_error", "raw": "x2"}])
    write_rejects(out, "b.parquet", [{"row": 3, "reason": "nonfinite_scores", "raw": "x3"}])
    write_rejects(out, "c.parquet", [{"row": 4, "reason": "too_long", "raw": "x4"}])
    o = Output(str(out))
    existing = o.load()
    assert existing.reject_rows == 4
    assert existing.reject_reasons == Counter(invalid_json=1, score_error=1, nonfinite_scores=1,
                                              too_long=1)
    dropped = o.drop_failed_rejects(reasons.FAILURE_REASONS)
    assert len(dropped) == 2 and dropped <= existing.rejects
    assert sorted(p.name for p in (out / "rejects").iterdir()) == ["a.parquet", "c.parquet"]
    assert pq.read_table(out / "rejects" / "a.parquet").column("reason").to_pylist() == \
        ["invalid_json"]
    write_rejects(out, "d.parquet", [{"row": 1, "reason": "score_error", "raw": "o1",
                                      "source": "file:///other.jsonl"}])
    assert not o.drop_failed_rejects(reasons.FAILURE_REASONS,
                                     lambda source, row: source == "file:///c.jsonl")
    (out / "rejects" / "d.parquet").unlink()  # a row this run reads again: dropped
    again = o.load()
    assert again.reject_rows == 2 and not set(again.reject_reasons) & reasons.FAILURE_REASONS
    assert again.rejects == existing.rejects - dropped
    assert not o.drop_failed_rejects(reasons.FAILURE_REASONS)


# ------------------------------------------------------------------ the job

INPUT_REJECTS = Counter(invalid_json=1, missing_column=1, duplicate_id=1)


def job_corpus(path: Path) -> list[str]:
    """10 good rows (r0..r9) and 3 bad ones: 13 rows read, 3 input-quality rejects."""
    ids = corpus(path, 10)
    first = json.loads(path.read_text().splitlines()[0])
    with path.open("a") as f:
        f.write('{"question": "broken\n')
        f.write(json.dumps({"question": "q", "answer": "1"}) + "\n")
        f.write(json.dumps(first) + "\n")  # r0 again
    return ids


def rejects_by_reason(out: Path) -> Counter:
    return Counter(r for f in committed(out / "rejects")
                   for r in pq.read_table(f).column("reason").to_pylist())


@pytest.mark.integration
def test_every_row_failing_stops_early_exits_5_and_a_rerun_redoes_them(local_ray, model_dir,
                                                                       tmp_path, monkeypatch):
    """The scorer raises on every call: the first file group to commit spends the budget
    (0 by default), the run stops there with exit status 5, one line and no manifest. The
    same command without the fault redoes the failed rows and the rest, with only the bad
    input left in rejects/, and exits 0 (input-quality rejects never count). In this
    process: exits.classify gives the status and line the command prints (the console's
    one `error:` line is checked on the Ctrl-C and storage-outage runs)."""
    ids = job_corpus(tmp_path / "corpus.jsonl")
    out = tmp_path / "out"
    # calls of 8 rows; each call takes 3 s more, so the second is still running when the
    # first call's group commits and stops the run
    cmd = command(tmp_path / "corpus.jsonl", out, model_dir, "--batch-size", "1",
                  "--rows-per-file", "2")
    monkeypatch.setenv("MIST_FAULT_SCORE_ERROR", ".*")
    monkeypatch.setenv("MIST_FAULT_SLEEP_S", "3")
    with pytest.raises(ErrorBudgetExceeded) as stopped:
        job_in_process(cmd)
    status, message = exits.classify(stopped.value)
    assert status == 5 and "\n" not in message, message
    m = re.fullmatch(
        r"(\d+) of 13 rows failed \(the run stopped after (\d+)\), more than "
        r"--max-error-share 0 allows \(0\); first: score_error: RuntimeError: injected scoring "
        r"failure \(MIST_FAULT_SCORE_ERROR\) on (r\d) \(\S+/corpus\.jsonl row \d+, id \3\); "
        r"the run wrote no manifest: fix the cause and rerun the same command, which redoes "
        r"the failed rows", message)
    assert m, message
    assert 0 < int(m[1]) <= int(m[2]) < 13
    assert not (out / "_manifest.json").exists()
    assert not partial_files(out), partial_files(out)  # rejects/*.parquet reads as it is
    failed = rejects_by_reason(out)
    assert failed["score_error"] == int(m[1]) and set(failed) <= {"score_error", *INPUT_REJECTS}

    monkeypatch.delenv("MIST_FAULT_SCORE_ERROR")
    monkeypatch.delenv("MIST_FAULT_SLEEP_S")
    manifest = job_in_process(cmd)  # fixed: the same command again
    assert manifest == json.loads((out / "_manifest.json").read_text())
    c = manifest["counts"]
    assert (c["read"], c["scored"], c["rejected"], c["already_done"]) == (13, 10, 3, 0)
    assert c["rejected_by_reason"] == dict(INPUT_REJECTS)
    assert rejects_by_reason(out) == INPUT_REJECTS  # the failures' rejects are gone
    assert manifest["totals"]["rejects"] == 3
    assert_exactly_once(out, ids)


@pytest.fixture(scope="module")
def nan_model_dir(model_dir, tmp_path_factory):
    """The tiny test model with every weight NaN (its tokenizer loads as before)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tmp_path_factory.mktemp("nan-model") / "tiny-nan"
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(path)
    return path


@pytest.mark.integration
def test_a_nan_model_fails_the_run_instead_of_writing_garbage(local_ray, nan_model_dir, tmp_path):
    job_corpus(tmp_path / "corpus.jsonl")
    out = tmp_path / "out"
    with pytest.raises(ErrorBudgetExceeded) as stopped:
        job_in_process(command(tmp_path / "corpus.jsonl", out, nan_model_dir))
    status, message = exits.classify(stopped.value)  # what the command prints, and exits with
    assert status == 5
    line = f"error: {message}"
    assert line.startswith("error: 10 of 13 rows failed, more than --max-error-share 0 "
                           "allows (0); first: nonfinite_scores: "), line
    assert "is NaN or inf" in line and "wrote no manifest" in line
    assert not (out / "_manifest.json").exists()
    assert rejects_by_reason(out) == INPUT_REJECTS + Counter(nonfinite_scores=10)
    assert not list((out / "data").glob("*.parquet"))  # nothing passed as scored


@pytest.mark.integration
def test_failures_within_the_share_complete_the_run(local_ray, model_dir, tmp_path,
                                                     monkeypatch):
    """3 of 13 rows fail (0.23) under --max-error-share 0.3: the run completes, exit 0,
    with the failures as rejects and in the manifest's counts."""
    ids = job_corpus(tmp_path / "corpus.jsonl")
    out = tmp_path / "out"
    monkeypatch.setenv("MIST_FAULT_SCORE_ERROR", "r[0-2]")
    manifest = job_in_process(command(tmp_path / "corpus.jsonl", out, model_dir,
                                      "--max-error-share", "0.3"))
    assert manifest == json.loads((out / "_manifest.json").read_text())
    c = manifest["counts"]
    assert (c["read"], c["scored"], c["rejected"]) == (13, 7, 6)
    assert c["rejected_by_reason"] == dict(INPUT_REJECTS + Counter(score_error=3))
    assert manifest["config"]["max_error_share"] == 0.3
    data, _ = output_rows(out)
    assert {i for i, _ in data} == set(ids) - {"r0", "r1", "r2"}
