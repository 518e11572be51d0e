"""The one error policy of every entry point (pipelines/common/exits.py): the exit status of each
kind of error, one `error:` line, and a bug's traceback kept."""
from pathlib import Path

import pytest

from mist_core.errors import MissingDependency, UnsupportedModel
from pipelines.common import exits
from pipelines.evaluation import evaluate, saliency
from pipelines.common.errors import AccountingError, ConfigError, ErrorBudgetExceeded, ModelLoadError
from pipelines.common.exits import classify, run_main

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("error, status", [
    (ConfigError("bad --budgets"), 2), (FileNotFoundError("no such file: x.jsonl"), 2),
    (MissingDependency("pip install gguf"), 2), (UnsupportedModel("no blocks"), 2),
    (ModelLoadError("cannot load --model m"), 2), (AccountingError("3 rows lost"), 3),
    (ErrorBudgetExceeded("12 rows failed, 0 may"), 5)])
def test_each_kind_has_its_status(error, status):
    assert classify(error) == (status, str(error))


def test_a_model_that_failed_in_an_actor_is_found_in_rays_text():
    # Ray reports an actor whose constructor raised only as text, inside its own error.
    died = RuntimeError("The actor died because of an error raised in its creation task\n"
                        "pipelines.common.errors.ModelLoadError: a scoring actor could not load --model x: gone\n")
    try:
        try:
            raise died
        except RuntimeError as inner:
            raise ValueError("Ray Data: the operator failed") from inner
    except ValueError as outer:
        assert classify(outer) == (2, "a scoring actor could not load --model x: gone")


def test_storage_past_its_retries_is_status_4():
    try:
        try:
            raise ConnectionResetError("Connection reset by peer")
        except ConnectionResetError as inner:
            raise RuntimeError("write failed") from inner
    except RuntimeError as outer:
        status, line = classify(outer)
    assert status == 4 and line.startswith("storage unavailable:") and "rerun" in line


def test_run_main_prints_one_line_and_returns_the_status(capsys):
    def body():
        raise ConfigError("--sample must be at least 1")

    assert run_main(body) == 2
    err = capsys.readouterr().err
    assert err == "error: --sample must be at least 1\n"


def test_ctrl_c_is_130_and_leaves_ctrl_c_working(capsys):
    """Ctrl-C is ignored while the line is printed, then works again: a process that goes on
    (a test, a notebook) and every process it starts would otherwise ignore it for good."""
    import signal

    def body():
        raise KeyboardInterrupt

    before = signal.getsignal(signal.SIGINT)
    assert run_main(body, interrupted="stopped") == 130
    assert capsys.readouterr().err == "error: stopped\n"
    assert signal.getsignal(signal.SIGINT) is before is not signal.SIG_IGN


def test_a_bug_keeps_its_traceback():
    def body():
        raise KeyError("a bug")

    with pytest.raises(KeyError):
        run_main(body)
    assert classify(KeyError("a bug")) is None


def test_every_entry_point_uses_it(capsys, tmp_path):
    # eval and saliency used to map fewer errors than compress: a missing input is status 2
    # with one line in each.
    missing = str(tmp_path / "missing.jsonl")
    assert evaluate.main(["--input", missing, "--output", str(tmp_path / "ev")]) == 2
    assert capsys.readouterr().err.count("error:") == 1
    assert saliency.main(["--input", missing, "--out", str(tmp_path / "sal")]) == 2
    assert capsys.readouterr().err.count("error:") == 1


# ------------------------------------------------------------------ reject reasons

def test_an_undeclared_reject_reason_is_refused():
    from mist_core import InvalidExample

    assert InvalidExample("empty_cot").reason == "empty_cot"
    with pytest.raises(ValueError, match="undeclared reject reason 'emtpy_cot'"):
        InvalidExample("emtpy_cot")


def test_every_reason_the_code_names_is_declared():
    # The literal reasons of InvalidExample(...) and of the job's own rejects, and the
    # patterns that make one from a field name, all in mist_core/reasons.py.
    import re
    from pathlib import Path

    from mist_core.reasons import FAILURES, REASONS

    root = Path(__file__).resolve().parents[1]
    named = set()
    for path in [*root.glob("mist_core/**/*.py"), *root.glob("pipelines/**/*.py")]:
        text = path.read_text(encoding="utf-8")
        named |= set(re.findall(r'InvalidExample\(\s*"(\w+)"', text))
        named |= set(re.findall(r'^(?:[A-Z_]+) = "(\w+)"  # ', text, re.M)) & set(FAILURES)
        for pattern in re.findall(r'InvalidExample\(\s*f"([\w{}]+)"', text):
            regex = re.sub(r"\\\{\w+\\\}", r"\\w+", re.escape(pattern))
            assert any(re.fullmatch(regex, r) for r in REASONS), pattern
    assert named and named <= set(REASONS), named - set(REASONS)
    assert set(FAILURES) == {"score_error", "nonfinite_scores", "prune_error", "unexpected_error"}


def test_each_reason_is_decided_where_the_table_says():
    """The file the guide's table names for a reason rejects with it: the code literally, its
    constant (SCORE_ERROR), or an f-string that makes it (f"empty_{field}")."""
    import re
    from pathlib import Path

    from mist_core.reasons import REASONS, WHERE

    root = Path(__file__).resolve().parents[1]
    assert set(WHERE) == set(REASONS)
    for reason, where in WHERE.items():
        text = (root / where).read_text(encoding="utf-8")
        patterns = [re.sub(r"\\\{\w+\\\}", r"\\w+", re.escape(p))
                    for p in re.findall(r'f"([\w{}]+)"', text)]
        assert (f'"{reason}"' in text or re.search(rf"\b{reason.upper()}\b", text)
                or any(re.fullmatch(p, reason) for p in patterns if "{" not in p)), \
            f"{where} does not reject with {reason}"


def test_the_guides_table_of_reasons_is_current():
    from pathlib import Path

    from mist_core.reasons import markdown_table

    page = Path(__file__).resolve().parents[1] / "docs" / "guide" / "guarantees.md"
    assert markdown_table() in page.read_text(encoding="utf-8"), \
        "regenerate the table in docs/guide/guarantees.md from mist_core.reasons.markdown_table()"


# ------------------------------------------------------------------ checked before any work

def test_an_unreadable_input_is_refused_before_reading(tmp_path, monkeypatch):
    """A local file this process may not read fails the listing, not a read task after the
    model has loaded. (Root reads any file, so the permission is denied by os.access here.)"""
    import os

    from pipelines.common import storage

    (tmp_path / "a.jsonl").write_text('{"question": "q", "cot": "c", "answer": "1"}\n')
    (tmp_path / "b.jsonl").write_text('{"question": "q", "cot": "c", "answer": "2"}\n')
    assert len(storage.input_files(str(tmp_path))[1]) == 2
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: not p.endswith("b.jsonl") and real(p, mode))
    with pytest.raises(PermissionError) as caught:
        storage.input_files(str(tmp_path))
    status, line = classify(caught.value)
    assert status == 2 and line == f"permission denied: cannot read input {tmp_path / 'b.jsonl'}"


def test_a_storage_refusal_is_bad_input_and_an_outage_is_not():
    from pipelines.common import storage

    refused = OSError("When getting information for key 'in.jsonl' in bucket 'bkt': AWS Error "
                      "ACCESS_DENIED during HeadObject operation: No response body.")
    assert storage.denied(refused) and not storage.transient(refused)
    status, line = classify(refused)
    assert status == 2 and line.startswith("storage refused access: ") and "credentials" in line
    outage = OSError("AWS Error SERVICE_UNAVAILABLE during GetObject operation: HTTP status 503")
    assert not storage.denied(outage) and classify(outage)[0] == exits.STORAGE


def _first_lines(cmd: list[str], env: dict) -> tuple[int, list[str], list[str], float]:
    import os
    import subprocess
    import sys
    import time

    base = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "AWS_", "HF_"))}
    start = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "pipelines.compress", *cmd], env={**base, **env},
                       capture_output=True, text=True, timeout=120, cwd=REPO)
    return (p.returncode, p.stdout.splitlines(), [x for x in p.stderr.splitlines() if x.strip()],
            time.monotonic() - start)


@pytest.mark.integration
@pytest.mark.parametrize("model, says", [
    ("nosuch-org/nosuch-model", "cannot be reached"),   # the hub (a closed port here) is out of reach
    ("./no/such/folder", "is not a local folder or .gguf file"),
])
def test_a_model_that_cannot_load_fails_at_once_in_one_line(tmp_path, model, says):
    rc, out, err, seconds = _first_lines(
        ["--input", "demo:2", "--model", model, "--output", str(tmp_path / "out")],
        {"HF_ENDPOINT": "http://127.0.0.1:9"})
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: ") and says in err[0], err
    assert not any("plan:" in line for line in out) and seconds < 30, (out, seconds)


@pytest.mark.integration
def test_credentials_the_storage_refuses_fail_at_once_in_one_line(tmp_path):
    """moto with authentication on: keys it never issued are refused, for the input (its
    listing) and for the output (its check, before the lease is written)."""
    from s3_server import moto_s3, s3_env

    with moto_s3(auth=True) as url:
        wrong = {**s3_env(url), "AWS_SECRET_ACCESS_KEY": "wrong-secret"}
        for cmd in (["--input", "s3://bkt/in.jsonl", "--output", str(tmp_path / "out")],
                    ["--input", "demo:2", "--output", "s3://bkt/out"]):
            rc, out, err, seconds = _first_lines(cmd, wrong)
            assert rc == 2 and len(err) == 1, err
            assert err[0].startswith("error: storage refused access: ") and "ACCESS_DENIED" in err[0]
            assert "wrong-secret" not in err[0] and seconds < 30, (err, seconds)
