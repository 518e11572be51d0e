"""Pruning: scores become compressed chains, several budgets from one scoring."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..data.examples import Example

_WORD = re.compile(r"\S+")
_DIGIT = re.compile(r"\d")
# A number: digits with inner `,` or `.` (12, 1,250, 3.75). Tokenizers that write a digit a
# token (Llama 3, Qwen2, SmolLM2) would otherwise let pruning keep `1` of `16`.
NUMBER = re.compile(r"\d+(?:[.,]\d+)*")
# An equation over numbers: operands and operators, then one or more `= result`
# (`16 - 3 - 4 = 9`, `9 * 2 = $18`, `(3+4)*2=14`, `20% of`, not `x = 2`).
_TERM = r"\(*[$€£]?\d+(?:[.,]\d+)*%?\)*"
EQUATION = re.compile(rf"{_TERM}(?:\s*[-+*/×÷^]\s*{_TERM})+(?:\s*=\s*{_TERM})+")
UNITS = ("token", "word", "equation")
# A sentence: text up to and including its end (`.`, `!` or `?` before whitespace or the
# chain's end, or a line break). A decimal point (`3.75`) ends none.
SENTENCE = re.compile(r"[^\n]*?(?:[.!?]+(?=\s|$)|\n|$)")
# What a sentence must hold not to be dropped whole by sentences_first: an equation (an `=`:
# real chains write `4 * 20 sheep = 80 sheep`, `$10 x 1.2 = $12`, `30*.5=15`, which EQUATION
# misses), or a fact (a number or an operator).
SENTENCE_KEEPS = ("equations", "facts")
# An arithmetic operator standing alone (a token's or a word's whole text): with the numbers,
# the facts facts_first keeps ahead of the words around them.
OPERATORS = frozenset("+-*/=×÷^")


def is_fact(text: str) -> bool:
    """Whether a token's or a word's text holds a number's digit or is an arithmetic operator
    standing alone: the facts that facts_first keeps first."""
    return bool(_DIGIT.search(text)) or text.strip() in OPERATORS


def fact_tokens(cot: str, offsets) -> np.ndarray:
    """bool [T]: the chain tokens (character `offsets` [T, 2] in `cot`) that are facts (is_fact).

    Examples:
        >>> fact_tokens("so 12 + 3", [[0, 2], [2, 5], [5, 7], [7, 9]]).tolist()
        [False, True, True, True]
    """
    return np.array([is_fact(cot[a:b]) for a, b in np.asarray(offsets).reshape(-1, 2)], dtype=bool)


@dataclass
class Compressed:
    """One compressed chain: what prune keeps of a chain at one budget.

    Attributes:
        budget: the budget γ, the share of the chain's tokens kept at most (see prune).
        kept: bool [T], which chain tokens are kept.
        text: the kept tokens' text, in their original order (original characters only).
        kept_tokens: how many tokens are kept (a property).
        cot_tokens: the chain's tokens T (a property).

    Examples:
        >>> import numpy as np
        >>> from mist_core import Compressed
        >>> c = Compressed(budget=0.5, kept=np.array([False, True, True, False]), text="3 + 4")
        >>> c.kept_tokens, c.cot_tokens
        (2, 4)
    """

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


def merge_spans(units: np.ndarray, offsets: np.ndarray, spans) -> np.ndarray:
    """Units (non-decreasing along the chain, as word_units gives them) where the tokens
    overlapping each character span in `spans`, and every token of the units they touch,
    become one unit, so that the span is kept or dropped whole. Stays non-decreasing."""
    units = np.array(units, dtype=np.int64)
    starts = offsets[:, 0]
    stops = np.maximum.accumulate(offsets[:, 1]) if len(offsets) else offsets[:, 1]
    for a, b in spans:
        first = int(np.searchsorted(stops, a, side="right"))  # first token ending after a
        last = int(np.searchsorted(starts, b, side="left")) - 1  # last token starting before b
        if last > first and units[first] != units[last]:
            lo = int(np.searchsorted(units, units[first], side="left"))
            hi = int(np.searchsorted(units, units[last], side="right"))
            units[lo:hi] = units[first]
    return units


def sentence_ids(cot: str, offsets: np.ndarray) -> np.ndarray:
    """The sentence (SENTENCE) each token belongs to, [T], by the character it starts its
    non-space text at; a whitespace-only token goes with the sentence after it.

    Examples:
        >>> sentence_ids("He loses 6. So 3.5 left.", [[0, 2], [2, 8], [8, 10], [10, 11],
        ...                                          [11, 14], [14, 18], [18, 23], [23, 24]]).tolist()
        [0, 0, 0, 0, 1, 1, 1, 1]
    """
    offsets = np.asarray(offsets).reshape(-1, 2)
    ends = [m.end() for m in SENTENCE.finditer(cot) if m.end() > m.start()]
    ends = np.array(ends or [len(cot)])
    first = []
    for start, stop in offsets:
        text = cot[start:stop]
        first.append(start + len(text) - len(text.lstrip()) if text.strip() else stop)
    return np.minimum(np.searchsorted(ends, np.array(first, dtype=np.int64), side="right"),
                      len(ends) - 1)


def pruning_units(cot: str, offsets: np.ndarray, unit: str = "token") -> np.ndarray:
    """The unit each chain token is kept or dropped with, [T] (equal ids: one unit).

    Args:
        cot: the chain's text.
        offsets: the chain tokens' character offsets in `cot`, [T, 2].
        unit: "token" (each token alone), "word" (whitespace-separated words) or "equation"
            (words, with each equation's operands, operators and results one unit). At every
            unit a number (digits with inner `,` or `.`) is one unit, whatever the tokenizer.

    Returns:
        An int array [T]; tokens with the same value form one unit.

    Examples:
        >>> import numpy as np
        >>> pruning_units("has 16 eggs", np.array([[0, 3], [3, 5], [5, 6], [6, 11]])).tolist()
        [0, 1, 1, 3]
    """
    if unit not in UNITS:
        raise ValueError(f"unit must be one of {', '.join(UNITS)}, not {unit!r}")
    offsets = np.asarray(offsets).reshape(-1, 2)
    units = np.arange(len(offsets)) if unit == "token" else word_units(cot, offsets)
    spans = [m.span() for m in NUMBER.finditer(cot)]
    if unit == "equation":
        spans += [m.span() for m in EQUATION.finditer(cot)]
    return merge_spans(units, offsets, spans)


def cut_numbers(cot: str, offsets: np.ndarray, kept: np.ndarray) -> int:
    """How many of the chain's numbers `kept` keeps in part (some of their tokens, not all)."""
    offsets = np.asarray(offsets).reshape(-1, 2)
    kept = np.asarray(kept, dtype=bool)
    cut = 0
    for m in NUMBER.finditer(cot):
        a, b = m.span()
        inside = kept[(offsets[:, 0] < b) & (offsets[:, 1] > a)]
        cut += int(inside.any() and not inside.all())
    return cut


def _select(unit_scores: np.ndarray, unit_sizes: np.ndarray, forced: np.ndarray, k: int,
            first: np.ndarray | None = None, barred: np.ndarray | None = None) -> np.ndarray:
    """Highest-scoring units first while the token count stays within k (the `first` units
    ahead of all others, best first among them); forced units always, `barred` ones never;
    the best unit where none fits (a chain of one long number). Ties go to the earlier unit."""
    chosen = forced.copy()
    count = int(unit_sizes[chosen].sum())
    first = np.zeros(len(unit_scores), bool) if first is None else first
    barred = np.zeros(len(unit_scores), bool) if barred is None else barred
    for u in np.lexsort((np.arange(len(unit_scores)), -unit_scores, ~first)):
        if chosen[u] or barred[u]:
            continue
        if count + unit_sizes[u] <= k:
            chosen[u] = True
            count += int(unit_sizes[u])
            if count == k:
                break
    if not chosen.any() and len(chosen):  # not one unit fits: the best one, over the budget
        chosen[int(np.argmax(np.where(barred, -np.inf, unit_scores)))] = True
    return chosen


def _dropped_sentences(cot: str, offsets: np.ndarray, scores: np.ndarray, k: int,
                       keep: str) -> np.ndarray:
    """bool [T]: the tokens of the sentences dropped whole on the way to k tokens: sentences
    without an equation (keep "equations": an `=`) or without a fact (keep "facts": a number
    or an operator), lowest mean score first, each where at least k tokens are left without
    it (sentences_first)."""
    sentence = sentence_ids(cot, offsets)
    n = int(sentence.max()) + 1 if len(sentence) else 0
    sizes = np.bincount(sentence, minlength=n)
    means = np.bincount(sentence, weights=scores, minlength=n) / np.maximum(sizes, 1)
    computes = np.zeros(n, bool)
    holds = (fact_tokens(cot, offsets) if keep == "facts"
             else np.array([("=" in cot[a:b]) for a, b in offsets], dtype=bool))
    computes[np.unique(sentence[holds])] = True
    dropped, left = np.zeros(n, bool), len(sentence)
    for s in np.lexsort((np.arange(n), means)):
        if sizes[s] and not computes[s] and left - sizes[s] >= k:
            dropped[s] = True
            left -= int(sizes[s])
    return dropped[sentence]


def prune(example: Example, scored, budgets: Sequence[float] = (0.5,), unit: str = "token",
          keep_digits: bool = False, facts_first: bool = False,
          equations_first: bool = False, sentences_first: str | None = None) -> list[Compressed]:
    """For each budget γ keep ⌈γ·T⌉ chain tokens with the highest scores, in original order.

    A unit (pruning_units) scores the mean of its tokens' scores; units are taken best first
    while they fit the token budget, so a unit is never cut and a number never loses a
    digit. unit="token" keeps exactly ⌈γ·T⌉ tokens unless only multi-token numbers are left
    to fill the last places; "word" and "equation" keep at most that many. keep_digits keeps
    every unit with a digit whatever its score (it may then exceed the budget). facts_first
    takes the units that hold a number or are an arithmetic operator (`+ - * / = × ÷ ^`)
    before any other, best first, within the budget: the score then decides which words
    around the facts stay (LLMLingua-2's force_reserve_digit, kept to the budget).
    equations_first takes the units in an equation over numbers (EQUATION: `16 - 3 = 13`)
    first instead: the chain's computations, not every number it restates. sentences_first
    drops whole sentences before cutting into any: the chain's sentences without an equation
    (an `=`: "equations") or without a number or an operator ("facts") go whole, lowest
    mean score first, each where the budget's tokens are left without it; the budget is then
    filled from what is left as above (so more of what stays reads as sentences).

    Args:
        example: the example whose chain (`example.cot`) is pruned.
        scored: its ScoredChain (its `scores` and `chain_offsets`); prune_scores takes the
            two arrays themselves.
        budgets: the budgets γ, each in (0, 1]: the share of the chain's T tokens to keep.
        unit: what is kept or dropped whole: "token", "word" or "equation" (words, with
            each equation's operands, operators and results one unit); at every unit a
            number is one unit.
        keep_digits: keep every unit with a digit, whatever its score.
        facts_first: take the units with a number or an operator first, within the budget.
        equations_first: take the units of the chain's equations first, within the budget.
        sentences_first: None, or drop whole sentences without an equation (an `=`,
            "equations") or without a fact ("facts"), lowest mean score first, before
            cutting into any, as long as the budget's tokens are left.

    Returns:
        One Compressed per budget, in the order of `budgets`.

    Raises:
        ValueError: a budget outside (0, 1], an unknown unit, or both facts_first and
            equations_first.

    Examples:
        >>> from mist_core import Example, MistScorer, prune, wrap_model
        >>> from mist_core.distill.synthetic import build_tokenizer, tiny_llama, vocabulary_texts
        >>> tokenizer = build_tokenizer(vocabulary_texts())  # word-level, no download
        >>> lm = wrap_model(tiny_llama(tokenizer, layers=2, hidden=32), tokenizer, "tiny")
        >>> ex = Example("Ann has 3 apples. She buys 4 more apples. How many apples does Ann "
        ...              "have?", "She buys 4 more, so 3 + 4 = 7.", "7")
        >>> [chain] = MistScorer(lm).score([ex])
        >>> out = prune(ex, chain, budgets=(0.5, 0.75, 1.0))
        >>> [(c.budget, c.kept_tokens, c.cot_tokens) for c in out]
        [(0.5, 6, 12), (0.75, 9, 12), (1.0, 12, 12)]
        >>> out[-1].text
        'She buys 4 more, so 3 + 4 = 7.'

        The equation is one unit, and with keep_digits it is kept whole, over the budget:

        >>> [c] = prune(ex, chain, budgets=(0.5,), unit="equation", keep_digits=True)
        >>> c.kept_tokens, c.text
        (7, '4 3 + 4 = 7.')

        With facts_first the numbers and operators go first, within the budget:

        >>> [c] = prune(ex, chain, budgets=(0.5,), facts_first=True)
        >>> c.kept_tokens, c.text
        (6, '4 3 + 4 = 7')
    """
    return prune_scores(example, scored.scores, scored.chain_offsets, budgets, unit, keep_digits,
                        facts_first, equations_first, sentences_first)


def prune_scores(example: Example, scores, offsets, budgets: Sequence[float] = (0.5,),
                 unit: str = "token", keep_digits: bool = False,
                 facts_first: bool = False, equations_first: bool = False,
                 sentences_first: str | None = None) -> list[Compressed]:
    """prune() on per-token `scores` [T] and the chain tokens' character `offsets` [T, 2]
    (any scorer's, or scores of one's own).

    Args:
        example: the example whose chain is pruned.
        scores: [T] one score per chain token, higher kept first.
        offsets: [T, 2] each chain token's character span in `example.cot`.
        budgets, unit, keep_digits, facts_first, equations_first, sentences_first: as in
            prune.

    Returns:
        One Compressed per budget.

    Raises:
        ValueError: a budget outside (0, 1], an unknown unit or sentences_first.

    Examples:
        >>> from mist_core import Example
        >>> ex = Example("What is 2 + 2?", "so 2 + 2 = 4", "4")
        >>> offsets = [[0, 2], [2, 4], [4, 6], [6, 8], [8, 10], [10, 12]]
        >>> [c.text for c in prune_scores(ex, [0, 1, 0, 1, 0, 1], offsets, (0.5, 1.0))]
        ['2 2 4', 'so 2 + 2 = 4']
    """
    scores = np.asarray(scores, dtype=np.float64)
    offsets = np.asarray(offsets).reshape(-1, 2)
    T = len(scores)
    cot = example.cot
    pieces = token_pieces(cot, offsets)
    units = pruning_units(cot, offsets, unit)
    _, units = np.unique(units, return_inverse=True)
    n_units = int(units.max()) + 1
    sizes = np.bincount(units, minlength=n_units)
    unit_scores = np.bincount(units, weights=scores, minlength=n_units) / sizes

    def holding(piece_test) -> np.ndarray:  # bool [n_units]: a piece of the unit passes
        passed = [bool(piece_test(p)) for p in pieces]
        return np.bincount(units, weights=passed, minlength=n_units) > 0

    forced = holding(_DIGIT.search) if keep_digits else np.zeros(n_units, bool)
    if facts_first and equations_first:
        raise ValueError("facts_first and equations_first exclude each other")
    if sentences_first not in (None, False) + SENTENCE_KEEPS:
        raise ValueError(f"sentences_first must be one of {', '.join(SENTENCE_KEEPS)} or None, "
                         f"not {sentences_first!r}")
    first = holding(is_fact) if facts_first else None
    if equations_first:
        inside = np.zeros(T, bool)
        for m in EQUATION.finditer(cot):
            inside |= (offsets[:, 0] < m.end()) & (offsets[:, 1] > m.start())
        first = np.bincount(units, weights=inside, minlength=n_units) > 0
    out = []
    for budget in budgets:
        k = budget_tokens(budget, T)
        barred = None
        if sentences_first:
            dropped = _dropped_sentences(cot, offsets, scores, k, sentences_first)
            barred = np.bincount(units, weights=dropped, minlength=n_units) > 0
        chosen = _select(unit_scores, sizes, forced, k, first, barred)
        if barred is not None and sizes[chosen].sum() > k:  # what was left had no unit to fit
            chosen = _select(unit_scores, sizes, forced, k, first)
        kept = chosen[units]
        text = "".join(p for p, keep in zip(pieces, kept) if keep).strip()
        out.append(Compressed(budget=float(budget), kept=kept, text=text))
    return out
