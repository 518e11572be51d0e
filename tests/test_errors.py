"""The one error policy of every entry point (pipelines/errors.py): the exit status of each
kind of error, one `error:` line, and a bug's traceback kept."""
import pytest

from mist_core.errors import MissingDependency, UnsupportedModel
from pipelines import errors, evaluate, saliency
from pipelines.errors import (AccountingError, ConfigError, ErrorBudgetExceeded, ModelLoadError,
                              classify, run_main)


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
                        "pipelines.errors.ModelLoadError: a scoring actor could not load --model x: gone\n")
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
    for path in [*root.glob("mist_core/*.py"), *root.glob("pipelines/*.py")]:
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
