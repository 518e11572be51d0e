"""The README and the user guide (docs/guide/*.md), run. Every command line in their shell
blocks is parsed by the program it calls (or, for commands that are not ours, checked to be
one the pages explain); the blocks a test machine can run are run as written, the ones that
need the real SmolLM2 model marked slow. Python and YAML blocks must each be claimed by a test
here, so the pages and their tests cannot drift apart; every relative link must point at a
file (and heading) that exists, and the README stays a landing page of at most 200 lines.
What is only parsed needs what a test machine lacks: a cluster, a cloud bucket, the Hugging
Face Hub, a GPU or hours of CPU."""
from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import shlex
import subprocess
import sys
from contextlib import redirect_stdout
from io import StringIO
from pathlib import Path
from unittest import mock

import pytest
import yaml

from conftest import job_in_process
from pipelines.cli import COMMANDS
from mist_core.data.demo import demo_corpus

REPO = Path(__file__).resolve().parents[1]
GUIDE = REPO / "docs" / "guide"
GUIDE_PAGES = ("job", "long-chains", "outputs", "cluster", "loop", "evaluation", "library",
               "guarantees", "development")
PAGES = [REPO / "README.md", *sorted(GUIDE.glob("*.md"))]  # the README first
TEXT = {page: page.read_text(encoding="utf-8") for page in PAGES}
README = TEXT[REPO / "README.md"]
BIN = Path(sys.executable).parent
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)


def name(page: Path) -> str:
    return page.relative_to(REPO).as_posix()


def page_blocks(page: Path, lang: str | None = None) -> list[tuple[str, str]]:
    """(language, text) of every fenced code block of one page, in order."""
    return [(k, t) for k, t in FENCE.findall(TEXT[page]) if lang is None or k == lang]


def blocks(lang: str | None = None) -> list[tuple[str, str]]:
    """(language, text) of every fenced code block of every page, the README first."""
    return [b for page in PAGES for b in page_blocks(page, lang)]


def block(marker: str) -> str:
    """The one code block, on any page, that contains `marker`."""
    hits = [t for _, t in blocks() if marker in t]
    assert len(hits) == 1, f"{len(hits)} blocks of the README and the guide contain {marker!r}"
    return hits[0]


def test_the_readme_is_a_landing_page_and_the_guide_has_its_pages():
    lines = README.count("\n")
    assert lines <= 200, f"README.md has {lines} lines: move detail into docs/guide/"
    assert sorted(p.stem for p in GUIDE.glob("*.md")) == sorted(GUIDE_PAGES)
    for stem in GUIDE_PAGES:
        page = GUIDE / f"{stem}.md"
        first, *rest = TEXT[page].splitlines()
        assert first.startswith("# "), f"{name(page)} does not start with its title"
        assert "](../../README.md)" in "\n".join(rest[:3]), \
            f"{name(page)}: no link back to the README"
        assert f"](docs/guide/{stem}.md)" in README, f"the README does not link {name(page)}"


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    prose = FENCE.sub("", path.read_text(encoding="utf-8"))
    return {slug(h) for h in re.findall(r"^#{1,6} (.+)$", prose, re.M)}


def test_every_relative_link_points_at_a_file_that_exists():
    shared = (REPO.parent / "shared").resolve()  # beside the checkout (maybe a link): the data, the paper
    broken, checked = [], 0
    for page in PAGES:
        prose = FENCE.sub("", TEXT[page])
        for target in re.findall(r"\[[^\]]*\]\(([^)\s]+)\)", prose):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, fragment = target.partition("#")
            where = (page.parent / path).resolve() if path else page
            checked += 1
            if not where.is_relative_to(REPO):
                if not where.is_relative_to(shared):
                    broken.append(f"{name(page)}: {target} leaves the checkout")
                elif shared.is_dir() and not where.exists():
                    broken.append(f"{name(page)}: {target} does not exist")
                continue
            if not where.exists():
                broken.append(f"{name(page)}: {target} does not exist")
            elif fragment and where.suffix == ".md" and fragment not in anchors(where):
                broken.append(f"{name(page)}: {target} names no heading of {path or 'the page'}")
    assert not broken, "broken links:\n" + "\n".join(broken)
    assert checked >= 30


# Python and YAML blocks, by a line each holds, and the test that runs or checks them.
CLAIMED = {
    "from mist_core import load_model, Example": "test_library_block (slow)",
    "data = pl.read_parquet(": "test_reading_and_training_recipes",
    "trainer = SFTTrainer(": "test_reading_and_training_recipes",
    "dataset: mist": "test_llamafactory_recipe",
}


def test_every_python_and_yaml_block_is_claimed():
    for page in PAGES:
        for lang, text in page_blocks(page):
            if lang in ("python", "yaml"):
                assert any(m in text for m in CLAIMED), \
                    f"{name(page)}: {lang} block not run by a test:\n{text}"
            if lang == "json":
                for record in re.split(r"\n(?=\{)", text.strip()):
                    json.loads(record)
    for marker in CLAIMED:
        block(marker)


# ------------------------------------------------------------------ shell commands


def commands(text: str) -> list[str]:
    """The command lines of a shell block: continuations joined, comments dropped."""
    out = []
    for line in text.replace("\\\n", " ").splitlines():
        line = re.sub(r"(^|\s)#.*$", "", line).strip()
        if line:
            out.append(line)
    return out


class Parsed(BaseException):
    """Raised once a program's argument parser accepted its arguments: nothing else runs."""


def parse_only(main, argv: list[str]) -> None:
    real = argparse.ArgumentParser.parse_args

    def parse(self, args=None, namespace=None):
        real(self, args, namespace)
        raise Parsed

    with mock.patch.object(argparse.ArgumentParser, "parse_args", parse), \
            redirect_stdout(StringIO()):
        try:
            main(argv)
        except Parsed:
            return
        except SystemExit as e:  # --help prints and exits 0; a bad flag exits 2
            assert e.code == 0, f"exit {e.code}"
            return
    raise AssertionError("the program ran past its argument parser")


def check_python(module: str, argv: list[str]) -> None:
    """Parse a `python -m module …` command line as that program does, settings checked."""
    if module in ("pipelines.compress", "pipelines.job.compress") and "--help" not in argv:
        from pipelines.job.compress import parse_args

        parse_args(argv)
    elif module == "pipelines.evaluation.evaluate" and "--help" not in argv:
        from pipelines.evaluation.evaluate import parse_args

        parse_args(argv, "mist eval")
    elif module in LOOP_MODULES and "--help" not in argv:  # settings checked as well
        importlib.import_module(module).parse_args(argv, module)
    else:
        parse_only(importlib.import_module(module).main, argv)


LOOP_MODULES = ("pipelines.loop.generate", "pipelines.loop.train", "pipelines.loop.solve")
MIST = {command: f"pipelines.{module}" for command, (module, _) in COMMANDS.items()}
OTHER_PROGRAMS = {"ray", "source", "deactivate", "export"}  # the pages say what each does


def check_command(line: str) -> str:
    """Check one command line; returns what it was checked as."""
    words = shlex.split(line)
    if "--" in words:  # `ray job submit … -- python -m …`: the job's own command line too
        cut = words.index("--")
        check_command(shlex.join(words[cut + 1:]))
        words = words[:cut]
    if words[:5] == ["0", "3", "*", "*", "*"]:  # a crontab entry: `cd … && …`
        words = words[5:]
    if "&&" in words:
        cut = words.index("&&")
        assert words[0] == "cd", line
        words = words[cut + 1:]
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
        words = words[1:]
    program = words[0].removeprefix(".venv/bin/")
    if program == "python" and words[1] == "-m":
        check_python(words[2], words[3:])
        return "python"
    if program == "mist":
        if words[1] == "--help":
            from pipelines.cli import main

            with redirect_stdout(StringIO()):
                assert main(["--help"]) == 0
        elif words[1] == "model-path":
            from pipelines.cli import model_path

            parse_only(model_path, words[2:])
        else:
            check_python(MIST[words[1]], words[2:])
        return "python"
    if program == "make":
        assert re.search(rf"^{re.escape(words[1])}:", (REPO / "Makefile").read_text(), re.M), line
        return "make"
    if re.fullmatch(r"benchmarks/\w+\.sh", program):
        assert os.access(REPO / program, os.X_OK), line
        return "script"
    assert program in OTHER_PROGRAMS, f"unknown program in a command: {line}"
    return "other"


def test_every_command_line_parses(monkeypatch):
    monkeypatch.chdir(REPO)  # --config pipelines/job/configs/gsm8k.yaml and the like
    kinds, failures = [], []
    for page in PAGES:
        assert not page_blocks(page, "sh") and not page_blocks(page, "shell"), name(page)
        for lang, text in page_blocks(page, "bash"):
            for line in commands(text):
                try:
                    kinds.append(check_command(line))
                except (Exception, SystemExit) as e:
                    failures.append(f"{name(page)}: {line}\n    {type(e).__name__}: {e}")
    assert not failures, "commands that do not parse:\n" + "\n".join(failures)
    assert kinds.count("python") >= 30 and "make" in kinds and "script" in kinds


def shell(script: str, cwd: Path, timeout: int) -> subprocess.CompletedProcess:
    """A shell block of the pages as a user runs it inside the venv (its bin first on PATH, what
    `source .venv/bin/activate` does)."""
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}")
    env.pop("RAY_ADDRESS", None)
    p = subprocess.run(["bash", "-eo", "pipefail", "-c", script], cwd=cwd, env=env,
                       capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p


@pytest.mark.integration
def test_venv_block_runs_as_written():
    """The block that says how to run commands inside the venv, run in the checkout."""
    p = shell(block("source .venv/bin/activate"), REPO, timeout=300)
    assert "usage: mist compress" in p.stdout and "model-path" in p.stdout


# ------------------------------------------------------------------ recipes on an output


@pytest.fixture(scope="module")
def workdir(local_ray, tmp_path_factory, model_dir):
    """A folder like the checkout after the demo: outputs/demo written by the job (tiny
    model, with scores/ and one reject), outputs/gsm8k with alpaca records."""
    from pipelines.job import compress
    from pipelines.job.config import JobConfig
    from pipelines.common.settings import validate

    work = tmp_path_factory.mktemp("work")
    corpus = work / "corpus.jsonl"
    rows = demo_corpus(6, seed=5) + [{"id": "no-chain", "question": "q", "answer": "1"}]
    corpus.write_text("".join(json.dumps(r) + "\n" for r in rows))
    for out, kw in (("outputs/demo", {"scores": True}),
                    ("outputs/gsm8k", {"sft_format": "alpaca"})):
        compress.run(validate(JobConfig(input=[str(corpus)], output=str(work / out),
                                        model=str(model_dir), budgets=[0.5, 0.8],
                                        batch_size=8, **kw)))
    return work


def run_python(text: str, cwd: Path, monkeypatch) -> dict:
    """Execute a Python block of the pages in `cwd`; returns its variables."""
    import datasets

    monkeypatch.chdir(cwd)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(cwd / "hf-cache"))
    scope = {"__name__": "__readme__"}
    with redirect_stdout(StringIO()) as printed:
        exec(compile(text, "<docs block>", "exec"), scope)
    scope["printed"] = printed.getvalue()
    return scope


@pytest.mark.integration
def test_reading_and_training_recipes(workdir, model_dir, monkeypatch):
    read = run_python(block("data = pl.read_parquet("), workdir, monkeypatch)
    assert read["data"].height == 6 * 2 and read["hf"].num_rows == 6 * 2
    assert read["table"].num_rows == 6 * 2 and read["sft"].num_rows == 6 * 3
    assert "('missing_column', 1)" in read["printed"]
    # The model the guide trains is SmolLM2, minutes of CPU: the tiny model stands in.
    train = block("trainer = SFTTrainer(").replace('"smollm2-135m-instruct"', repr(str(model_dir)))
    scope = run_python(train, workdir, monkeypatch)
    assert scope["trainer"].state.global_step >= 1
    assert all(p.requires_grad for p in scope["trainer"].model.parameters())


def readme_records() -> list[dict]:
    """The README's data/ row and sft/ record of the demo, as it shows them."""
    return [json.loads(text) for lang, text in page_blocks(REPO / "README.md", "json")]


@pytest.mark.integration
def test_the_readme_row_and_record_have_the_jobs_columns(workdir):
    import polars as pl

    row, record = readme_records()
    data = pl.read_parquet(workdir / "outputs/demo/data/*.parquet")
    assert sorted(row) == sorted(data.columns)
    first = next((workdir / "outputs/demo/sft").glob("*.jsonl")).read_text().splitlines()[0]
    sft = json.loads(first)
    assert sorted(record) == sorted(sft) and record["completion"][0]["content"].endswith(
        "\n\nThe answer is " + row["answer"])
    assert record["prompt"][0]["content"].endswith(
        "\n\nPlease reduce 50% of the tokens in your CoT.") and row["budget"] == 0.5


@pytest.mark.integration
def test_llamafactory_recipe(workdir, tmp_path):
    from test_outputs import llamafactory_load

    config = yaml.safe_load(block("dataset: mist"))
    assert config["stage"] == "sft" and config["dataset"] == "mist"
    turns = llamafactory_load(workdir / config["dataset_dir"], config["dataset"], tmp_path)
    assert len(turns) == 6 * 3 and all(t["assistant"] for t in turns)  # 0.5, 0.8, whole


# ------------------------------------------------------------------ with SmolLM2 (slow)


def outside_checkout(tmp_path: Path) -> Path:
    """A working folder where `../shared` is this checkout's `../shared`, as in the docs."""
    (tmp_path / "shared").symlink_to(REPO.parent / "shared")
    (tmp_path / "work").mkdir()
    return tmp_path / "work"


@pytest.mark.slow
@pytest.mark.integration
def test_demo_then_recipes_as_written(local_ray, tmp_path, monkeypatch):
    """`make demo` is `mist compress` with no options (the README says so): run it twice, as
    the guide's First run describes (the second time in this process: the same settings,
    without starting Ray and torch again for a run with nothing to score), then read its
    output as written, and find the README's row in it. (Training SmolLM2 on it takes minutes
    on CPU: test_reading_and_training_recipes trains the tiny model.)"""
    work = outside_checkout(tmp_path)
    assert "make demo" in commands(block("make demo "))
    demo = re.search(r"^make demo +#.*the same as `(mist compress)` with no options",
                     block("make demo "), re.M)
    assert demo, block("make demo ")
    first = shell(demo[1], work, timeout=900)
    assert "outputs/demo" in first.stdout and "24 examples x 5 budgets" in first.stdout
    # A quiet console: the job's own lines only, no Ray status blocks and no ERROR line (the
    # one check of the default console on a whole run). The [progress] lines come every
    # 10 s, so their number follows the machine's speed (26 lines in all once, on a slow
    # machine with the model's conversion): not counted.
    console = (first.stdout + first.stderr).splitlines()
    assert not any("ERROR" in line or "Running Dataset" in line for line in console), console
    assert len([ln for ln in console if not ln.startswith("[progress]")]) <= 20, console
    from pipelines.job import compress
    from pipelines.job.output import Output

    monkeypatch.chdir(work)
    again = job_in_process(shlex.split(demo[1]))
    assert "scored 0, rejected 0, already done 24" in compress.summary(again, Output(again["output"]))
    read = run_python(block("data = pl.read_parquet("), work, monkeypatch)
    assert read["data"].height == 24 * 5 and read["sft"].num_rows == 24 * 6
    # The README's row, less what another machine's rounding could change (which tokens).
    row = readme_records()[0]
    [got] = read["data"].filter((read["data"]["id"] == row["id"])
                                & (read["data"]["budget"] == row["budget"])).to_dicts()
    for key in ("question", "cot", "answer", "kept_tokens", "cot_tokens", "cot_words", "topic"):
        assert got[key] == row[key], key


@pytest.mark.slow
@pytest.mark.integration
def test_gsm8k_command_as_written(local_ray, tmp_path, monkeypatch):
    """The README's GSM8K command, in this process (the demo's test runs the job as a shell
    runs it; this one checks the command's paths, adapter and limit on the real corpus)."""
    work = outside_checkout(tmp_path)
    [gsm8k] = commands(block("# GSM8K from this machine").split("\n\n")[0])
    monkeypatch.chdir(work)
    manifest = job_in_process(shlex.split(gsm8k))
    assert manifest == json.loads((work / "outputs/gsm8k/_manifest.json").read_text())
    assert manifest["counts"]["read"] == 10 and manifest["counts"]["scored"] >= 9, manifest
    assert (work / "outputs/gsm8k/scores").is_dir()


@pytest.mark.slow
@pytest.mark.integration
def test_library_block(monkeypatch, tmp_path):
    scope = run_python(block("from mist_core import load_model, Example"), tmp_path, monkeypatch)
    assert scope["nec"].shape == scope["suf"].shape == (2, len(scope["s"].scores))


@pytest.mark.slow
@pytest.mark.integration
def test_model_path_command_as_written(tmp_path):
    p = shell(block("mist model-path smollm2-135m-instruct"), tmp_path, timeout=300)
    assert (Path(p.stdout.strip()) / "config.json").is_file()
