"""The evaluation harness's measures (mist_core.measures: evaluation, answers, taxonomy),
each checked on cases whose answer is known by construction or against an independent plain
computation."""
from __future__ import annotations

import math
import random
import re

import numpy as np
import pytest
import torch

from mist_core import Example, MistScorer, prune, wrap_model
from mist_core.measures.answers import (answer_correct, intermediate_results, math_spans,
                                        normalize_math)
from mist_core.measures.evaluation import (NOCHAIN, answer_passes, compressed_input, evaluate_chain,
                                           positional_scores, stop_tokens)
from mist_core.measures.retention import ChainProfile, pack_mask, unpack_mask
from mist_core.measures.stats import (bootstrap_indices, ci_mean, ci_ratio, exact_agreement,
                                      spearman, top_overlap)
from mist_core.measures.taxonomy import TYPES, token_types
from mist_core.scoring.scorer import shared_prefix


def word_offsets(text: str) -> np.ndarray:
    """A stand-in tokenizer: every run of word characters, and every other non-space
    character, is a token (with the space before it)."""
    return np.array([m.span() for m in re.finditer(r"\s*(\w+|[^\w\s])", text)])


# ---------------------------------------------------------------- answers

@pytest.mark.parametrize("pred,gold,ok", [
    ("18.", "18", True), ("$18 every day", "18", True), ("1,000 dollars", "1000", True),
    ("-3", "-3", True), ("9 * 2 = 18 dollars", "18", True), ("18 * 9 = 180", "18", False),
    ("12 days 6", "12", True), ("", "5", False), ("five", "5", False), ("2.50", "2.5", True),
])
def test_gsm8k_answers(pred, gold, ok):
    assert answer_correct(pred, gold, "gsm8k") is ok


@pytest.mark.parametrize("pred,gold,ok", [
    ("\\frac{1}{2}", "\\dfrac12", True), ("$\\boxed{3}$.", "3", True), ("0.5", "\\frac{1}{2}", True),
    ("x = 5", "5", True), ("\\[\\frac{11+9a}{20}\\]", "\\frac{11+9a}{20}", True),
    ("10^\\circ", "10", True), ("\\text{(C)}", "\\text{(C)}", True), ("3.0", "3", True),
    ("4", "5", False), ("\\left( 3, \\frac{\\pi}{2} \\right)", "(3,\\frac{\\pi}{2})", True),
    ("\\frac{119a}{20}", "\\frac{11+9a}{20}", False), ("3/4", "\\frac34", True),
    (": 14", "14", True), ("3^3 = 27.", "27", True), ("3^3 = 28", "27", False),
])
def test_math_answers(pred, gold, ok):
    assert answer_correct(pred, gold, "math") is ok


def test_math_normalisation_matches_the_reference_on_common_forms():
    assert normalize_math("\\sqrt2") == "\\sqrt{2}"
    assert normalize_math("\\$ 5.00") == "5.00"
    assert normalize_math("50\\%") == "50"
    assert normalize_math("5 \\text{ cm}") == "5"


def test_intermediate_results_gsm8k_are_the_numbers_after_equals():
    cot = "She has 3 + 4 = 7 apples, then 7 * 2 = $14. In all 1,200 - 200 = 1,000, so 5=5."
    spans = intermediate_results(cot, "gsm8k")
    assert [cot[a:b] for a, b in spans] == ["7", "14", "1,000", "5"]


def test_intermediate_results_math_are_right_hand_sides_inside_math():
    cot = ("Here $x = 2 + 3 = 5$, and we know a = b outside math. Then "
           "$$\\sum_{i=1}^n i = \\frac{n(n+1)}{2}, \\quad y \\le 3$$ and \\(f(1, 2) = 4.\\)")
    got = [cot[a:b] for a, b in intermediate_results(cot, "math")]
    # the `=` outside math and the one in the subscript are not results
    assert got == ["2 + 3", "5", "\\frac{n(n+1)}{2}", "4"]
    assert len(math_spans(cot)) == 3


# ---------------------------------------------------------------- token types

def test_token_types_follow_the_taxonomy():
    text = "So each of the 12 boxes costs $3 + x, not 4 and therefore $\\frac{a}{b} \\times 2$."
    offsets = word_offsets(text)
    got = {text[a:b].strip(): t for (a, b), t in zip(offsets, token_types(text, offsets))}
    want = {"So": "connective", "each": "quantifier", "of": "function", "the": "function",
            "12": "number", "boxes": "content", "costs": "content", "+": "operator",
            "not": "quantifier", "4": "number", "and": "connective", "therefore": "connective",
            "frac": "variable", "a": "variable", "b": "variable", "times": "operator",
            "2": "number", ".": "other", "x": "variable"}
    for token, kind in want.items():
        assert got[token] == kind, token
    assert set(got.values()) <= set(TYPES)


def test_subword_pieces_take_their_words_type():
    text = "therefore 1234"
    offsets = np.array([[0, 5], [5, 9], [9, 11], [11, 14]])  # "there" "fore" " 12" "34"
    assert token_types(text, offsets) == ["connective", "connective", "number", "number"]


def test_chain_profile_counts_what_a_mask_keeps():
    cot = "Tom has 3 + 4 = 7 apples, so 7 * 2 = 14 in all."
    offsets = word_offsets(cot)
    toks = [cot[a:b].strip() for a, b in offsets]
    prof = ChainProfile.of(cot, offsets, "gsm8k")
    tot = prof.totals()
    assert tot["tokens"] == len(toks) and tot["results"] == 2
    assert tot["numbers"] == 6  # 3 4 7 7 2 14
    assert tot["types"][TYPES.index("number")] == 6
    assert tot["types"][TYPES.index("operator")] == 4  # + = * =
    # keep the first result's token (the 7 after the first `=`) and one operator only
    kept = np.zeros(len(toks), bool)
    kept[toks.index("7")] = True
    kept[toks.index("+")] = True
    k = prof.kept(kept)
    assert k["tokens"] == 2 and k["numbers"] == 1 and k["results"] == 1
    assert k["types"][TYPES.index("operator")] == 1
    assert prof.kept(np.ones(len(toks), bool))["results"] == 2
    assert prof.kept(np.zeros(len(toks), bool)) == {"tokens": 0, "numbers": 0, "results": 0,
                                                    "answer": 0, "types": [0] * len(TYPES)}
    assert tot["answer"] == 0  # no gold answer given


def test_the_answers_last_statement_is_found_and_tracked():
    cot = "It costs 14 dollars, so 2 * 7 = 14.0 and she has 1,400 cents."
    offsets = word_offsets(cot)
    toks = [cot[a:b].strip() for a, b in offsets]
    prof = ChainProfile.of(cot, offsets, "gsm8k", answer="14")
    assert [toks[i] for i in prof.answer] == ["14", ".", "0"]  # the last number equal to 14
    kept = np.zeros(len(toks), bool)
    kept[prof.answer] = True
    assert prof.kept(kept)["answer"] == 1 and prof.totals()["answer"] == 1
    kept[prof.answer[-1]] = False
    assert prof.kept(kept)["answer"] == 0
    assert ChainProfile.of(cot, offsets, "gsm8k", answer="15").answer is None
    math = "So $x = \\boxed{\\frac{1}{2}}$."
    span = ChainProfile.of(math, word_offsets(math), "math", answer="\\frac{1}{2}").answer
    assert "".join(math[a:b] for a, b in word_offsets(math)[span]).strip() == "\\frac{1}{2}"


def test_a_result_split_over_tokens_survives_only_whole():
    cot = "so 12 + 3 = 1500 now"
    offsets = np.array([[0, 2], [2, 5], [5, 7], [7, 9], [9, 11], [11, 14], [14, 16], [16, 20]])
    prof = ChainProfile.of(cot, offsets, "gsm8k")  # "1500" is the tokens " 15" and "00"
    kept = np.ones(len(offsets), bool)
    kept[6] = False
    assert prof.kept(kept)["results"] == 0
    kept[6] = True
    assert prof.kept(kept)["results"] == 1


# ---------------------------------------------------------------- statistics

def test_spearman_and_overlaps():
    a = np.array([1.0, 2.0, 3.0, 4.0, 5.0])
    assert spearman(a, a ** 3) == pytest.approx(1.0)
    assert spearman(a, -a) == pytest.approx(-1.0)
    assert math.isnan(spearman(a, np.ones(5)))
    # ties: the mean rank, as the textbook formula
    x, y = np.array([1.0, 1.0, 2.0, 3.0]), np.array([1.0, 2.0, 3.0, 4.0])
    rx = np.array([1.5, 1.5, 3.0, 4.0])
    assert spearman(x, y) == pytest.approx(np.corrcoef(rx, y)[0, 1])
    # top-30% of 10 = 3 tokens: A = {0,1,2}, B = {1,2,3}
    s1 = np.array([10, 9, 8, 0, 0, 0, 0, 0, 0, 0], float)
    s2 = np.array([0, 9, 8, 7, 0, 0, 0, 0, 0, 0], float)
    assert top_overlap(s1, s2, 0.3) == pytest.approx((2 / 3, 2 / 4))
    agree = exact_agreement(np.stack([s1, s2]), np.stack([s1, -s2]), (0.3,), np.ones(2))
    assert agree == {"per_layer@0.3": 1.0, "aggregated@0.3": 1.0}  # ranked by magnitude


def test_bootstrap_intervals():
    idx = bootstrap_indices(50, 500, seed=1)
    assert idx.shape == (500, 50) and idx.max() < 50
    assert ci_mean(np.full(50, 0.25), idx) == (0.25, 0.25, 0.25)
    x = np.random.default_rng(0).normal(1.0, 1.0, 50)
    m, lo, hi = ci_mean(x, idx)
    assert lo < m < hi and m == pytest.approx(x.mean()) and hi - lo < 1.0
    x[:10] = np.nan  # examples the measure does not apply to
    assert ci_mean(x, idx)[0] == pytest.approx(np.nanmean(x))
    num, den = np.arange(50.0), np.full(50, 2.0)
    assert ci_ratio(num, den, idx)[0] == pytest.approx(num.mean() / 2)


def test_masks_round_trip():
    for T in (1, 7, 8, 9, 100):
        kept = np.random.default_rng(T).random(T) < 0.5
        assert np.array_equal(unpack_mask(pack_mask(kept), T), kept)
    assert pack_mask(None) == "" and not unpack_mask("", 4).any()


def test_positional_controls_keep_the_first_or_last_tokens(examples):
    ex = examples[0]
    from types import SimpleNamespace
    T = 10
    offsets = word_offsets(ex.cot)[:T]
    for where, want in (("head", np.arange(T) < 3), ("tail", np.arange(T) >= 7)):
        view = SimpleNamespace(scores=positional_scores(T, where), chain_offsets=offsets)
        [c] = prune(ex, view, budgets=[0.3], unit="token")
        assert np.array_equal(c.kept, want)


# ---------------------------------------------------------------- Eq. 1 and greedy answers

def _plain_logprob(lm, ids: np.ndarray, start: int) -> float:
    """log p(ids[start:] | ids[:start]) from one plain forward pass: no cache, no prefix."""
    with torch.no_grad():
        logits = lm.model(input_ids=torch.tensor(ids)[None]).logits[0].double()
    lp = torch.log_softmax(logits, -1)
    return float(sum(lp[t - 1, ids[t]] for t in range(start, len(ids))))


def _plain_greedy(lm, prompt: np.ndarray, cap: int) -> list[int]:
    stop = stop_tokens(lm)
    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(cap):
            t = int(lm.model(input_ids=torch.tensor(ids)[None]).logits[0, -1].argmax())
            if stop[t]:
                break
            out.append(t)
            ids.append(t)
    return out


def test_compressed_input_splices_exactly_the_kept_tokens(tiny_lm, examples):
    enc = MistScorer(tiny_lm).encode(examples[0])
    T = enc.chain_len
    p, a = compressed_input(enc, np.ones(T, bool))
    assert np.array_equal(np.concatenate([p, a]), enc.source_ids)
    kept = np.arange(T) % 3 == 0
    p, a = compressed_input(enc, kept)
    chain = enc.source_ids[enc.chain_start: enc.chain_stop]
    assert np.array_equal(p, np.concatenate([enc.source_ids[: enc.chain_start], chain[kept],
                                             enc.source_ids[enc.chain_stop: enc.answer_start]]))
    p, a = compressed_input(enc, NOCHAIN)
    assert np.array_equal(np.concatenate([p, a]), enc.target_ids)
    with pytest.raises(ValueError):
        compressed_input(enc, np.ones(T + 1, bool))


def test_eq1_and_greedy_match_plain_computations(tiny_lm, examples):
    scorer = MistScorer(tiny_lm)
    rng = np.random.default_rng(0)
    for ex in examples:
        enc = scorer.encode(ex)
        [s] = scorer.score_encoded([enc])
        masks = [np.ones(enc.chain_len, bool), NOCHAIN] + [rng.random(enc.chain_len) < g
                                                           for g in (0.2, 0.5, 0.8, 0.5)]
        masks[-1][:] = masks[-2]  # a duplicate: computed once, reported twice
        inputs = [compressed_input(enc, m) for m in masks]
        # a small token budget forces several chunks and a merged decoding batch
        got = answer_passes(tiny_lm, inputs, prefix_len=shared_prefix(enc), extra_new=5,
                            max_tokens=3 * len(enc.source_ids))
        assert got[0].log_likelihood == pytest.approx(s.log_likelihood, abs=1e-4)
        assert got[1].log_likelihood == pytest.approx(s.nochain_log_likelihood, abs=1e-4)
        for (p, a), res in zip(inputs, got):
            assert res.log_likelihood == pytest.approx(_plain_logprob(
                tiny_lm, np.concatenate([p, a]), len(p)), abs=1e-4)
            assert res.generated == _plain_greedy(tiny_lm, p, len(a) + 5)
        assert got[-1].generated == got[-2].generated
        alone = answer_passes(tiny_lm, inputs[2:3], prefix_len=shared_prefix(enc), extra_new=5)
        assert alone[0].generated == got[2].generated
        assert alone[0].log_likelihood == pytest.approx(got[2].log_likelihood, abs=1e-5)


# ---------------------------------------------------------------- a chain where one token carries the answer

DIGITS = "1234579"  # digits the test tokenizer writes as one token with their space
FILLER = ["the", "eggs", "apples", "and", "so", "then", "she", "sells", "market", "day"]


def copy_example(rng: random.Random, i: int, at: int | None = None, n: tuple = (6, 12)) -> Example:
    words = [rng.choice(FILLER) for _ in range(rng.randint(*n))]
    d = rng.choice(DIGITS)
    words.insert(rng.randint(0, len(words)) if at is None else at, d)
    return Example("Which number is in the chain?", " ".join(words), d, id=f"copy{i}")


@pytest.fixture(scope="module")
def copy_lm(tokenizer):
    """A 2-layer model trained (a few seconds) to answer with the one digit in its chain:
    only that token carries the answer, so every measure's value is known."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from mist_core.data.templates import get_template

    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    template = get_template("auto", tokenizer, 256)
    rng = random.Random(0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    eot = tokenizer.eos_token_id
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: more threads only add contention
    try:
        loss = _train(model, opt, template, rng, eot)
    finally:
        torch.set_num_threads(threads)
    assert loss < 0.05, "the copy model did not learn its task"
    return wrap_model(model, tokenizer, "copy")


def _train(model, opt, template, rng, eot) -> float:
    for step in range(200):
        encs = [template.encode(copy_example(rng, 0)) for _ in range(32)]
        # the answer, then the end of the turn, so that greedy decoding stops
        seqs = [np.append(e.source_ids, eot) for e in encs]
        W = max(map(len, seqs))
        ids = torch.zeros(len(seqs), W, dtype=torch.long)
        labels = torch.full((len(seqs), W), -100)
        mask = torch.zeros(len(seqs), W, dtype=torch.long)
        for j, (e, sq) in enumerate(zip(encs, seqs)):
            ids[j, : len(sq)] = torch.tensor(sq)
            mask[j, : len(sq)] = 1
            labels[j, e.answer_start: len(sq)] = torch.tensor(sq[e.answer_start:])
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return float(loss.detach())


@pytest.mark.integration  # copy_lm trains a model first: 20-45 s on 2 busy cores
def test_one_token_carries_the_answer(copy_lm):
    scorer = MistScorer(copy_lm)
    rng = random.Random(1)
    keep_digit, drop_digit, lls = [], [], {k: [] for k in ("full", "nochain", "only", "drop", "head", "tail")}
    for i in range(6):
        ex = copy_example(rng, i, at=2, n=(10, 14))  # the digit is the 3rd word
        enc = scorer.encode(ex)
        T = enc.chain_len
        digit = np.array([any(ch.isdigit() for ch in ex.cot[a:b]) for a, b in enc.chain_offsets])
        assert digit.sum() == 1 and np.nonzero(digit)[0][0] < 0.5 * T
        from types import SimpleNamespace
        head, tail = (prune(ex, SimpleNamespace(scores=positional_scores(T, w),
                                                chain_offsets=enc.chain_offsets),
                            budgets=[0.5])[0].kept for w in ("head", "tail"))
        res = evaluate_chain(copy_lm, enc, {"full": np.ones(T, bool), "nochain": NOCHAIN,
                                            "only": digit, "drop": ~digit, "head": head,
                                            "tail": tail}, "gsm8k")
        for k in lls:
            lls[k].append(res[k]["ll"])
        # by construction: right exactly when the digit is kept, and then at no cost in Eq. 1
        for k in ("full", "only", "head"):
            assert res[k]["correct"] and res[k]["pred"] == ex.answer, (k, res[k])
            keep_digit.append(res[k]["ll"])
        for k in ("nochain", "drop", "tail"):
            drop_digit.append(res[k]["ll"])
        assert res["only"]["numbers"] == 1 and res["drop"]["numbers"] == 0
        assert res["_chain"]["numbers"] == 1
        assert res["only"]["types"][TYPES.index("number")] == 1
    assert min(keep_digit) > -0.1
    assert np.mean(drop_digit) < -2.0  # without the digit the model can only guess
    ll = {k: np.array(v) for k, v in lls.items()}
    idx = bootstrap_indices(6, 200)
    assert ci_ratio(ll["only"] - ll["nochain"], ll["full"] - ll["nochain"], idx)[0] == pytest.approx(1.0, abs=0.05)
    assert abs(ci_ratio(ll["drop"] - ll["nochain"], ll["full"] - ll["nochain"], idx)[0]) < 0.2


def test_greedy_likelihood_drops_the_cheapest_unit_first(tiny_lm, examples):
    """Each step of greedy likelihood pruning removes the token whose removal leaves Eq. 1
    highest, checked step by step against answer_passes' teacher-forced log-likelihoods."""
    from mist_core.measures.evaluation import answer_log_likelihoods, greedy_likelihood
    from mist_core.scoring.prune import budget_tokens

    scorer = MistScorer(tiny_lm)
    enc = scorer.encode(examples[0])
    T = enc.chain_len
    masks = greedy_likelihood(tiny_lm, enc, [0.5, 0.8], batch_size=5)
    assert masks[0.5].sum() <= budget_tokens(0.5, T) and masks[0.8].sum() <= budget_tokens(0.8, T)
    assert not (masks[0.5] & ~masks[0.8]).any()  # one path: the smaller budget drops more
    # the first step, from the whole chain, by hand
    trials = [np.arange(T) != i for i in range(T)]
    lls = [a.log_likelihood for a in answer_passes(tiny_lm, [compressed_input(enc, t) for t in trials])]
    np.testing.assert_allclose(answer_log_likelihoods(tiny_lm, [compressed_input(enc, t) for t in trials]),
                               lls, rtol=1e-4, atol=1e-4)
    first = greedy_likelihood(tiny_lm, enc, [(T - 1) / T])[(T - 1) / T]
    assert (~first).sum() == 1 and int(np.nonzero(~first)[0][0]) == int(np.argmax(lls))
