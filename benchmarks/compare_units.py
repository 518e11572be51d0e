"""Pruning units and scorer variants compared on real chains, scored once per method with
SmolLM2-135M-Instruct: what each keeps of a chain's numbers, results, equations and answer.

    python benchmarks/compare_units.py --chains 30 --out docs/results

Arms (method × unit, every budget):
- MIST with the paper's signed layer weights, with clipped ones, and H2O, each at
  `subword` (the top ⌈γT⌉ tokens, each token alone: this project's token unit before numbers
  were made whole; SmolLM2 writes a digit a token, so `16` could become `1`) and at
  mist_core.scoring.prune's `token`, `word` and `equation` units (numbers whole in each);
- `facts`: the word unit with the numbers and operators taken first (prune's facts_first);
- `sent_eq` and `sent_facts`: `facts` with whole sentences dropped first, those without an
  equation or without a number or an operator (prune's sentences_first);
- at the job's default unit (`word`): CRISP, MIST with clipped weights and mean ablation,
  and the hybrid 0.5·z(mist clipped) + 0.5·z(log h2o).
Measures per chain: numbers cut (kept in part), tokens kept, the Eq. 1 drop
LL(c) − LL(c') in nats, the greedy answer's accuracy, intermediate results kept whole,
equations kept whole; and over all chains Eq. 1 retention Σ(LL(c') − LL(∅)) / Σ(LL(c) − LL(∅))
(a ratio of sums: a chain whose answer barely needs its chain would swamp a mean of ratios).
95% bootstrap intervals over chains, the same draws for every arm, so differences are
paired. Writes <out>/units.json (per-chain values too) and <out>/units.md (--stem names
them otherwise)."""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mist_core import get_adapter, get_scorer, load_model  # noqa: E402
from mist_core.data.templates import get_template  # noqa: E402
from mist_core.measures.evaluation import NOCHAIN, evaluate_chain  # noqa: E402
from mist_core.measures.stats import bootstrap_indices, ci_mean  # noqa: E402
from mist_core.scoring.prune import (EQUATION, NUMBER, UNITS, budget_tokens, cut_numbers,  # noqa: E402
                                     prune_scores)
from mist_core.scoring.scorer import zscore  # noqa: E402
from pipelines.loop.testbed import HYBRIDS, VARIANTS  # noqa: E402

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
CORPORA = {"gsm8k": ("gsm8k/test.jsonl", "gsm8k", "gsm8k"),  # path, adapter, answer style
           "math500": ("math500/test.jsonl", "math", "math")}
# The testbed's scorers of the same names (writer_hybrid: MistScorer's target "both").
SCORERS = {**{m: VARIANTS[m] for m in ("mist", "mist_clipped", "mist_mean", "mist_writer",
                                       "necessity_writer", "writer_hybrid")},
           "h2o": ("h2o", {}), "crisp": ("crisp", {})}
UNIT_METHODS = ("mist", "mist_clipped", "h2o", "mist_writer", "necessity_writer",
                "writer_hybrid")  # at every unit
WORD_METHODS = ("crisp", "mist_mean", "hybrid")  # at the job's default unit only
SENTENCE_UNITS = {"sent_eq": "equations", "sent_facts": "facts"}  # unit: sentences_first
ALL_UNITS = ("subword",) + UNITS + ("facts", "equations") + tuple(SENTENCE_UNITS)
MEASURES = ("numbers_cut", "kept", "drop", "accuracy", "results", "equations")
PAIRS = [((m, "equation"), (m, "word")) for m in UNIT_METHODS] + \
        [((m, "word"), (m, "token")) for m in UNIT_METHODS] + \
        [((m, "token"), (m, "subword")) for m in UNIT_METHODS] + \
        [((m, "word"), ("mist", "word")) for m in ("mist_clipped", "h2o") + WORD_METHODS] + \
        [((m, "word"), ("h2o", "word")) for m in ("mist_clipped", "mist_mean", "hybrid", "crisp")] + \
        [((m, "word"), ("mist_clipped", "word")) for m in ("mist_mean", "hybrid")] + \
        [((m, "facts"), (m, "word")) for m in UNIT_METHODS] + \
        [(("mist_clipped", "facts"), ("h2o", u)) for u in ("facts", "word")] + \
        [((w, u), (m, u)) for w in ("mist_writer", "necessity_writer", "writer_hybrid")
         for m in ("mist_clipped", "h2o")
         for u in ("facts", "word", "equations")] + \
        [((m, "equations"), (m, "facts")) for m in UNIT_METHODS] + \
        [((m, u), (m, "facts")) for m in UNIT_METHODS for u in SENTENCE_UNITS] + \
        [(("writer_hybrid", u), ("h2o", u)) for u in SENTENCE_UNITS]


def arms(units, methods=None) -> list[tuple[str, str]]:
    """(method, unit) pairs: the unit methods at each unit asked for, the word methods at
    word; of `methods` only, where given."""
    pairs = [(m, u) for m in UNIT_METHODS for u in units] + \
        ([(m, "word") for m in WORD_METHODS] if "word" in units else [])
    return [(m, u) for m, u in pairs if methods is None or m in methods]


def subword_mask(scores: np.ndarray, budget: float) -> np.ndarray:
    kept = np.zeros(len(scores), bool)
    kept[np.argsort(-scores, kind="stable")[:budget_tokens(budget, len(scores))]] = True
    return kept


def equations_kept(cot: str, offsets: np.ndarray, kept: np.ndarray) -> tuple[int, int]:
    spans = [m.span() for m in EQUATION.finditer(cot)]
    whole = sum(bool(kept[(offsets[:, 0] < b) & (offsets[:, 1] > a)].all()) for a, b in spans)
    return whole, len(spans)


def measure_chain(lm, enc, scores: dict, budgets, arms, style: str = "gsm8k") -> dict:
    """{"method/unit/γ": {measure: value}} for one chain, and its two ends' LLs."""
    offsets, cot = enc.chain_offsets, enc.example.cot
    masks = {"full": np.ones(enc.chain_len, bool), "nochain": NOCHAIN}
    for method, unit in arms:
        s = scores[method]
        if unit == "subword":
            for g in budgets:
                masks[f"{method}/{unit}/{g}"] = subword_mask(s, g)
        else:  # facts, equations, sent_*: words, and what each takes first or drops whole
            for c in prune_scores(enc.example, s, offsets, budgets,
                                  unit if unit in UNITS else "word",
                                  facts_first=unit == "facts" or unit in SENTENCE_UNITS,
                                  equations_first=unit == "equations",
                                  sentences_first=SENTENCE_UNITS.get(unit)):
                masks[f"{method}/{unit}/{c.budget}"] = c.kept
    ev = evaluate_chain(lm, enc, masks, style)
    n_results = ev["_chain"]["results"]
    out = {"_ll": {"full": ev["full"]["ll"], "nochain": ev["nochain"]["ll"]}}
    for name, kept in masks.items():
        if kept is NOCHAIN or name == "full":
            continue
        whole, n_eq = equations_kept(cot, offsets, kept)
        v = ev[name]
        out[name] = {"numbers_cut": cut_numbers(cot, offsets, kept), "kept": float(kept.mean()),
                     "ll": v["ll"], "drop": ev["full"]["ll"] - v["ll"],
                     "accuracy": float(v["correct"]),
                     "results": v["results"] / n_results if n_results else None,
                     "equations": whole / n_eq if n_eq else None}
    return out


def _col(per_chain, name, m):
    return np.array([np.nan if c[name][m] is None else c[name][m] for c in per_chain], float)


def retention(per_chain, name, idx) -> tuple[float, float, float]:
    """Σ(LL(c') − LL(∅)) / Σ(LL(c) − LL(∅)): the point estimate and its bootstrap interval."""
    num = _col(per_chain, name, "ll") - np.array([c["_ll"]["nochain"] for c in per_chain])
    den = np.array([c["_ll"]["full"] - c["_ll"]["nochain"] for c in per_chain])
    boot = num[idx].sum(1) / den[idx].sum(1)
    lo, hi = np.percentile(boot, [2.5, 97.5])
    return float(num.sum() / den.sum()), float(lo), float(hi)


def summarise(per_chain: list[dict], budgets) -> dict:
    idx = bootstrap_indices(len(per_chain))
    table = {}
    for name in per_chain[0]:
        if name.startswith("_"):
            continue
        table[name] = {m: ci_mean(_col(per_chain, name, m), idx) for m in MEASURES}
        table[name]["retention"] = retention(per_chain, name, idx)
        table[name]["numbers_cut_total"] = int(np.nansum(_col(per_chain, name, "numbers_cut")))
    paired = {}
    for (a, ua), (b, ub) in PAIRS:
        if f"{a}/{ua}/{budgets[0]}" not in table or f"{b}/{ub}/{budgets[0]}" not in table:
            continue
        for g in budgets:
            key = f"{a}/{ua} − {b}/{ub}/{g}"
            paired[key] = {m: ci_mean(_col(per_chain, f"{a}/{ua}/{g}", m)
                                      - _col(per_chain, f"{b}/{ub}/{g}", m), idx)
                           for m in ("drop", "accuracy", "results", "equations")}
    return {"table": table, "paired": paired}


def render(result: dict, budgets) -> str:
    def cell(t, scale=100, digits=1):
        m, lo, hi = t
        return "—" if np.isnan(m) else f"{m * scale:.{digits}f} [{lo * scale:.{digits}f}, {hi * scale:.{digits}f}]"

    head = result["meta"]
    corpus = {"gsm8k": "GSM8K", "math500": "MATH-500"}[head.get("corpus", "gsm8k")]
    lines = [f"# Pruning units and variants on {corpus}", "",
             f"*Generated by `{head['command']}` ({head['chains']} {corpus} test chains, "
             f"{head['numbers']} numbers, {head['model']}, {head['seconds']:.0f} s).* "
             "Means over chains with [95% bootstrap intervals]; Eq. 1 retention is the ratio of "
             "sums over chains. `subword` is the old token unit (each token alone); `token`, `word` "
             "and `equation` are `mist_core.scoring.prune`'s units, numbers whole in each."
             + (" `facts` is the word unit with the numbers and operators taken first "
                "(`facts_first`)." if "facts" in head["units"] else "")
             + (" `equations` is the word unit with the equations taken first "
                "(`equations_first`)." if "equations" in head["units"] else "")
             + (" `sent_eq` and `sent_facts` are `facts` with whole sentences dropped first, "
                "those without an equation or without a number or an operator "
                "(`sentences_first`)." if set(SENTENCE_UNITS) & set(head["units"]) else ""), "",
             "| method | unit | γ | numbers cut | tokens kept % | Eq. 1 drop, nats | Eq. 1 retention % "
             "| accuracy % | results kept % | equations kept % |", "|---|---|---|---|---|---|---|---|---|---|"]
    for method, unit in arms(head["units"], head.get("methods")):
        for g in budgets:
            t = result["table"][f"{method}/{unit}/{g}"]
            lines.append(f"| {method} | {unit} | {g} | {t['numbers_cut_total']} | {cell(t['kept'])} | "
                         f"{cell(t['drop'], 1, 2)} | {cell(t['retention'])} | {cell(t['accuracy'])} | "
                         f"{cell(t['results'])} | {cell(t['equations'])} |")
    lines += ["", "## Paired differences (A − B, points; Eq. 1 drop in nats, lower is better)", "",
              "| A − B | γ | Eq. 1 drop | accuracy | results kept | equations kept |",
              "|---|---|---|---|---|---|"]
    for key, d in result["paired"].items():
        pair, g = key.rsplit("/", 1)
        lines.append(f"| {pair} | {g} | {cell(d['drop'], 1, 2)} | {cell(d['accuracy'])} | "
                     f"{cell(d['results'])} | {cell(d['equations'])} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--chains", type=int, default=30)
    p.add_argument("--budgets", default="0.3,0.5,0.7,0.9")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--corpus", choices=tuple(CORPORA), default="gsm8k",
                   help="the test chains of ../shared/data (default gsm8k)")
    p.add_argument("--units", default=",".join(ALL_UNITS),
                   help=f"comma-separated, of {', '.join(ALL_UNITS)}")
    p.add_argument("--out", default="docs/results")
    p.add_argument("--stem", default="units", help="<out>/<stem>.json and <stem>.md")
    p.add_argument("--methods", help="comma-separated, of "
                   f"{', '.join(UNIT_METHODS + WORD_METHODS)} (default: all)")
    p.add_argument("--summarise", metavar="UNITS_JSON",
                   help="no scoring: the tables again from a run's stored per-chain values")
    a = p.parse_args(argv)
    if a.summarise:
        stored = json.loads(Path(a.summarise).read_text())
        result = {**summarise(stored["chains"], stored["meta"]["budgets"]),
                  "meta": stored["meta"], "chains": stored["chains"]}
        Path(a.summarise).write_text(json.dumps(result, indent=None) + "\n")
        Path(a.summarise).with_suffix(".md").write_text(render(result, stored["meta"]["budgets"]))
        return 0
    units = tuple(a.units.split(","))
    if not set(units) <= set(ALL_UNITS):
        p.error(f"--units: each of {', '.join(ALL_UNITS)}")
    budgets = [float(g) for g in a.budgets.split(",")]
    methods = a.methods.split(",") if a.methods else None
    if methods is not None and not set(methods) <= set(UNIT_METHODS + WORD_METHODS):
        p.error(f"--methods: each of {', '.join(UNIT_METHODS + WORD_METHODS)}")
    # what the arms score with: hybrid combines two scorings (the testbed's HYBRIDS)
    a_, b_, w_, log_b = HYBRIDS["hybrid"]
    needed = set(methods or SCORERS) | ({a_, b_} if methods is None or "hybrid" in methods
                                        else set())
    t0 = time.time()
    lm = load_model(a.model)
    path, adapter_name, style = CORPORA[a.corpus]
    adapter = get_adapter(adapter_name)
    examples = [adapter(json.loads(line)) for line in (DATA / path).open().readlines()[:a.chains]]
    template = get_template("auto", lm.tokenizer, lm.max_length)
    encoded = [template.encode(ex) for ex in examples]
    scores = {m: [s.scores for s in get_scorer(name, lm, **kw).score_encoded(encoded)]
              for m, (name, kw) in SCORERS.items() if m in needed}
    if {a_, b_} <= set(scores):
        scores["hybrid"] = [w_ * zscore(x) + (1 - w_) * zscore(
            np.log(np.maximum(y, 1e-12)) if log_b else y) for x, y in zip(scores[a_], scores[b_])]
    per_chain = []
    for i, enc in enumerate(encoded):
        per_chain.append(measure_chain(lm, enc, {m: v[i] for m, v in scores.items()}, budgets,
                                       arms(units, methods), style))
        print(f"chain {i + 1}/{len(encoded)} measured, {time.time() - t0:.0f} s", file=sys.stderr)
    result = summarise(per_chain, budgets)
    result["meta"] = {"command": "python benchmarks/compare_units.py " + " ".join(sys.argv[1:] if argv is None else argv),
                      "corpus": a.corpus, "chains": len(examples), "numbers": sum(len(NUMBER.findall(ex.cot)) for ex in examples),
                      "model": lm.name, "budgets": budgets, "units": units, "methods": methods,
                      "seconds": time.time() - t0}
    result["chains"] = per_chain
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{a.stem}.json").write_text(json.dumps(result, indent=None) + "\n")
    (out / f"{a.stem}.md").write_text(render(result, budgets))
    print(render(result, budgets))
    return 0


if __name__ == "__main__":
    sys.exit(main())
