"""`mist show`: the preview of a compression output (headline, kept shares, rejects, chains
with the dropped words marked), as terminal text and as an HTML page, read from a local
folder and from S3; the marks found by aligning each compressed chain with its original."""
from __future__ import annotations

import json
import re
from html.parser import HTMLParser
from unittest import mock

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings, strategies as st

from mist_core.data.demo import demo_corpus
from mist_core.data.formats import DATA_SCHEMA, REJECT_SCHEMA, data_rows
from pipelines.job import show
from pipelines.common import storage
from pipelines.cli import main as mist

BUDGETS = [0.5, 0.8]
# One chain whose compression is written out by hand: whole words dropped, and "$6," cut
# inside the word (token-level pruning keeps "$6" and drops ",").
COT = "Each of the cards costs $6, so 3 of them cost 3 * 6 = $18."
KEPT = "cards costs $6 so 3 of * 6 = $18."
MARKED = "[-Each of the-] cards costs $6[-,-] so 3 of [-them cost 3-] * 6 = $18."


def pieces(cot: str) -> list[str]:
    """Token-like pieces that join back to the chain: each word's leading space and its
    first three characters, then the rest of the word."""
    out = []
    for m in re.finditer(r"\s*\S{1,3}|\S+", cot):
        out.append(m.group())
    return out


def compress(cot: str, budget: float, seed: int) -> tuple[str, int, int]:
    """A chain pruned as prune_scores prunes: ⌈γT⌉ pieces by a random score, in order."""
    ps = pieces(cot)
    k = int(np.ceil(budget * len(ps)))
    keep = np.zeros(len(ps), bool)
    keep[np.random.default_rng(seed).permutation(len(ps))[:k]] = True
    return "".join(p for p, on in zip(ps, keep) if on).strip(), k, len(ps)


def write_output(fs, root: str, manifest: bool = True) -> list[dict]:
    """A compression output in the job's layout (data/, sft/, rejects/, _manifest.json),
    written by hand: three demo examples at two budgets, the first as COT/KEPT, and three
    rejects. Returns the data rows."""
    rows = []
    for i, ex in enumerate(demo_corpus(3, seed=5)):
        if i == 0:
            ex = dict(ex, cot=COT)
            texts, kept, T = [KEPT, KEPT], [len(pieces(KEPT))] * 2, len(pieces(COT))
        else:
            done = [compress(ex["cot"], b, i) for b in BUDGETS]
            texts, kept, T = [d[0] for d in done], [d[1] for d in done], done[0][2]
        rows += data_rows(id=ex["id"], question=ex["question"], cot=ex["cot"],
                          answer=ex["answer"], budgets=BUDGETS, compressed=texts,
                          kept_tokens=kept, cot_tokens=T, method="mist", model="tiny")
    storage.write_atomic(fs, storage.join(root, "data", "run1-00.parquet"),
                         pa.Table.from_pylist(rows, schema=DATA_SCHEMA))
    storage.write_atomic(fs, storage.join(root, "sft", "run1-00.jsonl"), b'{"id": "x"}\n' * 3)
    rejects = [dict(source="demo", row=n, id=None, reason=r, detail=f"{r} at row {n}", raw="{}",
                    run_id="run1")
               for n, r in ((4, "too_long"), (5, "empty_cot"), (6, "too_long"))]
    storage.write_atomic(fs, storage.join(root, "rejects", "run1-00.parquet"),
                         pa.Table.from_pylist(rejects, schema=REJECT_SCHEMA))
    if manifest:
        totals = {"examples": 3, "rows_per_budget": {"0.5": 3, "0.8": 3}, "duplicate_rows": 0,
                  "mean_kept_ratio": {"0.5": 0.5123, "0.8": 0.8012},
                  "mean_kept_word_ratio": {"0.5": 0.4511, "0.8": 0.7777},
                  "rejects": 3, "sft_records": 3}
        text = json.dumps({"run_id": "run1", "finished_at": "2026-12-03T08:17:08+00:00",
                           "output": root, "config": {"method": "mist", "unit": "token",
                                                      "budgets": BUDGETS},
                           "model": {"name": "tiny-llama"}, "timings": {"total_s": 75.2},
                           "totals": totals, "runs": [{"run_id": "run1"}]})
        storage.write_atomic(fs, storage.join(root, show.MANIFEST), text.encode())
    return rows


@pytest.fixture(autouse=True)
def columns(monkeypatch):
    """The width `mist show` wraps at, whatever terminal runs the tests."""
    monkeypatch.setenv("COLUMNS", "100")


@pytest.fixture
def output(tmp_path):
    fs, root, _ = storage.filesystem(str(tmp_path / "out"))
    write_output(fs, root)
    return tmp_path / "out"


def test_show_prints_the_preview(output, capsys):
    assert mist(["show", str(output)]) == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    assert len(lines) <= 40, text
    flat = " ".join(text.split())  # the headline wraps at the terminal's width
    assert flat.startswith(f"{output}: 3 examples x 2 budgets (6 data/ rows), 3 sft/ records, "
                           "3 rejects")
    assert "model tiny-llama, method mist, unit token; last run run1" in flat
    assert "γ 0.5: 51% / 45% γ 0.8: 80% / 78%" in flat
    assert "too_long 2 e.g. too_long at row 4 empty_cot 1 e.g. empty_cot at row 5" in flat
    first, second, third = (ex["id"] for ex in demo_corpus(3, seed=5))
    assert f"── {first} " in text and f"── {second} " in text and third not in text  # 2 rows
    # the hand-made chain, dropped words marked, at each budget
    assert text.count(MARKED) == 2, text
    assert "\x1b[" not in text  # no terminal codes when stdout is not a terminal


def test_show_picks_examples_by_id_and_cuts_long_chains(output, capsys):
    third = demo_corpus(3, seed=5)[2]
    assert show.main([str(output), "--id", third["id"], "--lines", "1"]) == 0
    text = capsys.readouterr().out
    assert f"── {third['id']} " in text and text.count("── ") == 1
    p = show.load(str(output), ids=[third["id"]])
    assert [r["budget"] for r in p.examples[0]] == BUDGETS
    long = show.render_text(p, width=40, lines=1)
    assert all(len(line) <= 42 for line in long.splitlines()), long
    assert "…" in long


def test_show_dims_dropped_words_on_a_terminal(output):
    text = show.render_text(show.load(str(output)), width=200, color=True)
    assert f"{show.DIM}Each of the{show.UNDIM} cards" in text and "[-" not in text


def test_show_without_manifest_counts_the_folder(tmp_path, capsys):
    fs, root, _ = storage.filesystem(str(tmp_path / "out"))
    write_output(fs, root, manifest=False)
    assert show.main([str(tmp_path / "out")]) == 0
    text = capsys.readouterr().out
    assert "no _manifest.json" in text and "3 examples x 2 budgets" in text


def test_show_refuses_a_folder_without_data(tmp_path, capsys):
    assert show.main([str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith("error: no data/ files under")


class Page(HTMLParser):
    """The chains of a preview page: for each div.c, its (text, class) spans."""

    def __init__(self):
        super().__init__()
        self.divs, self.h3, self.cls, self.where = [], [], None, None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "div" and a.get("class") == "c":
            self.divs.append([])
            self.where = "div"
        elif tag == "span":
            self.cls = a.get("class")
        elif tag == "h3":
            self.where = "h3"
            self.h3.append("")

    def handle_endtag(self, tag):
        if tag == "span":
            self.cls = None
        elif tag in ("h3", "div"):
            self.where = None

    def handle_data(self, data):
        if self.where == "h3":
            self.h3[-1] += data
        elif self.where == "div":
            self.divs[-1].append((data, self.cls))


def test_show_html_page(output, tmp_path):
    page = tmp_path / "preview.html"
    assert show.main([str(output), "--html", str(page)]) == 0
    text = page.read_text(encoding="utf-8")
    assert text.startswith("<!doctype html>") and "line-through" in text
    parsed = Page()
    parsed.feed(text)
    rows = show.load(str(output)).examples
    assert len(parsed.divs) == 2 * (1 + len(BUDGETS))  # the chain, then each budget's
    assert sum("kept at γ = 0.5" in h for h in parsed.h3) == 2
    divs = iter(parsed.divs)
    for ex in rows:
        assert "".join(t for t, _ in next(divs)) == ex[0]["cot"]
        for r in ex:
            spans = next(divs)
            assert "".join(t for t, _ in spans) == r["cot"]  # every character, once
            kept = "".join(t for t, c in spans if c == "k")
            assert re.sub(r"\s", "", kept) == re.sub(r"\s", "", r["compressed_cot"])
    first = parsed.divs[1]
    assert [t for t, c in first if c == "d"] == ["Each of the", ",", "them cost 3"]


@settings(max_examples=200, deadline=None)
@given(words=st.lists(st.sampled_from(["a", "ab", "=", "12", "b2", "the", "aab"]), min_size=1,
                      max_size=30),
       seps=st.lists(st.sampled_from([" ", "  ", "\n"]), min_size=30, max_size=30),
       keep=st.lists(st.booleans(), min_size=60, max_size=60))
def test_marks_account_for_every_kept_character(words, seps, keep):
    """Whatever is pruned, the marks cut the chain into pieces that join back to it, and the
    kept ones read as the compressed chain (repeated words make the alignment ambiguous)."""
    cot = "".join(s + w for s, w in zip(seps, words)).strip()
    ps = pieces(cot)
    compressed = "".join(p for p, k in zip(ps, keep) if k).strip()
    for window in (show.WINDOW, 4):  # one alignment, and one a few words at a time
        with mock.patch.object(show, "WINDOW", window):
            found = show.marks(cot, compressed)
        assert "".join(t for t, _ in found) == cot
        kept = "".join(t for t, k in found if k)
        assert re.sub(r"\s", "", kept) == re.sub(r"\s", "", compressed)


@pytest.mark.parametrize("window", [16, show.WINDOW])
def test_long_chains_are_aligned_a_window_at_a_time(monkeypatch, window):
    """Words all different, so one alignment is right: every window finds it, and a chain
    of 20k words takes seconds, not the minutes of one alignment over it all."""
    monkeypatch.setattr(show, "WINDOW", window)
    rng = np.random.default_rng(window)
    n = 300 if window == 16 else 20_000
    words = [f"w{i}" for i in range(n)]
    keep = rng.random(n) < 0.4
    cot = " ".join(words)
    found = show._by_words(cot, " ".join(w for w, k in zip(words, keep) if k))
    kept = [w for t, k in found if k for w in t.split()]
    assert kept == [w for w, k in zip(words, keep) if k]
    assert "".join(t for t, _ in found) == cot


@pytest.mark.integration  # the compression job on a local Ray
def test_show_on_a_job_output(local_ray, tmp_path, model_dir, capsys):
    """What the job writes, shown: the counts are the manifest's, the bad line is a reject,
    and each budget's marks keep exactly its compressed chain."""
    from pipelines.job import compress as job
    from pipelines.job.config import JobConfig
    from pipelines.common.settings import validate

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(r) + "\n" for r in demo_corpus(5, seed=9)) + "{oops\n")
    out = tmp_path / "out"
    manifest = job.run(validate(JobConfig(input=[str(corpus)], output=str(out),
                                          model=str(model_dir), budgets=BUDGETS,
                                          batch_size=8)))
    capsys.readouterr()  # the job's progress lines
    assert show.main([str(out)]) == 0
    text = capsys.readouterr().out
    flat = " ".join(text.split())
    assert len(text.splitlines()) <= 40, text
    assert flat.startswith(f"{out}: 5 examples x 2 budgets (10 data/ rows), "
                           f"{manifest['totals']['sft_records']} sft/ records, 1 rejects")
    assert f"last run {manifest['run_id']}" in flat and "invalid_json 1 e.g." in flat
    preview = show.load(str(out))
    assert [len(rows) for rows in preview.examples] == [2, 2]
    for rows in preview.examples:
        for r in rows:
            kept = "".join(t for t, k in show.marks(r["cot"], r["compressed_cot"]) if k)
            assert kept.split() == r["compressed_cot"].split() or \
                re.sub(r"\s", "", kept) == re.sub(r"\s", "", r["compressed_cot"])


@pytest.mark.integration  # a moto S3 server
def test_show_reads_an_output_on_s3(capsys):
    from s3_server import environ_patch, moto_s3, s3_client, s3_env

    with moto_s3() as url, environ_patch(s3_env(url)):
        s3_client(url).create_bucket(Bucket="show-test")
        fs, root, _ = storage.filesystem("s3://show-test/out")
        write_output(fs, root)
        assert mist(["show", "s3://show-test/out", "--rows", "1"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("s3://show-test/out: 3 examples x 2 budgets") and MARKED in text


def test_mist_lists_and_runs_every_command(capsys):
    assert mist(["--help"]) == 0
    usage = capsys.readouterr().out
    for command in ("compress", "show", "eval", "report", "saliency", "bench", "soak",
                    "generate", "train", "solve", "testbed", "model-path"):
        assert re.search(rf"^  {command} ", usage, re.M), command
    for command in ("show", "report", "saliency"):
        with pytest.raises(SystemExit) as e:
            mist([command, "--help"])
        assert e.value.code == 0
        assert "usage:" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        mist(["report", "--help"])
    assert capsys.readouterr().out.startswith("usage: mist report")
