"""The evaluation harness end to end on a tiny model (the CI smoke version of the full
evaluation): `pipelines.evaluation.evaluate` on local Ray, then `pipelines.evaluation.report` and
`pipelines.evaluation.saliency`."""
from __future__ import annotations

import json
import math

import pytest

from pipelines.evaluation import evaluate, report, saliency
from pipelines.evaluation.results import ALL_METHODS

from conftest import make_model

pytestmark = pytest.mark.integration  # pipelines.evaluation.evaluate on an in-process Ray

METHODS = [m for m in ALL_METHODS if m != "llmlingua2"]  # needs the hub: not in CI


@pytest.fixture(scope="module", autouse=True)
def shared_ray(local_ray):
    """The harness runs on the session's loopback Ray (conftest.local_ray)."""


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, tokenizer):
    path = tmp_path_factory.mktemp("tiny-llama")
    make_model("llama", len(tokenizer)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_evaluate_report_and_saliency(tmp_path, tiny_dir):
    out = tmp_path / "run"
    argv = ["--input", "demo:12", "--adapter", "generic", "--model", str(tiny_dir),
            "--methods", ",".join(METHODS), "--budgets", "0.5,0.9", "--sample", "4",
            "--seed", "3", "--exact-n", "1", "--batch-size", "2", "--output", str(out)]
    assert evaluate.main(argv) == 0
    recs = [json.loads(line) for line in (out / "results.jsonl").open()]
    assert len(recs) == 4 and {r["status"] for r in recs} == {"ok"}
    want = {f"{m}@{b}" for m in METHODS if m not in ("full", "nochain") for b in ("0.5", "0.9")}
    for r in recs:
        assert set(r["variants"]) == want | {"full", "nochain"}
        # the two ends are the scorer's own LL(c) and LL(∅)
        assert r["variants"]["full"]["ll"] == pytest.approx(r["ll_full"], abs=1e-3)
        assert r["variants"]["nochain"]["ll"] == pytest.approx(r["ll_nochain"], abs=1e-3)
        for b in (0.5, 0.9):
            for m in ("mist", "head", "tail", "uniform"):
                assert r["variants"][f"{m}@{b:g}"]["tokens"] == math.ceil(round(b * r["T"], 9))
        assert -1 <= r["rank"]["spearman"] <= 1 and 0 <= r["rank"]["jaccard30"] <= r["rank"]["overlap30"] <= 1
    [ex] = [r for r in recs if "exact" in r]
    assert ex["exact"]["layers"] == [1, 2, 3]
    assert all(0 <= v <= 1 for axis in ("necessity", "sufficiency") for v in ex["exact"][axis].values())
    meta = json.loads((out / "run.json").read_text())
    assert meta["status"] == "done" and meta["sample"] == 4 and meta["command"].startswith("mist eval ")

    # a rerun resumes: nothing left to do; other settings on the same folder are refused
    assert evaluate.main(argv) == 0
    assert json.loads((out / "run.json").read_text())["seconds"]["chains_this_run"] == 0
    assert evaluate.main(argv[:-1] + [str(out), "--budgets", "0.3"]) == 2

    docs = tmp_path / "docs"
    assert report.main([str(out), "--out", str(docs), "--boot", "200"]) == 0
    md = (docs / "quality.md").read_text()
    for part in ("## Headline at γ = 0.5", "### The paper's objective (Eq. 1)", "### Answer accuracy",
                 "### Reasoning kept", "### Token types kept at γ = 0.5", "### Necessity vs sufficiency",
                 "### First-order vs exact interventions", "### Where MIST wins and loses"):
        assert part in md
    for png in ("run_retention.png", "run_accuracy.png", "run_types.png"):
        assert (docs / png).stat().st_size > 10_000 and f"]({png})" in md
    # every figure's caption names the model, corpus, sample size, seed and command
    captions = [line for line in md.splitlines() if line.startswith("*Figure")]
    assert len(captions) == 3
    for caption in captions:
        for needle in (tiny_dir.name, "demo:12", "n = 4", "seed 3", "mist eval "):
            assert needle in caption, (caption, needle)
    assert "| `full` | 100 [100, 100] |" in md and "| `nochain` | 0 [0, 0] |" in md

    assert saliency.main(["--input", "demo:4", "--model", str(tiny_dir), "--row", "2",
                          "--budgets", "0.5", "--out", str(docs)]) == 0
    html = (docs / "saliency.html").read_text()
    assert html.count("<h3>") == 4 and "kept at γ = 0.5" in html
    assert (docs / "saliency.png").stat().st_size > 10_000
