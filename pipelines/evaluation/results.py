"""The evaluation's stored results: their file names, the methods and their variants' names,
and the one reader of results.jsonl. Light on purpose (no model, no Ray): the report reads
stored results with it alone."""
from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Iterator

from mist_core.data.formats import budget_label

# One MIST scoring gives all four: mist and its two axes with the paper's signed layer
# weights, and mist_clipped, MistScorer's and `mist compress`'s default (max(c̄_l, 0)).
MIST_METHODS = ("mist", "necessity", "sufficiency", "mist_clipped")
BASELINES = ("uniform", "perplexity", "attention_rollout", "h2o", "crisp", "gogi_l1", "llmlingua2")
POSITIONAL = ("head", "tail")  # keep the first / last tokens
ENDS = ("full", "nochain")  # the whole chain / no chain
# Greedy likelihood pruning (arXiv 2601.03066): an upper reference, a forward pass per kept
# token per dropped token; evaluated only when asked for.
REFERENCES = ("greedy_ll",)
ALL_METHODS = MIST_METHODS + BASELINES + POSITIONAL + REFERENCES + ENDS
VARIANTS = REFERENCES  # evaluated when asked for (--methods)
DEFAULT_METHODS = tuple(m for m in ALL_METHODS if m not in VARIANTS)
RESULTS, RUN = "results.jsonl", "run.json"


def variant_name(method: str, budget: float | None) -> str:
    return method if budget is None else f"{method}@{budget_label(budget)}"


def read_records(path: str | Path) -> Iterator[dict]:
    """The records of a results.jsonl, or of its gzipped copy; a line cut short by a crash
    is skipped (the rerun that resumed wrote the record again)."""
    path = Path(path)
    opened = gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else path.open(encoding="utf-8")
    with opened as f:
        for line in f:
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue
