import math
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from mist_core import Example, MistScorer, prune
from mist_core.prune import budget_tokens, token_pieces, word_units


def _is_subsequence(kept: str, original: str) -> bool:
    it = iter(original)
    return all(ch in it for ch in kept)


def test_budget_is_ceil_without_float_noise():
    assert budget_tokens(0.7, 10) == 7  # 0.7 * 10 == 7.000000000000001
    assert budget_tokens(0.3, 10) == 3
    assert budget_tokens(0.01, 10) == 1
    assert budget_tokens(1.0, 10) == 10
    assert budget_tokens(0.55, 9) == 5
    with pytest.raises(ValueError):
        budget_tokens(0.0, 10)


def test_token_pruning_keeps_exactly_ceil_gamma_t_in_order(tiny_lm, examples):
    budgets = [0.1, 0.3, 0.5, 0.7, 0.9, 1.0]
    for ex, s in zip(examples, MistScorer(tiny_lm).score(examples)):
        T = len(s.scores)
        out = prune(ex, s, budgets=budgets, unit="token")
        assert [c.budget for c in out] == budgets
        for c in out:
            k = math.ceil(round(c.budget * T, 9))
            assert c.kept_tokens == k and c.cot_tokens == T
            # the kept tokens are the k highest scores
            assert s.scores[c.kept].min() >= s.scores[~c.kept].max() if k < T else True
            # the text is exactly the kept tokens' pieces of the original, in order
            pieces = token_pieces(ex.cot, s.chain_offsets)
            assert c.text == "".join(p for p, k in zip(pieces, c.kept) if k).strip()
            assert _is_subsequence(c.text, ex.cot)
        assert out[-1].text == ex.cot


def test_word_pruning_keeps_whole_words_within_the_budget(tiny_lm, examples):
    for ex, s in zip(examples, MistScorer(tiny_lm).score(examples)):
        T = len(s.scores)
        units = word_units(ex.cot, s.chain_offsets)
        for c in prune(ex, s, budgets=[0.3, 0.5, 0.8], unit="word"):
            assert c.kept_tokens <= math.ceil(round(c.budget * T, 9))
            for u in np.unique(units):  # a word is kept whole or not at all
                assert len(set(c.kept[units == u])) == 1
            words = ex.cot.split()
            for w in c.text.split():
                assert w in words
            assert _is_subsequence(c.text, ex.cot)


def test_word_units_group_subword_pieces():
    cot = "un believable 12345\n\nok"
    # pieces: "un", " believ", "able", " 123", "45", "\n\n", "ok"
    offsets = np.array([[0, 2], [2, 9], [9, 13], [13, 17], [17, 19], [19, 21], [21, 23]])
    units = word_units(cot, offsets)
    assert units[1] == units[2] and units[3] == units[4]
    assert units[5] == units[6]  # a whitespace-only token goes with the next word
    assert len(set(units.tolist())) == 4
    assert "".join(token_pieces(cot, offsets)) == cot


def test_word_score_is_the_mean_of_its_pieces():
    ex = Example("q?", "aa bbbb", "1")
    offsets = np.array([[0, 2], [2, 5], [5, 7]])  # "aa", " bb", "bb"
    scored = SimpleNamespace(scores=np.array([0.3, 1.0, -0.2]), chain_offsets=offsets)
    [c] = prune(ex, scored, budgets=[0.5], unit="word")  # k = 2: "bbbb" (mean 0.4) ranks first
    assert c.text == "bbbb" and c.kept.tolist() == [False, True, True]
    [c] = prune(ex, scored, budgets=[0.3], unit="word")  # k = 1: "bbbb" does not fit, "aa" does
    assert c.text == "aa" and c.kept.tolist() == [True, False, False]
    [c] = prune(ex, scored, budgets=[0.5], unit="token")  # by token: " bb" and "aa"
    assert c.text == "aa bb"


def test_dropping_a_word_never_fuses_its_neighbours():
    ex = Example("q?", "has 40 - 5", "35")
    # SmolLM2-style pieces: "has", " ", "40", " -", " ", "5"
    offsets = np.array([[0, 3], [3, 4], [4, 6], [6, 8], [8, 9], [9, 10]])
    scored = SimpleNamespace(scores=np.array([1.0, 0.5, 0.9, -1.0, 0.5, 0.8]), chain_offsets=offsets)
    [c] = prune(ex, scored, budgets=[0.8], unit="word")  # 5 of 6 tokens: all but " -"
    assert c.text == "has 40 5"


def test_keep_digits_forces_number_tokens():
    ex = Example("q?", "we add 12 and 7 here", "19")
    offsets = np.array([[0, 2], [2, 6], [6, 9], [9, 13], [13, 15], [15, 20]])
    scored = SimpleNamespace(scores=np.array([5.0, 4.0, -1.0, 3.0, -2.0, 0.0]), chain_offsets=offsets)
    [plain] = prune(ex, scored, budgets=[0.5])
    [digits] = prune(ex, scored, budgets=[0.5], keep_digits=True)
    assert plain.text == "we add and"
    assert digits.text == "we 12 7" and digits.kept_tokens == 3


@settings(max_examples=60, deadline=None)
@given(st.lists(st.text(alphabet="ab1 \n", min_size=1, max_size=4), min_size=1, max_size=30),
       st.floats(0.01, 1.0), st.sampled_from(["token", "word"]), st.integers(0, 2**31))
def test_pruning_invariants_on_random_chains(pieces, budget, unit, seed):
    cot = "".join(pieces)
    if not cot.strip():
        return
    offsets, pos = [], 0
    for p in pieces:
        offsets.append([pos, pos + len(p)])
        pos += len(p)
    scores = np.random.default_rng(seed).normal(size=len(pieces))
    ex = Example("q", cot, "a")
    [c] = prune(ex, SimpleNamespace(scores=scores, chain_offsets=np.array(offsets)), [budget], unit=unit)
    k = budget_tokens(budget, len(pieces))
    assert (c.kept_tokens == k) if unit == "token" else (c.kept_tokens <= k)
    assert _is_subsequence(c.text, cot)
