"""Security properties of the job: no model code runs unless asked, the output cannot overlap
its input, and nothing is read in a format that can execute code."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from pipelines.job import compress
from pipelines.common import rows, sources, storage
from pipelines.job import stages
from pipelines.job.compress import parse_args
from pipelines.common.settings import ConfigError, validate
from pipelines.job.config import JobConfig

REPO = Path(__file__).resolve().parents[1]

@pytest.fixture
def remote_code_model(tmp_path, tokenizer, monkeypatch):
    from conftest import model_with_code

    with model_with_code(tmp_path / "evil-model", tokenizer, monkeypatch) as made:
        yield made


def test_remote_code_runs_only_with_the_flag(remote_code_model, tmp_path):
    path, marker = remote_code_model
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps({"question": "q", "cot": "c", "answer": "1"}) + "\n")
    cfg = validate(JobConfig(input=[str(corpus)], output=str(tmp_path / "out"), model=str(path)))
    assert cfg.trust_remote_code is False
    with pytest.raises(ConfigError, match="cannot load the tokenizer"):
        compress.run(cfg)  # fails on the driver, before Ray starts
    assert not marker.exists()

    assert parse_args(["--model", str(path), "--trust-remote-code"]).trust_remote_code is True
    rows.template_for(str(path), "auto", True)
    assert marker.read_text() == "remote code ran"


def test_scoring_actor_passes_the_flag_to_the_model_loader(monkeypatch):
    seen = []

    def fake_load(spec, **kwargs):
        seen.append(kwargs["trust_remote_code"])
        raise RuntimeError("stop here")

    monkeypatch.setattr(stages, "load_model", fake_load)
    for flag in (False, True):
        with pytest.raises(RuntimeError):
            stages.ScoreActor(JobConfig(model="m", batch_tokens=64, batch_size=2,
                                        trust_remote_code=flag), device="cpu")
    assert seen == [False, True]


@pytest.mark.parametrize("output", ["corpus/out", "corpus", "."])
def test_output_may_not_overlap_an_input(tmp_path, output):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.jsonl").write_text(json.dumps({"question": "q", "cot": "c", "answer": "1"}) + "\n")
    cfg = validate(JobConfig(input=[str(tmp_path / "corpus")], output=str(tmp_path / output)))
    with pytest.raises(ConfigError, match="overlaps --input"):
        compress.run(cfg)
    assert sorted(p.name for p in (tmp_path / "corpus").iterdir()) == ["a.jsonl"]


def test_a_sibling_output_is_fine(tmp_path):
    from pipelines.job.output import Output

    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.jsonl").write_text("{}\n")
    (tmp_path / "b.jsonl").write_text("{}\n")
    inputs = sources.resolve_inputs([str(tmp_path / "corpus"), str(tmp_path / "b.jsonl")])
    compress.check_disjoint(inputs, Output(str(tmp_path / "corpus-out")))  # a prefix, not a parent
    compress.check_disjoint(inputs, Output(str(tmp_path / "out")))
    with pytest.raises(ConfigError):
        compress.check_disjoint(inputs, Output(str(tmp_path / "b.jsonl")))


def test_only_data_formats_are_read(tmp_path):
    """Pickles, numpy and torch files beside a corpus are never read; naming one is an error."""
    (tmp_path / "a.jsonl").write_text("{}\n")
    for name in ("evil.pkl", "evil.pickle", "arr.npy", "weights.pt", "x.joblib", "b.jsonl.pkl"):
        (tmp_path / name).write_bytes(b"\x80\x04K\x01.")
    _, files, _ = storage.input_files(str(tmp_path))
    assert [Path(p).name for p, _ in files] == ["a.jsonl"]
    with pytest.raises(ValueError, match="cannot tell the format"):
        storage.input_files(str(tmp_path / "evil.pkl"))
    with pytest.raises(SystemExit):
        parse_args(["--format", "pickle"])


def test_no_code_executing_deserialisation_in_the_job():
    """A guard for reviewers: the library and the job never unpickle anything they read."""
    banned = re.compile(r"\bpickle\.loads?\(|\btorch\.load\(|allow_pickle\s*=\s*True|read_pickle\(|"
                        r"cloudpickle\.loads?\(|joblib\.load\(|(?<![.\w])eval\(|(?<![.\w])exec\(|yaml\.load\(|"
                        r"yaml\.unsafe_load\(")
    hits = [f"{p.relative_to(REPO)}:{n}" for d in ("mist_core", "pipelines")
            for p in sorted((REPO / d).rglob("*.py"))
            for n, line in enumerate(p.read_text().splitlines(), 1) if banned.search(line)]
    assert hits == []
