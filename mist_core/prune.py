"""Pruning: scores become compressed chains, several budgets from one scoring."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .examples import Example

_WORD = re.compile(r"\S+")
_DIGIT = re.compile(r"\d")


@dataclass
class Compressed:
    budget: float
    kept: np.ndarray  # bool [T], chain tokens kept
    text: str

    @property
    def kept_tokens(self) -> int:
        return int(self.kept.sum())

    @property
    def cot_tokens(self) -> int:
        return len(self.kept)


def budget_tokens(budget: float, T: int) -> int:
    """⌈γ·T⌉, immune to float noise (0.7 · 10 is 7.000000000000001)."""
    if not 0.0 < budget <= 1.0:
        raise ValueError(f"budget must lie in (0, 1], not {budget}")
    return min(T, max(1, math.ceil(budget * T - 1e-9)))


def token_pieces(cot: str, offsets: np.ndarray) -> list[str]:
    """Cut the chain into one piece per token: each token owns its characters and any gap
    (whitespace the tokenizer left uncovered) before them. Joining every piece gives the
    chain back, so kept pieces are always original text."""
    pieces, prev = [], 0
    for _, stop in offsets:
        stop = max(int(stop), prev)
        pieces.append(cot[prev:stop])
        prev = stop
    if pieces:
        pieces[-1] += cot[prev:]
    return pieces


def word_units(cot: str, offsets: np.ndarray) -> np.ndarray:
    """The word each token belongs to, by character offsets: a token goes to the word that
    holds its first non-space character; a whitespace-only token goes with the word after it
    (so dropping a word drops the space before it and never fuses its neighbours), or is a
    unit of its own at the end of the chain."""
    words = [m.span() for m in _WORD.finditer(cot)]
    starts = np.array([w[0] for w in words] + [len(cot) + 1])
    unit = np.empty(len(offsets), dtype=np.int64)
    for i, (start, stop) in enumerate(offsets):
        text = cot[start:stop]
        if text.strip():
            lead = len(text) - len(text.lstrip())
            unit[i] = int(np.searchsorted(starts, start + lead, side="right") - 1)
        else:
            unit[i] = -1
    following = len(words)  # past the last word: whitespace tokens there form one unit
    for i in range(len(offsets) - 1, -1, -1):
        if unit[i] < 0:
            unit[i] = following
        else:
            following = unit[i]
    return unit


def _select(unit_scores: np.ndarray, unit_sizes: np.ndarray, forced: np.ndarray, k: int) -> np.ndarray:
    """Highest-scoring units first while the token count stays within k; forced units
    always. Ties go to the earlier unit."""
    chosen = forced.copy()
    count = int(unit_sizes[chosen].sum())
    for u in np.argsort(-unit_scores, kind="stable"):
        if chosen[u]:
            continue
        if count + unit_sizes[u] <= k:
            chosen[u] = True
            count += int(unit_sizes[u])
            if count == k:
                break
    return chosen


def prune(example: Example, scored, budgets: Sequence[float] = (0.5,), unit: str = "token",
          keep_digits: bool = False) -> list[Compressed]:
    """For each budget γ keep ⌈γ·T⌉ chain tokens with the highest scores, in original order.
    `scored`: a ScoredChain (its `scores` and `chain_offsets`); prune_scores takes the two
    arrays themselves.

    unit="word" ranks whole words (the mean of their pieces' scores) and keeps as many as
    fit the same token budget, so a word is never cut. keep_digits keeps every token with
    a digit whatever its score (it may then exceed the budget)."""
    return prune_scores(example, scored.scores, scored.chain_offsets, budgets, unit, keep_digits)


def prune_scores(example: Example, scores, offsets, budgets: Sequence[float] = (0.5,),
                 unit: str = "token", keep_digits: bool = False) -> list[Compressed]:
    """prune() on per-token `scores` [T] and the chain tokens' character `offsets` [T, 2]."""
    if unit not in ("token", "word"):
        raise ValueError(f"unit must be 'token' or 'word', not {unit!r}")
    scores = np.asarray(scores, dtype=np.float64)
    offsets = np.asarray(offsets).reshape(-1, 2)
    T = len(scores)
    cot = example.cot
    pieces = token_pieces(cot, offsets)
    units = np.arange(T) if unit == "token" else word_units(cot, offsets)
    _, units = np.unique(units, return_inverse=True)
    n_units = int(units.max()) + 1
    sizes = np.bincount(units, minlength=n_units)
    unit_scores = np.bincount(units, weights=scores, minlength=n_units) / sizes
    digit = np.array([bool(_DIGIT.search(p)) for p in pieces]) if keep_digits else np.zeros(T, bool)
    forced = np.bincount(units, weights=digit, minlength=n_units) > 0
    out = []
    for budget in budgets:
        chosen = _select(unit_scores, sizes, forced, budget_tokens(budget, T))
        kept = chosen[units]
        text = "".join(p for p, k in zip(pieces, kept) if k).strip()
        out.append(Compressed(budget=float(budget), kept=kept, text=text))
    return out
