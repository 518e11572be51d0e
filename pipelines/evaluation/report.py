"""The quality report: tables (quality.md) and plots (PNG) from stored evaluation results.

    mist report docs/results/runs/gsm8k docs/results/runs/math500 --out docs/results
    (the same: mist report …)

Reads the folders `mist eval` wrote (run.json, results.jsonl) and needs no
model: the measures that depend only on text (answer correctness, intermediate results,
number tokens, token types) are recomputed from the stored predictions and kept masks with
the current code; Eq. 1 comes as stored. Confidence intervals are 95% percentile bootstraps
over examples, with the same draws for every method (differences to MIST are paired).
Retention is measured between the `nochain` and `full` controls: an evaluation without
them gets every other measure and a note saying so."""
from __future__ import annotations

import json
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mist_core.data.formats import budget_label
from mist_core.measures.answers import answer_correct
from mist_core.measures.retention import ChainProfile, unpack_mask
from mist_core.measures.stats import bootstrap_indices, ci_mean, ci_ratio
from mist_core.measures.taxonomy import TYPE_LABELS, TYPES

from ..common import exits
from ..common.settings import Kit, parse, positive, setting
from .results import ALL_METHODS, ENDS, RESULTS, RUN, read_records, variant_name

PAPER = {"spearman": -0.07, "overlap30": 0.28,
         "exact": {("necessity", 0.3): 0.72, ("necessity", 0.5): 0.81,
                   ("sufficiency", 0.3): 0.68, ("sufficiency", 0.5): 0.76}}
COLORS = {"mist": "#d62728", "necessity": "#ff9896", "sufficiency": "#e377c2",
          "uniform": "#7f7f7f", "perplexity": "#1f77b4", "attention_rollout": "#17becf",
          "h2o": "#2ca02c", "crisp": "#98df8a", "gogi_l1": "#9467bd", "llmlingua2": "#8c564b",
          "head": "#bcbd22", "tail": "#ff7f0e", "greedy_ll": "#393b79", "mist_clipped": "#8c0000",
          "full": "#000000", "nochain": "#000000"}


@dataclass
class Run:
    """One evaluation folder: its settings and its per-chain measures as arrays."""

    folder: Path
    meta: dict
    records: list
    rejected: dict = field(default_factory=dict)

    @classmethod
    def load(cls, folder: str | Path) -> "Run":
        folder = Path(folder)
        meta = json.loads((folder / RUN).read_text())
        path = folder / RESULTS
        if not path.exists():
            path = folder / (RESULTS + ".gz")
        records, rejected, seen = [], {}, set()
        for rec in read_records(path):
            key = (rec["source"], rec["row"])
            if key in seen:
                continue
            seen.add(key)
            if rec["status"] == "ok":
                records.append(rec)
            else:
                rejected[rec.get("reason", "?")] = rejected.get(rec.get("reason", "?"), 0) + 1
        records.sort(key=lambda r: (r["source"], r["row"]))
        return cls(folder, meta, records, rejected)

    @property
    def name(self) -> str:
        return self.folder.name

    @property
    def budgets(self) -> list[float]:
        return self.meta["config"]["budgets"]

    @property
    def methods(self) -> list[str]:
        """Methods with results (an unavailable scorer, e.g. llmlingua2 offline, has none)."""
        have = set(self.records[0]["variants"]) if self.records else set()
        return [m for m in self.meta["config"]["methods"]
                if m in have or variant_name(m, self.budgets[0]) in have]

    @property
    def unavailable(self) -> dict:
        return self.records[0].get("unavailable", {}) if self.records else {}

    def caption(self) -> str:
        c = self.meta["config"]
        return (f"model {self.meta['model_name']}, corpus {', '.join(c['input'])} "
                f"({c['adapter']}), n = {len(self.records)} chains, seed {c['seed']}, "
                f"unit {c['unit']}; command: `{self.meta['command']}`")


@dataclass
class Measures:
    """Per-example arrays of one variant (method at a budget)."""

    ll: np.ndarray
    correct: np.ndarray
    tokens: np.ndarray  # share of chain tokens kept
    results: np.ndarray  # share of intermediate results kept (nan: chain has none)
    answer: np.ndarray  # 1 if the chain's last statement of the answer is kept (nan: none)
    numbers: np.ndarray  # share of number tokens kept (nan: chain has none)
    types: np.ndarray  # [n, len(TYPES)] share of each type kept (nan: type absent)
    type_mass: np.ndarray  # [n, len(TYPES)] kept tokens of each type / kept tokens


def _share(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(b > 0, a / np.where(b > 0, b, 1), np.nan)


def measures(run: Run) -> dict[str, Measures]:
    """Recompute the text measures from stored predictions and masks."""
    names = list(run.records[0]["variants"]) if run.records else []
    rows = {n: {k: [] for k in Measures.__dataclass_fields__} for n in names}
    for rec in run.records:
        T = rec["T"]
        profile = ChainProfile.of(rec["cot"], np.asarray(rec["offsets"]).reshape(-1, 2),
                                  rec["style"], rec["answer"])
        tot = profile.totals()
        for n in names:
            v = rec["variants"][n]
            kept = profile.kept(unpack_mask(v["kept"], T)) if "kept" in v else v
            r = rows[n]
            r["ll"].append(v["ll"])
            r["correct"].append(float(answer_correct(v["pred"], rec["answer"], rec["style"])))
            r["tokens"].append(kept["tokens"] / T)
            r["results"].append(_share(kept["results"], tot["results"]))
            r["answer"].append(_share(kept.get("answer", np.nan), tot.get("answer", 0)))
            r["numbers"].append(_share(kept["numbers"], tot["numbers"]))
            r["types"].append(_share(kept["types"], tot["types"]))
            r["type_mass"].append(_share(kept["types"], [max(kept["tokens"], 1)] * len(TYPES)))
    return {n: Measures(**{k: np.asarray(v, np.float64) for k, v in r.items()})
            for n, r in rows.items()}


# ---------------------------------------------------------------- formatting

def nanmean(x, axis=None):
    """Mean over the entries that apply (nan: the measure does not apply), quietly nan
    where none do."""
    x = np.asarray(x, np.float64)
    n = np.sum(~np.isnan(x), axis=axis)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(n > 0, np.nansum(x, axis=axis) / np.maximum(n, 1), np.nan)


def pct(x) -> str:
    return "–" if x is None or not np.isfinite(x) else f"{100 * x:.0f}"


def with_ci(t, scale=100.0, digits=0) -> str:
    m, lo, hi = t
    if not np.isfinite(m):
        return "–"
    f = f"{{:.{digits}f}}"
    return f"{f.format(scale * m)} [{f.format(scale * lo)}, {f.format(scale * hi)}]"


def table(header: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] * len(header)) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


# ---------------------------------------------------------------- one corpus

@dataclass
class Summary:
    run: Run
    m: dict
    idx: np.ndarray
    retention: dict = field(default_factory=dict)  # variant -> (mean, lo, hi)
    accuracy: dict = field(default_factory=dict)
    ll: dict = field(default_factory=dict)
    vs_mist: dict = field(default_factory=dict)  # (measure, variant) -> (diff, lo, hi)

    @property
    def controls(self) -> bool:
        """Whether both ends were evaluated: retention is measured between them."""
        return all(e in self.m for e in ENDS)

    @property
    def missing_note(self) -> str:
        """What is left out for want of the controls, in words ('' if nothing is)."""
        if self.controls:
            return ""
        lost = " and ".join(f"`{e}`" for e in ENDS if e not in self.m)
        return (f"without {lost} (not in its `--methods`) the retention of Eq. 1, measured "
                "between `nochain` and `full`, is left out; the other measures need no control")

    @classmethod
    def of(cls, run: Run, n_boot: int, seed: int) -> "Summary":
        m = measures(run)
        s = cls(run, m, bootstrap_indices(len(run.records), n_boot, seed))
        for name, v in m.items():
            s.ll[name] = ci_mean(v.ll, s.idx)
            s.accuracy[name] = ci_mean(v.correct, s.idx)
        if s.controls:
            ll0, ll1 = m["nochain"].ll, m["full"].ll
            for name, v in m.items():
                s.retention[name] = ci_ratio(v.ll - ll0, ll1 - ll0, s.idx)
        for b in run.budgets:
            ref = m.get(variant_name("mist", b))
            if ref is None:
                continue
            for meth in run.methods:
                name = variant_name(meth, b)
                if name not in m or meth == "mist":
                    continue
                v = m[name]
                if s.controls:
                    den = (ll1 - ll0)[s.idx].mean(1)
                    d = ((v.ll - ref.ll)[s.idx].mean(1)) / den
                    s.vs_mist[("retention", name)] = (
                        float((v.ll - ref.ll).mean() / (ll1 - ll0).mean()),
                        *np.percentile(d, [2.5, 97.5]))
                d = (v.correct - ref.correct)[s.idx].mean(1)
                s.vs_mist[("accuracy", name)] = (float((v.correct - ref.correct).mean()),
                                                 *np.percentile(d, [2.5, 97.5]))
        return s

    def per_budget(self, what: dict, fmt) -> str:
        run = self.run
        rows = []
        for meth in run.methods:
            if meth in ("full", "nochain"):
                rows.append([f"`{meth}`"] + [fmt(what[meth])] * len(run.budgets))
            else:
                rows.append([f"`{meth}`"] + [fmt(what.get(variant_name(meth, b), (np.nan,) * 3))
                                             for b in run.budgets])
        return table(["method"] + [f"γ = {budget_label(b)}" for b in run.budgets], rows)

    def kept_table(self) -> str:
        run, rows = self.run, []
        for meth in run.methods:
            if meth in ("full", "nochain"):
                continue
            cells = []
            for b in run.budgets:
                v = self.m[variant_name(meth, b)]
                cells.append(f"{pct(nanmean(v.results))} / {pct(nanmean(v.numbers))} / "
                             f"{pct(nanmean(v.answer))}")
            rows.append([f"`{meth}`"] + cells)
        return table(["method"] + [f"γ = {budget_label(b)}: results / numbers / answer %"
                                   for b in run.budgets], rows)

    def accuracy_given_answer(self, budget: float) -> str:
        """Accuracy split by whether the answer's statement in the chain was kept: how far
        accuracy is a matter of keeping that one span."""
        rows = []
        for meth in self.run.methods:
            name = variant_name(meth, budget)
            if name not in self.m:
                continue
            v = self.m[name]
            has = ~np.isnan(v.answer)
            kept, lost = has & (v.answer == 1), has & (v.answer == 0)
            rows.append([f"`{meth}`", pct(kept.sum() / max(has.sum(), 1)),
                         pct(v.correct[kept].mean()) if kept.any() else "–",
                         pct(v.correct[lost].mean()) if lost.any() else "–"])
        # whether a chain states its answer is the chain's, the same in every variant
        n = int((~np.isnan(next(iter(self.m.values())).answer)).sum())
        return table(["method", f"answer statement kept, % of the {n} chains that state it",
                      "accuracy when kept, %", "accuracy when dropped, %"], rows)

    def types_table(self, budget: float) -> str:
        run, rows = self.run, []
        for meth in run.methods:
            if meth in ("full", "nochain"):
                continue
            v = self.m[variant_name(meth, budget)]
            rows.append([f"`{meth}`", pct(np.mean(v.tokens))]
                        + [pct(nanmean(v.types[:, i])) for i in range(len(TYPES))])
        n_tokens = sum(r["T"] for r in run.records)
        mass = [sum(r["chain"]["types"][i] for r in run.records) / n_tokens for i in range(len(TYPES))]
        rows.append(["*share of chain tokens*", "100"] + [pct(x) for x in mass])
        return table(["method", "tokens kept %"] + [f"{TYPE_LABELS[t]} kept %" for t in TYPES], rows)

    def rank_table(self) -> str:
        r = self.run.records
        rows = []
        for key, label in (("spearman", "Spearman ρ (necessity, sufficiency)"),
                           ("overlap30", "top-30% overlap \\|A∩B\\|/\\|A\\|"),
                           ("jaccard30", "top-30% Jaccard \\|A∩B\\|/\\|A∪B\\|")):
            x = np.array([rec["rank"][key] for rec in r], np.float64)
            paper = PAPER.get(key)
            rows.append([label, with_ci(ci_mean(x, self.idx), 1, 2),
                         f"{paper:.2f}" if paper is not None else "–"])
        return table(["statistic", f"this run (mean over {len(r)} chains, 95% CI)",
                      "paper (100 MATH chains, Qwen2.5-1.5B)"], rows)

    def exact_table(self) -> str | None:
        recs = [r for r in self.run.records if r.get("exact")]
        if not recs:
            return None
        rows = []
        for axis in ("necessity", "sufficiency"):
            for g in (0.3, 0.5):
                agg = np.array([r["exact"][axis][f"aggregated@{g:g}"] for r in recs])
                per = np.array([r["exact"][axis][f"per_layer@{g:g}"] for r in recs])
                rows.append([axis, f"{g:g}", f"{agg.mean():.2f} (min {agg.min():.2f})",
                             f"{per.mean():.2f}", f"{g:g}", f"{PAPER['exact'][(axis, g)]:.2f}"])
        layers = recs[0]["exact"]["layers"]
        Ts = [r["T"] for r in recs]
        head = ["axis", "γ", f"aggregated over blocks {layers}", "per block, mean", "chance",
                "paper (GSM8K, Qwen2.5-1.5B, all layers)"]
        return (table(head, rows) + f"\n\n{len(recs)} chains of {min(Ts)}–{max(Ts)} tokens "
                "(drawn from the shortest quarter of the sample); exact = zeroing (necessity) or "
                "patching (sufficiency) the residual stream, ε = 1, at each listed block; "
                "\"aggregated\" ranks Σ_l c̄_l·|score_l| over those blocks (Eq. 7 restricted to "
                "them), \"per block\" ranks each block's scores alone.")

    def wins_losses(self) -> list[str]:
        """Where another method beats MIST (or loses to it) beyond the paired 95% CI."""
        if not any(variant_name("mist", b) in self.m for b in self.run.budgets):
            return ["- MIST was not evaluated here: nothing to compare with"]
        lines = []
        for what in ("retention", "accuracy") if self.controls else ("accuracy",):
            for b in self.run.budgets:
                better, worse = [], []
                for meth in self.run.methods:
                    key = (what, variant_name(meth, b))
                    if key not in self.vs_mist:
                        continue
                    d, lo, hi = self.vs_mist[key]
                    if lo > 0:
                        better.append(f"`{meth}` (+{100 * d:.0f})")
                    elif hi < 0:
                        worse.append(f"`{meth}` ({100 * d:.0f})")
                lines.append(f"- {what}, γ = {budget_label(b)}: better than MIST: "
                             f"{', '.join(better) or 'none'}; worse than MIST: {', '.join(worse) or 'none'}")
        return lines


# ---------------------------------------------------------------- plots

def _footer(fig, run: Run, extra: str = "") -> None:
    import textwrap

    text = textwrap.fill(run.caption().replace("`", "") + extra, 150)
    fig.text(0.01, 0.005, text, fontsize=6.5, va="bottom", ha="left", color="#444444")


def plot_vs_budget(s: Summary, what: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run = s.run
    data = {"retention": s.retention, "accuracy": s.accuracy}[what]
    fig, ax = plt.subplots(figsize=(9.5, 5.2))
    bs = np.array(run.budgets)
    for i, meth in enumerate(run.methods):
        if meth in ("full", "nochain"):
            m = data[meth][0]
            ax.axhline(100 * m, color="black", ls="--" if meth == "full" else ":", lw=1,
                       label=f"{meth} ({100 * m:.0f})")
            continue
        vals = np.array([data[variant_name(meth, b)] for b in bs]) * 100
        off = (i - len(run.methods) / 2) * 0.003  # keep error bars apart
        ax.errorbar(bs + off, vals[:, 0], yerr=[vals[:, 0] - vals[:, 1], vals[:, 2] - vals[:, 0]],
                    label=meth, color=COLORS.get(meth), marker="o", ms=4, capsize=2,
                    lw=2.5 if meth == "mist" else 1.2)
    ax.set_xlabel("budget γ (share of chain tokens kept)")
    ax.set_ylabel({"retention": "retention of Eq. 1, % (ratio of means)",
                   "accuracy": "greedy answer accuracy, %"}[what])
    ax.set_title(f"{run.name}: {what} against budget ({run.meta['model_name']}, n = {len(run.records)})")
    ax.set_xticks(bs)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7.5, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.subplots_adjust(bottom=0.2, right=0.8)
    _footer(fig, run, "; bars: 95% bootstrap CI over chains")
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_types(s: Summary, budget: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run = s.run
    meths = [m for m in run.methods if m not in ("full", "nochain")]
    if not meths:  # only the ends: no method prunes anything
        return
    fig, ax = plt.subplots(figsize=(11, 5))
    width = 0.8 / len(meths)
    x = np.arange(len(TYPES))
    for i, meth in enumerate(meths):
        v = s.m[variant_name(meth, budget)]
        ax.bar(x + i * width - 0.4 + width / 2, 100 * nanmean(v.types, 0), width,
               label=meth, color=COLORS.get(meth))
    ax.axhline(100 * budget, color="black", ls=":", lw=1, label=f"γ = {budget_label(budget)}")
    ax.set_xticks(x)
    ax.set_xticklabels([TYPE_LABELS[t].replace(" (", "\n(").replace("/", "/\n").replace(" words", "\nwords")
                        for t in TYPES], fontsize=8)
    ax.set_ylabel("share of the chain's tokens of this type kept, %")
    ax.set_title(f"{run.name}: what each method keeps at γ = {budget_label(budget)} "
                 f"({run.meta['model_name']}, n = {len(run.records)})")
    ax.legend(fontsize=7.5, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(axis="y", alpha=0.3)
    fig.subplots_adjust(bottom=0.24, right=0.84)
    _footer(fig, run)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------- the report

def corpus_section(s: Summary, out: Path, figs: str) -> list[str]:
    run, c = s.run, s.run.meta["config"]
    name = run.name
    if s.controls:
        plot_vs_budget(s, "retention", out / f"{name}_retention.png")
    plot_vs_budget(s, "accuracy", out / f"{name}_accuracy.png")
    mid = 0.5 if 0.5 in run.budgets else run.budgets[len(run.budgets) // 2]
    plot_types(s, mid, out / f"{name}_types.png")
    n_exact = sum(1 for r in run.records if r.get("exact"))
    secs = run.meta.get("seconds", {})
    lines = [
        f"## {name}", "",
        f"- model: `{run.meta['model_name']}` ({c['dtype']}, template `{c['template']}`); corpus: "
        f"{', '.join(f'`{i}`' for i in c['input'])} with the `{c['adapter']}` adapter, "
        f"{run.meta['corpus_valid']} valid rows",
        f"- sample: {len(run.records)} chains evaluated (seed {c['seed']}; "
        f"{sum(run.rejected.values())} rejected{': ' + str(run.rejected) if run.rejected else ''}), "
        f"mean chain length {np.mean([r['T'] for r in run.records]):.0f} tokens; "
        f"{n_exact} of them for exact interventions",
        f"- pruning unit: {c['unit']}; budgets {', '.join(map(budget_label, run.budgets))}; "
        f"MIST α = {c['alpha']}; answers decoded greedily, at most len(gold) + "
        f"{c['extra_new']} tokens, normalised as `{run.records[0]['style'] if run.records else '?'}`",
        f"- command: `{run.meta['command']}`"
        + (f" ({secs['evaluate'] / 60:.0f} min for {secs.get('chains_this_run', '?')} chains in its last run)"
           if secs.get("evaluate") else ""),
    ]
    if run.unavailable:
        lines.append("- not evaluated (unavailable here): " + "; ".join(
            f"`{k}`: {v.splitlines()[0][:160]}" for k, v in run.unavailable.items()))
    lines += ["", "### The paper's objective (Eq. 1)", ""]
    if s.controls:
        lines += [
            "Retention `(LL(c') − LL(∅)) / (LL(c) − LL(∅))` in %, as a ratio of means over chains "
            "(per-chain ratios explode where the chain barely moves the answer), "
            f"95% bootstrap CI. `full` = 100, `nochain` = 0 by definition. LL(c) = "
            f"{s.ll['full'][0]:.2f}, LL(∅) = {s.ll['nochain'][0]:.2f} nats (mean log p of the answer).", "",
            s.per_budget(s.retention, lambda t: with_ci(t)), "",
            f"![retention]({figs}{name}_retention.png)", "",
            f"*Figure: retention against budget. {run.caption()}.*", ""]
    else:
        lines += [f"Note: {s.missing_note}.", ""]
    lines += [
        "Mean `log p(a | x, c')` in nats:", "",
        s.per_budget(s.ll, lambda t: with_ci(t, 1, 2)), "",
        "### Answer accuracy", "",
        "Greedy answer after the compressed chain (`The answer is ` then decoding), % correct, 95% CI.", "",
        s.per_budget(s.accuracy, lambda t: with_ci(t)), "",
        f"![accuracy]({figs}{name}_accuracy.png)", "",
        f"*Figure: accuracy against budget. {run.caption()}.*", "",
        "### Reasoning kept", "",
        "Share of the chain's intermediate results that survive whole (" +
        ("the number right after each `=`" if (run.records and run.records[0]["style"] == "gsm8k")
         else "each right-hand side of `=` inside math") +
        ") / share of number tokens kept / share of chains whose last statement of the gold "
        "answer survives whole, %. Read next to Eq. 1: a method can keep the answer's likelihood "
        "by keeping the line that states it and drop the reasoning.", "",
        s.kept_table(), "",
        f"How much of accuracy is keeping that one statement (γ = {budget_label(mid)}):", "",
        s.accuracy_given_answer(mid), "",
        f"### Token types kept at γ = {budget_label(mid)}", "",
        "Share of each type's tokens that the method keeps, % (the paper's taxonomy; the last row is "
        "each type's share of all chain tokens).", "",
        s.types_table(mid), "",
        *([f"![types]({figs}{name}_types.png)", "",
           f"*Figure: token-type profile at γ = {budget_label(mid)}. {run.caption()}.*", ""]
          if (out / f"{name}_types.png").exists() else []),
        "### Necessity vs sufficiency", "",
        s.rank_table(), "",
    ]
    ex = s.exact_table()
    if ex:
        lines += ["### First-order vs exact interventions", "", "Top-γ agreement "
                  "|top(first-order) ∩ top(exact)| / ⌈γT⌉ by magnitude.", "", ex, ""]
    lines += ["### Where MIST wins and loses (paired 95% CI excludes 0; differences in points)", ""]
    lines += s.wins_losses() + [""]
    return lines


def headline(summaries: list[Summary], budget: float) -> list[str]:
    rows = []
    meths = [m for m in ALL_METHODS if any(m in s.run.methods for s in summaries)]
    for meth in meths:
        row = [f"`{meth}`"]
        for s in summaries:
            name = meth if meth in ("full", "nochain") else variant_name(meth, budget)
            if name not in s.m:
                row += ["–"] * 4
                continue
            row += [with_ci(s.retention.get(name, (np.nan,) * 3)), with_ci(s.accuracy[name]),
                    pct(nanmean(s.m[name].results)), pct(nanmean(s.m[name].answer))]
        rows.append(row)
    head = ["method"]
    for s in summaries:
        head += [f"{s.run.name} retention %", f"{s.run.name} accuracy %",
                 f"{s.run.name} results kept %", f"{s.run.name} answer kept %"]
    return [table(head, rows)]


def console_table(folder: str | Path) -> str:
    """The headline numbers of one evaluation folder as terminal text: per method (rows)
    and budget (columns), the retention of Eq. 1 and the answer accuracy, in %, as point
    estimates (the report gives their intervals).

    Args:
        folder: what `mist eval` wrote (run.json, results.jsonl).

    Returns:
        The table and a line saying what it shows, ending with a newline."""
    run = Run.load(folder)
    if not run.records:
        return f"no chain evaluated in {folder}: no numbers to show\n"
    m = measures(run)
    controls = all(e in m for e in ENDS)
    if controls:
        ll0, ll1 = m["nochain"].ll, m["full"].ll

    def cell(name: str) -> str:
        if name not in m:
            return "–"
        v = m[name]
        if not controls:
            return pct(np.mean(v.correct))
        return f"{pct(np.mean(v.ll - ll0) / np.mean(ll1 - ll0))} / {pct(np.mean(v.correct))}"

    width = max(len(meth) for meth in run.methods) + 2
    lines = [" " * width + "".join(f"{'γ ' + budget_label(b):>12}" for b in run.budgets)]
    for meth in run.methods:
        cells = [cell(meth)] if meth in ENDS else [cell(variant_name(meth, b)) for b in run.budgets]
        lines.append(meth.ljust(width) + "".join(f"{c:>12}" for c in cells)
                     + ("   (no budget)" if meth in ENDS else ""))
    what = "retention of Eq. 1 % / greedy answer accuracy %" if controls else \
        "greedy answer accuracy % (retention needs full and nochain in --methods)"
    lines.append(f"{what}, over {len(run.records)} chains; intervals and the other measures: "
                 f"mist report {folder}")
    return "\n".join(lines) + "\n"


def write_report(folders: list[str], out: Path, n_boot: int = 2000, seed: int = 0,
                 notes: Path | None = None, saliency: str | None = None,
                 command: str = "") -> Path:
    runs = [Run.load(f) for f in folders]
    summaries = [Summary.of(r, n_boot, seed) for r in runs]
    out.mkdir(parents=True, exist_ok=True)  # after the reading: a bad folder leaves nothing
    figs = ""  # figures sit next to quality.md
    budget = 0.5 if all(0.5 in r.budgets for r in runs) else runs[0].budgets[0]
    lines = [
        "# Compression quality: MIST against its ablations and baselines", "",
        f"Generated by `{command}` from the stored results in "
        + ", ".join(f"`{r.folder}`" for r in runs) + "; rerun it to regenerate this page "
        "and its figures (no model needed). The evaluations themselves are rerun with the "
        "command given in each section.", "",
        "What is measured, per method and budget γ (the share of chain tokens kept): Eq. 1 "
        "(`log p(a | x, c')` of exactly the kept tokens) and its retention, the greedy answer's "
        "accuracy after the compressed chain, the share of intermediate results and number tokens "
        "kept, and the types of tokens kept. `head`/`tail` keep the first/last ⌈γT⌉ tokens; "
        "`full`/`nochain` are the two ends. Intervals are 95% bootstrap CIs over chains.", "",
        f"## Headline at γ = {budget_label(budget)}", "",
    ]
    lines += headline(summaries, budget) + [""]
    lines += [f"Note: in {s.run.name}, {s.missing_note}." for s in summaries if not s.controls]
    lines += [""] if lines[-1] else []
    if notes is not None and notes.exists():
        lines += [notes.read_text().strip(), ""]
    if saliency:
        lines += ["## A chain, shaded", "", saliency, ""]
    for s in summaries:
        lines += corpus_section(s, out, figs)
    path = out / "quality.md"
    path.write_text("\n".join(lines).rstrip() + "\n", encoding="utf-8")
    return path


class ReportConfig(Kit):
    """`mist report`'s settings."""

    folders: list[str] = setting(..., "results folders written by `mist eval`", group="input",
                                 positional=True, many=True)
    out: str = setting("docs/results", "where quality.md and the PNGs go", group="output",
                       metavar="DIR")
    notes: str | None = setting(None, "a markdown file of discussion to include (default: "
                                "<out>/notes.md if any)", group="output", metavar="FILE",
                                shown="")
    saliency: str | None = setting(None, "markdown to include for the saliency picture "
                                   "(default: a link to <out>/saliency.png/.html if present)",
                                   group="output", metavar="TEXT", shown="")
    boot: int = setting(2000, "bootstrap draws", group="statistics", metavar="N")
    seed: int = setting(0, "bootstrap seed", group="statistics")

    _positive = positive("boot")


def main(argv: list[str] | None = None, prog: str = "mist report") -> int:
    """`mist report`: write quality.md and its figures from stored evaluation results.

    Args:
        argv: the command line after the program's name (default: sys.argv[1:]).
        prog: the program's name in --help and in the page's "Generated by".

    Returns:
        The exit status: 0, or 2 for a folder that holds no evaluation."""
    argv = sys.argv[1:] if argv is None else list(argv)
    def body() -> int:
        a = parse(ReportConfig, argv, prog, __doc__.split("\n\n")[0])
        out = Path(a.out)
        notes = Path(a.notes) if a.notes else out / "notes.md"
        sal = a.saliency
        if sal is None and (out / "saliency.png").exists():
            sal = ("What MIST sees in one GSM8K chain: tokens shaded by necessity, sufficiency "
                   "and the unified score, and what each budget keeps ([interactive HTML]"
                   "(saliency.html)).\n\n![saliency](saliency.png)")
        path = write_report(a.folders, out, a.boot, a.seed, notes, sal,
                            command=f"{prog} {shlex.join(argv)}")
        print(f"wrote {path}")
        return 0

    return exits.run_main(body)


if __name__ == "__main__":
    sys.exit(main())
