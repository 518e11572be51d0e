"""The Examples sections of the public API's docstrings run as doctests here, in the fast tier:
each module that defines a name of mist_core.__all__ (the examples that need a model build a
tiny random Llama and a word-level tokenizer themselves, so nothing is downloaded), and every
exported name and command entry has the sections a reader looks for."""
from __future__ import annotations

import ast
import doctest
import importlib
import inspect
from pathlib import Path

import pytest

import mist_core
from pipelines.cli import COMMANDS

ROOT = Path(__file__).resolve().parent.parent
# The modules that define mist_core's exported names (mist_core.__all__).
MODULES = sorted({getattr(mist_core, name).__module__ for name in mist_core.__all__})
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
# The methods a user calls on the exported classes, documented like the functions.
METHODS = ["Scorer.score", "Scorer.score_encoded", "Scorer.encode", "MistScorer",
           "Compressed", "ScoredChain", "LM"]


@pytest.fixture(scope="module")
def warm():
    """The imports the examples share, done once (transformers' Llama alone takes seconds),
    so that each example's time is its own."""
    import transformers.models.llama.modeling_llama  # noqa: F401

    import mist_core.distill.synthetic  # noqa: F401


@pytest.mark.parametrize("module", MODULES)
def test_examples_run(module, warm):
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    report: list[str] = []
    for test in doctest.DocTestFinder().find(importlib.import_module(module)):
        runner.run(test, out=report.append)
    assert runner.tries > 0, f"{module} has no examples"
    assert runner.failures == 0, "".join(report)


def test_the_modules_are_those_of_the_exported_names():
    assert "mist_core.scoring.scorer" in MODULES and "mist_core.errors" in MODULES


@pytest.mark.parametrize("name", mist_core.__all__)
def test_every_exported_name_has_an_example(name):
    doc = inspect.getdoc(getattr(mist_core, name)) or ""
    assert "Examples:" in doc and ">>>" in doc, f"mist_core.{name} has no Examples section"


@pytest.mark.parametrize("name", [n for n in mist_core.__all__
                                  if inspect.isfunction(getattr(mist_core, n))])
def test_every_exported_function_says_what_it_takes_and_gives(name):
    doc = inspect.getdoc(getattr(mist_core, name))
    takes = inspect.signature(getattr(mist_core, name)).parameters
    assert not takes or "Args:" in doc, f"mist_core.{name} has no Args section"
    assert "Returns:" in doc, f"mist_core.{name} has no Returns section"


@pytest.mark.parametrize("path", METHODS)
def test_the_main_methods_say_what_they_take(path):
    obj = mist_core
    for part in path.split("."):
        obj = getattr(obj, part)
    doc = inspect.getdoc(obj) or ""
    assert "Args:" in doc or "Attributes:" in doc, f"{path} documents no arguments"


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_entry_has_args_and_returns(command):
    """Read from the source, not imported: the commands' modules import Ray and torch."""
    module, _ = COMMANDS[command]
    tree = ast.parse((ROOT / "pipelines" / (module.replace(".", "/") + ".py")).read_text())
    main = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main")
    doc = ast.get_docstring(main) or ""
    assert "Args:" in doc and "argv:" in doc and "prog:" in doc, f"{module}.main: Args"
    assert "Returns:" in doc and "exit status" in doc, f"{module}.main: Returns"


def test_the_mist_entry_has_args_and_returns():
    from pipelines.cli import main

    doc = inspect.getdoc(main)
    assert "Args:" in doc and "Returns:" in doc
