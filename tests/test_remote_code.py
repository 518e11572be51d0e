"""No model folder's Python runs without --trust-remote-code, in any command, whatever stdin
says: every transformers load passes trust_remote_code (left unset, transformers asks 'Do
you wish to run the custom code? [y/N]' and a `y`, or `yes |`, runs it), and each command
refuses such a folder with one `error:` line naming the flag."""
from __future__ import annotations

import ast
import io
import json
import sys
from pathlib import Path

import pytest

from mist_core.data.formats import sft_prompt_completion
from pipelines.loop import base as loop
from pipelines.common import rows
from pipelines.common.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]

@pytest.fixture
def evil_model(tmp_path, tokenizer, monkeypatch):
    from conftest import model_with_code

    with model_with_code(tmp_path / "folder-with-code", tokenizer, monkeypatch) as made:
        yield made


def _loads_without_the_argument() -> list[str]:
    """Every from_pretrained(...) call in the library and the pipelines that does not pass
    trust_remote_code (an AST walk: calls split over lines count too)."""
    missing = []
    for d in ("mist_core", "pipelines"):
        for p in sorted((REPO / d).rglob("*.py")):
            for node in ast.walk(ast.parse(p.read_text(), str(p))):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and node.func.attr == "from_pretrained"
                        and not any(k.arg == "trust_remote_code" for k in node.keywords)):
                    missing.append(f"{p.relative_to(REPO)}:{node.lineno}")
    return missing


def test_every_load_passes_trust_remote_code():
    assert _loads_without_the_argument() == []


def test_check_model_refuses_a_folder_with_code_even_after_a_yes(evil_model, monkeypatch):
    path, marker = evil_model
    monkeypatch.setattr(sys, "stdin", io.StringIO("y\n" * 10))
    with pytest.raises(ConfigError, match="--trust-remote-code") as e:
        loop.check_model(str(path))
    assert "\n" not in str(e.value) and not marker.exists()
    with pytest.raises(ConfigError, match="--trust-remote-code"):
        rows.template_for(str(path), "auto")
    assert not marker.exists()
    loop.check_model(str(path), trust_remote_code=True)  # the flag reaches transformers
    assert marker.read_text() == "remote code ran"


def test_the_actor_loader_passes_the_flag(monkeypatch):
    import mist_core

    seen = []
    monkeypatch.setattr(mist_core, "load_model",
                        lambda spec, **kw: seen.append(kw["trust_remote_code"]) or "lm")
    assert loop.load_lm("m", "float32", "cpu", None) == "lm"
    loop.load_lm("m", "float32", "cpu", None, trust_remote_code=True)
    assert seen == [False, True]


def test_the_loop_commands_take_the_flag():
    from pipelines.loop import generate, solve, train

    for module, argv in ((generate, ["--input", "q", "--output", "o"]),
                         (solve, ["--input", "q", "--output", "o"]),
                         (train, ["--sft", "s", "--output", "o"])):
        assert module.parse_args(argv, "p").trust_remote_code is False
        assert module.parse_args(argv + ["--trust-remote-code"], "p").trust_remote_code is True


def _commands(tmp_path: Path, model: Path) -> dict[str, list[str]]:
    questions = tmp_path / "questions.jsonl"
    questions.write_text(json.dumps({"id": "a", "question": "What is 2 + 2?", "answer": "4"}) + "\n")
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps({"id": "a", "question": "What is 2 + 2?", "cot": "2 + 2 = 4.",
                                  "answer": "4"}) + "\n")
    sft = tmp_path / "sft.jsonl"
    sft.write_text(json.dumps(sft_prompt_completion(id="a", question="What is 2 + 2?",
                                                    cot="2 + 2 = 4.", answer="4", budget=1.0)) + "\n")
    return {
        "solve": ["--input", str(questions), "--output", str(tmp_path / "solve")],
        "generate": ["--input", str(questions), "--output", str(tmp_path / "gen")],
        "train": ["--sft", str(sft), "--output", str(tmp_path / "trained")],
        "compress": ["--input", str(corpus), "--output", str(tmp_path / "comp")],
    }


@pytest.mark.integration
@pytest.mark.parametrize("command", ["solve", "generate", "train", "compress"])
def test_each_command_refuses_a_folder_with_code_whatever_stdin_says(evil_model, tmp_path,
                                                                      command, monkeypatch,
                                                                      capsys):
    """`mist <command>` as the console script runs it (its main, exit status and stderr), in
    this process with "y" lines on stdin, as `yes |` would give a subprocess."""
    from pipelines import cli

    path, marker = evil_model
    argv = _commands(tmp_path, path)[command] + ["--model", str(path)]
    monkeypatch.setenv("RAY_ADDRESS", "")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "stdin", io.StringIO("y\n" * 50))
    status = cli.main([command, *argv])
    out, err = capsys.readouterr()
    assert not marker.exists(), err[-2000:]
    assert status == 2, err[-2000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: ") and "--trust-remote-code" in last, err[-2000:]
    assert "Traceback" not in err and "[y/N]" not in out + err
