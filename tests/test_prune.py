import json
import math
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from mist_core import Example, MistScorer, get_adapter, prune
from mist_core.scoring.prune import (EQUATION, NUMBER, OPERATORS, SENTENCE_KEEPS, UNITS,
                                     budget_tokens, cut_numbers, merge_spans, prune_scores,
                                     pruning_units, sentence_ids, token_pieces, word_units)


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
            # units best first: no dropped one-token unit outscores a kept unit (a number of
            # several tokens is one unit, scored by its mean)
            units = np.unique(pruning_units(ex.cot, s.chain_offsets, "token"), return_inverse=True)[1]
            means = np.bincount(units, weights=s.scores) / np.bincount(units)
            single = np.bincount(units) == 1
            kept_u = np.zeros(len(means), bool)
            kept_u[units[c.kept]] = True
            if k < T and (single & ~kept_u).any():
                assert means[kept_u].min() >= means[single & ~kept_u].max()
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


def test_facts_first_takes_numbers_and_operators_within_the_budget():
    ex = Example("q?", "we add 12 + 7 = 19 here", "19")
    offsets = np.array([[0, 2], [2, 6], [6, 9], [9, 11], [11, 13], [13, 15], [15, 18], [18, 23]])
    scores = np.array([5.0, 4.0, -1.0, -3.0, 0.0, -2.0, 1.0, 3.0])
    scored = SimpleNamespace(scores=scores, chain_offsets=offsets)
    [plain] = prune(ex, scored, budgets=[0.5])
    assert plain.text == "we add 19 here"
    [facts] = prune(ex, scored, budgets=[0.5], facts_first=True)
    assert facts.text == "12 7 = 19" and facts.kept_tokens == 4  # the best 4 of 5 facts
    [more] = prune(ex, scored, budgets=[0.75], facts_first=True)  # every fact, then the best word
    assert more.text == "we 12 + 7 = 19" and more.kept_tokens == 6


def test_equations_first_takes_the_computations_not_every_number():
    """equations_first: the equation's operands, operators and result before any other
    unit, within the budget; a number outside an equation (a restated fact) competes on its
    score like a word."""
    ex = Example("q?", "has 12 and 7 so 12 + 7 = 19 now", "19")
    offsets = np.array([[0, 3], [3, 6], [6, 10], [10, 12], [12, 15], [15, 18], [18, 20], [20, 22],
                        [22, 24], [24, 27], [27, 31]])
    scores = np.array([1.0, 2.0, 0.0, 2.0, 3.0, -2.0, -5.0, -3.0, -1.0, -2.0, 0.5])
    scored = SimpleNamespace(scores=scores, chain_offsets=offsets)
    [facts] = prune(ex, scored, budgets=[0.5], facts_first=True)
    assert facts.text == "12 7 12 7 = 19"  # the restated numbers crowd out the operator
    [eqs] = prune(ex, scored, budgets=[0.5], equations_first=True)
    assert eqs.text == "so 12 + 7 = 19" and eqs.kept_tokens == 6
    [more] = prune(ex, scored, budgets=[0.75], equations_first=True)  # then the best others
    assert more.text == "has 12 7 so 12 + 7 = 19" and more.kept_tokens == 9
    with pytest.raises(ValueError, match="exclude"):
        prune(ex, scored, budgets=[0.5], facts_first=True, equations_first=True)


def _word_offsets(cot: str) -> np.ndarray:
    """A token a word, a number or a punctuation mark, with the space before it."""
    return np.array([m.span() for m in re.finditer(r"\s*(?:\d+|\w+|[^\w\s])", cot)])


def test_sentences_first_drops_whole_sentences_before_cutting_into_one():
    """sentences_first: the sentences without an equation go whole, lowest mean score first,
    while the chain is over the budget (a distractor's number with them); then the budget is
    filled as before from what is left."""
    cot = ("Dan has 9 coins. The coins are in a box. He loses 2, so 9 - 2 = 7. "
           "The 4 cats do not count. Then 7 * 2 = 14.")
    offsets = _word_offsets(cot)
    pieces = token_pieces(cot, offsets)
    sentence = sentence_ids(cot, offsets)
    assert [int(sentence[i]) for i, p in enumerate(pieces) if p.strip() in ("Dan", "box", "He",
                                                                            "cats", "Then")] == [0, 1, 2, 3, 4]
    # the filler lowest, the distractor next, the start above both
    by_sentence = {0: 1.0, 1: -3.0, 2: 0.5, 3: -1.0, 4: 0.2}
    scores = np.array([by_sentence[int(s)] for s in sentence])
    scores += np.linspace(0, 0.1, len(scores))  # no ties
    scored = SimpleNamespace(scores=scores, chain_offsets=offsets)
    ex = Example("q?", cot, "14")
    T = len(offsets)
    fits = sum(1 for s in sentence if s not in (1, 3))
    [c] = prune(ex, scored, budgets=[fits / T], sentences_first="equations")
    assert c.text == "Dan has 9 coins. He loses 2, so 9 - 2 = 7. Then 7 * 2 = 14."
    # a little less room: the three sentences left are cut into, token by token
    [c] = prune(ex, scored, budgets=[(fits - 4) / T], sentences_first="equations",
                facts_first=True)
    assert "box" not in c.text and "cats" not in c.text and "4" not in c.text.split()
    assert "9 - 2 = 7" in c.text and "7 * 2 = 14" in c.text
    assert c.kept_tokens <= budget_tokens((fits - 4) / T, T)
    # without it the numbers first keep the distractor's 4, and the filler's best words stay
    [plain] = prune(ex, scored, budgets=[(fits - 4) / T], facts_first=True)
    assert "4" in plain.text.split()
    # room for everything: nothing is dropped
    [whole] = prune(ex, scored, budgets=[1.0], sentences_first="equations")
    assert whole.text == cot
    # "facts": only the sentences without a number or an operator go whole (the filler); the
    # distractor's 4 stays, first among the facts, the start sentence too
    [c] = prune(ex, scored, budgets=[(fits - 4) / T], sentences_first="facts", facts_first=True)
    assert "box" not in c.text and "4" in c.text.split() and "9 - 2 = 7" in c.text
    assert c.text.startswith("Dan has 9")
    with pytest.raises(ValueError, match="sentences_first"):
        prune(ex, scored, budgets=[0.5], sentences_first="words")
    # an equation is a sentence's `=`, as real chains write them (units, `x`, `.5`)
    cot = "So 4 * 20 sheep = 80 sheep. Nice sheep. He drives 2-.5=1.5 hours. Then $10 x 2 = $20."
    offsets = _word_offsets(cot)
    sentence = sentence_ids(cot, offsets)
    scores = np.where(sentence == 1, 5.0, 0.0) + np.linspace(0, 0.1, len(offsets))
    scored = SimpleNamespace(scores=scores, chain_offsets=offsets)
    [c] = prune(Example("q?", cot, "20"), scored, budgets=[0.8], sentences_first="equations")
    assert "Nice" not in c.text and "80 sheep" in c.text and "2-.5=1.5" in c.text


def _random_chain(pieces, seed):
    """A chain of the given pieces, one token each, with random scores."""
    cot = "".join(pieces)
    offsets = np.cumsum([0] + [len(p) for p in pieces])
    offsets = np.stack([offsets[:-1], offsets[1:]], 1)
    scores = np.random.default_rng(seed).normal(size=len(pieces))
    return cot, offsets, SimpleNamespace(scores=scores, chain_offsets=offsets)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.text(alphabet="ab12 .,=+\n", min_size=1, max_size=4), min_size=1, max_size=30),
       st.floats(0.01, 1.0), st.sampled_from(UNITS), st.integers(0, 2**31),
       st.sampled_from(SENTENCE_KEEPS))
def test_sentences_first_on_random_chains(pieces, budget, unit, seed, keep):
    """Within the budget as without it, numbers whole, original text; at token level with
    no multi-token unit as many tokens kept as without it (dropping a sentence whole never
    leaves fewer than the budget)."""
    cot, offsets, scored = _random_chain(pieces, seed)
    if not cot.strip():
        return
    [c] = prune(Example("q", cot, "a"), scored, [budget], unit=unit, sentences_first=keep,
                facts_first=seed % 2 == 0)
    [plain] = prune(Example("q", cot, "a"), scored, [budget], unit=unit)
    k = budget_tokens(budget, len(pieces))
    assert c.kept_tokens <= max(k, plain.kept_tokens)
    assert cut_numbers(cot, offsets, c.kept) == 0
    assert _is_subsequence(c.text, cot)
    units = pruning_units(cot, offsets, unit)
    if len(np.unique(units)) == len(units):
        assert c.kept_tokens == plain.kept_tokens == k


@settings(max_examples=60, deadline=None)
@given(st.lists(st.text(alphabet="ab12 .,=+\n", min_size=1, max_size=4), min_size=1, max_size=30),
       st.floats(0.01, 1.0), st.sampled_from(UNITS), st.integers(0, 2**31),
       st.sampled_from(["facts", "equations"]))
def test_facts_first_on_random_chains(pieces, budget, unit, seed, first):
    """Within the budget as without it; no unit without a fact (with equations_first: a
    piece of an equation) is kept while a fact unit that would have fitted in its place is
    dropped; numbers stay whole."""
    cot, offsets, scored = _random_chain(pieces, seed)
    if not cot.strip():
        return
    ex = Example("q", cot, "a")
    [c] = prune(ex, scored, [budget], unit=unit, facts_first=first == "facts",
                equations_first=first == "equations")
    [plain] = prune(ex, scored, [budget], unit=unit)
    k = budget_tokens(budget, len(pieces))
    assert c.kept_tokens <= max(k, plain.kept_tokens)
    assert cut_numbers(cot, offsets, c.kept) == 0
    units = np.unique(pruning_units(cot, offsets, unit), return_inverse=True)[1]
    sizes = np.bincount(units)
    in_equation = [any(a < m.end() and b > m.start() for m in EQUATION.finditer(cot))
                   for a, b in offsets]
    fact = np.bincount(units, weights=[bool(re.search(r"\d", p)) or p.strip() in OPERATORS
                                       for p in pieces] if first == "facts" else in_equation) > 0
    kept_units = np.unique(units[c.kept])
    dropped_facts = [u for u in np.unique(units) if fact[u] and u not in kept_units]
    if any(not fact[u] for u in kept_units):
        assert all(sizes[u] > k - c.kept_tokens + sum(sizes[v] for v in kept_units if not fact[v])
                   for u in dropped_facts)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.text(alphabet="ab12 .,=+\n", min_size=1, max_size=4), min_size=1, max_size=30),
       st.floats(0.01, 1.0), st.sampled_from(UNITS), st.integers(0, 2**31))
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
    offsets = np.array(offsets)
    assert cut_numbers(cot, offsets, c.kept) == 0
    units = np.unique(pruning_units(cot, offsets, unit), return_inverse=True)[1]
    sizes = np.bincount(units)
    dropped = np.setdiff1d(units, units[c.kept])
    if c.kept_tokens > k:  # only where not one unit fits
        assert sizes.min() > k and len(np.unique(units[c.kept])) == 1
    elif unit == "token":  # filled up to k but for units too big for what is left
        assert (sizes[dropped] > k - c.kept_tokens).all()
    assert _is_subsequence(c.text, cot)


# ---------------------------------------------------------------- numbers and equations whole

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
# A digit a token, as the Llama 3, Qwen2 and SmolLM2 tokenizers write numbers.
_DIGIT_TOKENS = re.compile(r"\d|[A-Za-z]+|\s+|[^\sA-Za-z\d]")


def digit_tokens(cot: str) -> np.ndarray:
    return np.array([m.span() for m in _DIGIT_TOKENS.finditer(cot)])


def test_a_number_is_one_unit_whatever_the_tokenizer():
    cot = "She has 16 eggs and 1,250.5 dollars, so 16 * 2 = 32."
    offsets = digit_tokens(cot)
    for unit in UNITS:
        units = pruning_units(cot, offsets, unit)
        for m in NUMBER.finditer(cot):
            a, b = m.span()
            inside = units[(offsets[:, 0] < b) & (offsets[:, 1] > a)]
            assert len(set(inside.tolist())) == 1, (unit, m.group())
    tokens = pruning_units(cot, offsets, "token")
    assert len(set(tokens.tolist())) == len(offsets) - 1 - 6 - 1 - 1  # 16, 1,250.5, 16, 32 joined


def test_equation_unit_keeps_an_equation_whole():
    cot = "Janet sells 16 - 3 - 4 = 9 eggs. She makes 9 * 2 = $18 a day, not x = 2."
    offsets = digit_tokens(cot)
    units = pruning_units(cot, offsets, "equation")
    words = pruning_units(cot, offsets, "word")
    for eq in ("16 - 3 - 4 = 9", "9 * 2 = $18"):
        a = cot.index(eq)
        inside = units[(offsets[:, 0] < a + len(eq)) & (offsets[:, 1] > a)]
        assert len(set(inside.tolist())) == 1, eq
    at = cot.index("x = 2")  # no operator between numbers: words as usual
    assert len(set(units[(offsets[:, 0] >= at) & (offsets[:, 1] <= at + 5)].tolist())) == 3
    assert len(set(units.tolist())) < len(set(words.tolist()))


def test_token_pruning_never_keeps_part_of_a_number():
    ex = Example("q?", "She has 16 eggs.", "16")
    offsets = digit_tokens(ex.cot)  # She, ' ', has, ' ', 1, 6, ' ', eggs, .
    scores = np.array([0.0, 0.0, 0.0, 0.0, 5.0, -5.0, 0.0, 1.0, 0.0])
    top = np.argsort(-scores, kind="stable")[:5]
    assert 4 in top and 5 not in top  # the plain top ⌈γT⌉ would keep `1` of `16`
    [c] = prune(ex, SimpleNamespace(scores=scores, chain_offsets=offsets), [0.5])
    assert c.kept[4] == c.kept[5] and c.kept_tokens == 5 and cut_numbers(ex.cot, offsets, c.kept) == 0


def test_no_gsm8k_number_is_cut_at_any_unit_or_budget():
    """200 GSM8K test chains, a digit a token, random scores: every unit, every budget."""
    adapter = get_adapter("gsm8k")
    lines = (DATA / "gsm8k" / "test.jsonl").open().readlines()[:200]
    rng = np.random.default_rng(0)
    numbers = 0
    for line in lines:
        ex = adapter(json.loads(line))
        offsets = digit_tokens(ex.cot)
        numbers += len(NUMBER.findall(ex.cot))
        scores = rng.normal(size=len(offsets))
        for unit in UNITS:
            for c in prune_scores(ex, scores, offsets, [0.1, 0.3, 0.5, 0.7, 0.9], unit):
                assert cut_numbers(ex.cot, offsets, c.kept) == 0, (ex.key, unit, c.budget)
                assert c.kept_tokens <= budget_tokens(c.budget, len(offsets))
    assert numbers > 1000
    # the plain top-k, as pruning was before, cuts many of them
    cut = sum(cut_numbers(ex.cot, digit_tokens(ex.cot),
                          np.argsort(np.argsort(-rng.normal(size=len(digit_tokens(ex.cot))))) < 
                          budget_tokens(0.5, len(digit_tokens(ex.cot))))
              for ex in (adapter(json.loads(line)) for line in lines[:20]))
    assert cut > 10


def test_merge_spans_matches_a_plain_union():
    rng = np.random.default_rng(1)
    for _ in range(200):
        T = int(rng.integers(1, 30))
        widths = rng.integers(1, 4, size=T)
        stops = np.cumsum(widths)
        offsets = np.stack([stops - widths, stops], 1)
        units = np.cumsum(rng.random(T) < 0.6)
        spans = [tuple(sorted(rng.integers(0, stops[-1] + 1, size=2))) for _ in range(3)]
        got = merge_spans(units, offsets, spans)
        want = units.copy()  # the plain way: join every unit a span touches, until nothing moves
        for _ in range(T):
            for a, b in spans:
                touched = np.nonzero((offsets[:, 0] < b) & (offsets[:, 1] > a))[0]
                if len(touched):
                    want[np.isin(want, want[touched])] = want[touched].min()
        assert (np.unique(got, return_inverse=True)[1] == np.unique(want, return_inverse=True)[1]).all()
