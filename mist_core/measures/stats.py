"""Corpus-level statistics of the evaluation and the distillation loop: rank correlation and
top-k overlap of score vectors, first-order vs exact agreement, bootstrap confidence
intervals. numpy and scipy only (the report reads stored results without a model)."""
from __future__ import annotations

from typing import Sequence

import numpy as np
from scipy.stats import rankdata, spearmanr

from ..scoring.prune import budget_tokens

def ranks(x: np.ndarray) -> np.ndarray:
    """Ranks 1..n, ties getting their mean rank."""
    return rankdata(np.asarray(x, dtype=np.float64), method="average")


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman's ρ (Pearson correlation of the tie-averaged ranks); nan if either is
    constant."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if len(a) < 2 or np.ptp(a) == 0 or np.ptp(b) == 0:
        return float("nan")
    return float(spearmanr(a, b).statistic)


def top_set(scores: np.ndarray, frac: float) -> set:
    """The ⌈frac·T⌉ highest scores' indices (ties to the earlier token, as pruning does)."""
    k = budget_tokens(frac, len(scores))
    return set(np.argsort(-np.asarray(scores, dtype=np.float64), kind="stable")[:k].tolist())


def top_overlap(a: np.ndarray, b: np.ndarray, frac: float = 0.3) -> tuple[float, float]:
    """(|A∩B|/|A|, |A∩B|/|A∪B|) of the top-frac sets of two score vectors."""
    A, B = top_set(a, frac), top_set(b, frac)
    return len(A & B) / len(A), len(A & B) / len(A | B)


def exact_agreement(first: np.ndarray, exact: np.ndarray, gammas: Sequence[float],
                    weights: np.ndarray | None = None) -> dict:
    """Top-γ agreement |top(first) ∩ top(exact)| / k between per-layer first-order and
    exact scores ([L, T] each, ranked by magnitude). `per_layer`: the mean over layers;
    `aggregated`: on Σ_l w_l·|score_l| (Eq. 7 over these layers) when weights are given."""
    out = {}
    for g in gammas:
        per = [top_overlap(np.abs(f), np.abs(e), g)[0] for f, e in zip(first, exact)]
        out[f"per_layer@{g:g}"] = float(np.mean(per))
        if weights is not None:
            w = np.asarray(weights)[:, None]
            out[f"aggregated@{g:g}"] = top_overlap((w * np.abs(first)).sum(0),
                                                   (w * np.abs(exact)).sum(0), g)[0]
    return out


# ---------------------------------------------------------------- confidence intervals
# Percentile bootstrap written out rather than scipy.stats.bootstrap: the reports draw the
# example indices once and reuse them for every method and budget, which makes their
# differences paired; scipy's resamples inside each call.

def bootstrap_indices(n: int, n_boot: int = 2000, seed: int = 0) -> np.ndarray:
    """[n_boot, n] resampled example indices. Using the same draws for every method makes
    differences between methods paired."""
    return np.random.default_rng(seed).integers(0, n, size=(n_boot, n))


def ci_mean(x: np.ndarray, idx: np.ndarray, level: float = 0.95) -> tuple[float, float, float]:
    """(mean, low, high): percentile bootstrap over examples; nan entries (an example the
    measure does not apply to) are left out of each draw."""
    x = np.asarray(x, dtype=np.float64)
    if np.all(np.isnan(x)):
        return (float("nan"),) * 3
    with np.errstate(invalid="ignore", divide="ignore"):
        draws = np.nanmean(x[idx], axis=1)
    lo, hi = np.nanpercentile(draws, [50 * (1 - level), 50 * (1 + level)])
    return float(np.nanmean(x)), float(lo), float(hi)


def ci_ratio(num: np.ndarray, den: np.ndarray, idx: np.ndarray,
             level: float = 0.95) -> tuple[float, float, float]:
    """(mean(num)/mean(den), low, high): a ratio of means, bootstrapped over examples.
    Retention is reported this way because a per-example ratio explodes on chains whose
    full chain barely moves the answer's likelihood (LL(c) ≈ LL(∅))."""
    num, den = np.asarray(num, np.float64), np.asarray(den, np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        draws = num[idx].mean(1) / den[idx].mean(1)
    lo, hi = np.nanpercentile(draws, [50 * (1 - level), 50 * (1 + level)])
    return float(num.mean() / den.mean()), float(lo), float(hi)
