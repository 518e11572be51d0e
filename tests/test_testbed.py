"""The downstream testbed: the task generator, its ground truth and labeller, the word-level
tokenizer, and (integration) the whole loop at smoke size."""
from __future__ import annotations

import json
import random
import re
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from mist_core.distill.synthetic import (EQUATION, MAX_VALUE, Step, apply, build_tokenizer,
                                         cue_spans, make_problem, make_problems, needed_spans,
                                         precision_recall, tiny_llama, token_mask, vocabulary_texts)


@pytest.fixture(scope="module")
def problems():
    return make_problems(300, seed=7)


@pytest.fixture(scope="module")
def word_tokenizer():
    return build_tokenizer(vocabulary_texts())


def test_steps_chain_and_stay_small(problems):
    for p in problems:
        assert 2 <= len(p.steps) <= 4
        for a, b in zip(p.steps, p.steps[1:]):
            assert b.before == a.after
        for s in p.steps:
            assert s.after == apply(s.op, s.before, s.operand)
            assert 1 <= s.after <= MAX_VALUE
        assert p.answer == str(p.steps[-1].after)


def test_question_states_every_operand_and_distractors(problems):
    for p in problems:
        assert f"has {p.steps[0].before} " in p.question
        for s in p.steps:
            if s.op == "*":
                assert {2: "doubles", 3: "triples"}[s.operand] in p.question
            else:
                assert re.search(rf"\b{s.operand}\b", p.question)
    # distractor facts carry numbers the answer does not need
    assert any(re.search(r"\d+ (years old|minutes away|friends)", p.question) for p in problems)


def test_ground_truth_spans_are_the_equations(problems):
    for p in problems:
        texts = [p.cot[a:b] for a, b in p.needed]
        expected = [str(x) for s in p.steps for x in (s.before, s.op, s.operand, s.after)]
        assert texts == expected
        # exactly one copy of each: every needed span lies inside one of the equations
        eqs = [m.span() for m in EQUATION.finditer(p.cot)]
        assert len(eqs) == len(p.steps)
        assert all(any(a0 <= a and b <= b0 for a0, b0 in eqs) for a, b in p.needed)
        # the chain has more than the equations: narration, filler, restatements
        assert sum(b - a for a, b in p.needed) < len(p.cot) / 3


def test_labeller_recovers_the_generator_spans(problems):
    for p in problems:
        spans, found = needed_spans(p.cot, p.steps)
        assert found == len(p.steps)
        assert spans == list(p.needed)


def test_labeller_on_generated_style_chains():
    steps = [Step("+", 4, 3, 7), Step("*", 2, 7, 14)]
    # A model's chain: other wording, a stray equation with other values first, a number
    # restated, spacing the generator never writes.
    cot = ("First 2 + 2 = 4 is not it. Ann had 3 apples and got 4, so 3 + 4 = 7 apples. "
           "Doubling: 7 * 2 = 14. Ann has 14.")
    spans, found = needed_spans(cot, steps)
    assert found == 2
    assert [cot[a:b] for a, b in spans] == ["3", "+", "4", "7", "7", "*", "2", "14"]
    assert spans[0][0] == cot.index("3 + 4")
    # a chain that garbles a step: that step is missing, the other still found
    spans, found = needed_spans("So 3 + 4 = 8. Then 7 * 2 = 14.", steps)
    assert found == 1 and len(spans) == 4
    # steps are matched in order: an equation before the previous step's does not count
    spans, found = needed_spans("7 * 2 = 14. Then 3 + 4 = 7.", steps)
    assert found == 1


def test_cue_spans_find_each_steps_verb():
    steps = [Step("-", 5, 9, 4), Step("*", 3, 4, 12), Step("+", 6, 12, 18)]
    cot = ("Cara starts with 9 pens. She loses 5, so 9 - 5 = 4. The number triples, so "
           "4 * 3 = 12. The pens are kept in a box. A friend gives her 6 more, so 12 + 6 = 18.")
    assert [cot[a:b] for a, b in cue_spans(cot, steps)] == ["starts with 9", "loses", "triples",
                                                            "gives"]
    # "gives away" is one cue; a step whose narration has no verb has none
    cot = "She gives away 5, so 9 - 5 = 4. So 4 * 3 = 12."
    assert [cot[a:b] for a, b in cue_spans(cot, steps[:2])] == ["gives away"]
    # the generator's own chains have the start and one cue per step
    for p in make_problems(50, seed=3):
        assert len(cue_spans(p.cot, p.steps)) == 1 + len(p.steps)


def test_token_mask_precision_recall():
    offsets = np.array([[0, 3], [3, 5], [5, 9], [9, 12]])
    need = token_mask(offsets, [(4, 6)])
    assert need.tolist() == [False, True, True, False]
    p, r = precision_recall(np.array([True, True, False, False]), need)
    assert (p, r) == (0.5, 0.5)
    assert np.isnan(precision_recall(np.zeros(4, bool), need)[0])


def test_tokenizer_round_trips_and_numbers_are_one_token(problems, word_tokenizer):
    from mist_core.data.formats import sft_turns

    tok = word_tokenizer
    for p in problems[:50]:
        for budget in (0.5, 0.7, 1.0):
            user, assistant = sft_turns(question=p.question, cot=p.cot, answer=p.answer,
                                        budget=budget)
            text = tok.apply_chat_template([{"role": "user", "content": user},
                                            {"role": "assistant", "content": assistant}],
                                           tokenize=False)
            ids = tok(text, add_special_tokens=False)["input_ids"]
            assert tok.unk_token_id not in ids
            assert tok.decode(ids) == text
        enc = tok(p.cot, add_special_tokens=False, return_offsets_mapping=True)
        for a, b in p.needed:  # each number and operator is exactly one token
            assert sum(1 for s, e in enc["offset_mapping"] if s < b and e > a) == 1
    assert len(tok(" 57", add_special_tokens=False)["input_ids"]) == 1
    assert tok.eos_token == "<|im_end|>" and tok.pad_token_id != tok.eos_token_id


def test_pruned_chains_tokenize_to_the_kept_tokens(problems, word_tokenizer):
    """What a method keeps is what the fine-tuned model is taught to write: the kept
    pieces, re-tokenized, are the kept tokens."""
    from mist_core import Example, prune
    from mist_core.data.templates import get_template
    from mist_core.models import wrap_model
    from mist_core.scoring.scorer import ScoredChain

    tok = word_tokenizer
    lm = wrap_model(tiny_llama(tok, layers=2, hidden=32), tok)
    template = get_template("auto", tok, lm.max_length)
    rng = np.random.default_rng(0)
    for p in problems[:20]:
        enc = template.encode(Example(p.question, p.cot, p.answer, id=p.id))
        scored = ScoredChain.from_encoded(enc, "random", rng.random(enc.chain_len))
        (c,) = prune(enc.example, scored, budgets=(0.5,))
        ids = tok(c.text, add_special_tokens=False)["input_ids"]
        chain_ids = enc.source_ids[enc.chain_start: enc.chain_stop][c.kept]
        assert tok.convert_ids_to_tokens(ids)[1:] == tok.convert_ids_to_tokens(chain_ids)[1:]
        assert len(ids) == c.kept_tokens


def test_problems_are_reproducible_and_disjoint():
    a = make_problems(50, seed=3)
    assert [p.question for p in a] == [p.question for p in make_problems(50, seed=3)]
    b = make_problems(50, seed=4, exclude=[p.question for p in a])
    assert not {p.question for p in a} & {p.question for p in b}
    assert make_problem(random.Random(1), "x").id == "x"


def test_t_interval_and_render(tmp_path):
    from pipelines.loop.testbed import READING, Sizes, existing_reading, render, t_interval

    m, h = t_interval([0.5, 0.6, 0.7])
    assert m == pytest.approx(0.6) and h == pytest.approx(4.303 * 0.1 / 3 ** 0.5)
    assert np.isnan(t_interval([0.5])[1])

    def seed(acc_mist, acc_h2o):
        arm = lambda acc: {"budgets": {g: {"accuracy": acc, "chain_tokens": 10.0}  # noqa: E731
                                       for g in ("0.5", "0.7", "1.0")}}
        ctl = {"budgets": {"1.0": {"accuracy": 0.5, "chain_tokens": 0.0}}}
        kept = {g: {"precision": 0.4, "recall": 0.8, "n": 5} for g in ("0.5", "0.7")}
        return {"target": {"accuracy": 0.7}, "phase0": {"kept": 5},
                "kept": {"mist": kept, "h2o": kept,
                         "_chains": {"needed_share": 0.2, "tokens": 40.0}},
                "arms": {"mist": arm(acc_mist), "h2o": arm(acc_h2o), "full_chain": ctl,
                         "no_chain": ctl}}

    seeds = {0: seed(0.6, 0.5), 1: seed(0.7, 0.5), 2: seed(0.8, 0.5)}
    md = render(seeds, ["mist", "h2o"], Sizes(), "mist testbed", "Kept text.")
    assert "| mist | 0.5 | 70.0 ± 24.8 | 10.0 ± 0.0 | 40.0 ± 0.0 | 80.0 ± 0.0 | — |" in md
    assert "| 0.5 | 20.0 ± 24.8 | 0.0 ± 0.0 |" in md  # MIST − H2O, paired
    path = tmp_path / "downstream.md"
    path.write_text(md)
    assert existing_reading(path).strip() == "Kept text." and md.count(READING) == 1


def _scored_alone(method: str, lm, chains: list[dict]):
    """testbed._scored's ScoredChains of one method on `chains`, and the cache of the
    scorings it combined."""
    from mist_core.data.examples import Example
    from mist_core.data.templates import get_template
    from pipelines.loop.testbed import _scored

    template = get_template("auto", lm.tokenizer, lm.max_length)
    encoded = [template.encode(Example(c["question"], c["cot"], c["answer"], id=c["id"]))
               for c in chains]
    cache = {"unit": "token"}
    return _scored(method, lm, encoded, None, 0, cache), cache


def test_oracle_variants_and_controls_prune_as_defined(problems, word_tokenizer):
    """score_and_prune on generator chains with an untrained target: the oracle keeps the
    ground truth, head the first tokens, the hybrid is its two z-scores' mean, mist_alpha
    takes an α of the grid, and the equation unit keeps equations whole."""
    from mist_core.distill.synthetic import EQUATION as STEP
    from mist_core.models import wrap_model
    from pipelines.loop.testbed import ALPHAS, score_and_prune

    lm = wrap_model(tiny_llama(word_tokenizer, layers=2, hidden=32), word_tokenizer, "t")
    chains = [{**p.row(), "source_id": p.id} for p in problems[:4]]
    methods = ["oracle", "oracle_near", "oracle_cue", "head", "hybrid", "mist_alpha",
               "mist_equation", "mist_mean", "mist_clipped", "mist_facts"]
    compressed, kept = score_and_prune(lm, chains, methods, seed=0)
    for g in ("0.5", "0.7"):  # the numbers and operators first: no less of the ground truth
        assert kept["mist_facts"][g]["recall"] >= kept["mist_clipped"][g]["recall"]
    for c in chains:
        for g in (0.5, 0.7):
            facts = re.findall(r"\d+|[-+*=]", compressed["mist_facts"][c["id"]][g])
            assert len(facts) >= len(re.findall(r"\d+|[-+*=]", compressed["mist_clipped"][c["id"]][g]))
    for oracle in ("oracle", "oracle_near", "oracle_cue"):
        assert kept[oracle]["0.5"]["recall"] == 1.0 and kept[oracle]["0.5"]["equals"] == 1.0
    for c in chains:  # oracle_cue keeps each step's cue verb with its equation
        cues = [c["cot"][a:b] for a, b in cue_spans(c["cot"], [Step(*t) for t in c["steps"]])]
        assert len(cues) == 1 + len(c["steps"])
        text = compressed["oracle_cue"][c["id"]][0.5]
        at = 0
        for cue in cues:
            at = text.index(cue, at) + len(cue)
    assert kept["mist_alpha"]["alpha"] in ALPHAS
    for c in chains:
        words = c["cot"].split()
        head = compressed["head"][c["id"]][0.5].split()
        assert head == words[:len(head)]
        for g in (0.5, 0.7):  # every `=` kept stands in a whole equation
            text = compressed["mist_equation"][c["id"]][g]
            assert text.count("=") == len(STEP.findall(text))
    # oracle_near fills by distance to the ground truth and the `=` signs
    from pipelines.loop.testbed import _nearness
    np.testing.assert_allclose(_nearness(np.array([0, 0, 1, 0, 0, 0, 1], bool)),
                               [1 / 3, 1 / 2, 1, 1 / 2, 1 / 3, 1 / 2, 1])
    assert not _nearness(np.zeros(3, bool)).any()
    # the hybrid from the two scorings it combines
    from mist_core.scoring.scorer import zscore

    hybrid, cache = _scored_alone("hybrid", lm, chains)
    for h, m, a in zip(hybrid, cache["mist_clipped"], cache["h2o"]):
        np.testing.assert_allclose(h.scores, 0.5 * zscore(m.scores) + 0.5 * zscore(np.log(a.scores)))


def test_writer_arms_and_equations_first(problems, word_tokenizer):
    """The writer's variants: writer_hybrid (MistScorer's target "both") is the mean of
    mist_clipped's and necessity_writer's z-scores; an `_eq` arm keeps every equation of the
    chain whole (they fit the budget here); a `_facts` arm keeps every number."""
    from mist_core.distill.synthetic import EQUATION as STEP
    from mist_core.models import wrap_model
    from mist_core.scoring.scorer import zscore
    from pipelines.loop.testbed import score_and_prune

    lm = wrap_model(tiny_llama(word_tokenizer, layers=2, hidden=32), word_tokenizer, "t")
    chains = [{**p.row(), "source_id": p.id} for p in problems[:4]]
    methods = ["writer_hybrid_eq", "necessity_writer_facts", "mist_writer_eq"]
    compressed, kept = score_and_prune(lm, chains, methods, seed=0)
    for c in chains:
        equations = STEP.findall(c["cot"])
        for g in (0.5, 0.7):
            for arm in ("writer_hybrid_eq", "mist_writer_eq"):
                assert len(STEP.findall(compressed[arm][c["id"]][g])) == len(equations)
            assert (re.findall(r"\d+", compressed["necessity_writer_facts"][c["id"]][g])
                    == re.findall(r"\d+", c["cot"]))
    for arm in methods:
        assert kept[arm]["0.5"]["recall"] == 1.0
    hybrid, _ = _scored_alone("writer_hybrid", lm, chains)
    mist, _ = _scored_alone("mist_clipped", lm, chains)
    writer, _ = _scored_alone("necessity_writer", lm, chains)
    for h, m, w in zip(hybrid, mist, writer):
        np.testing.assert_allclose(h.scores, 0.5 * zscore(m.scores) + 0.5 * zscore(w.scores),
                                   rtol=1e-5, atol=1e-5)


def test_sentence_arms_drop_whole_sentences(problems, word_tokenizer):
    """The `_sent` arms: the method's scores pruned with sentences_first and facts_first
    (uniform_sent on the uniform scores, writer_hybrid_sent on the default's); every equation
    stays whole and the budget is kept to the token."""
    from mist_core.data.examples import Example
    from mist_core.distill.synthetic import EQUATION as STEP
    from mist_core.models import wrap_model
    from mist_core.scoring.prune import budget_tokens, prune
    from pipelines.loop.testbed import score_and_prune

    lm = wrap_model(tiny_llama(word_tokenizer, layers=2, hidden=32), word_tokenizer, "t")
    chains = [{**p.row(), "source_id": p.id} for p in problems[:4]]
    compressed, kept = score_and_prune(lm, chains, ["writer_hybrid_sent", "uniform_sent", "oracle_sent"],
                                       seed=0)
    uniform, _ = _scored_alone("uniform", lm, chains)
    for c, u in zip(chains, uniform):
        ex = Example(c["question"], c["cot"], c["answer"], id=c["id"])
        for g in (0.5, 0.7):
            [want] = prune(ex, u, budgets=[g], sentences_first="equations", facts_first=True)
            assert compressed["uniform_sent"][c["id"]][g] == want.text
            assert want.kept_tokens == budget_tokens(g, len(u.scores))
            for arm in ("writer_hybrid_sent", "oracle_sent"):
                text = compressed[arm][c["id"]][g]
                assert len(STEP.findall(text)) == len(STEP.findall(c["cot"])), (arm, text)
    assert kept["writer_hybrid_sent"]["0.5"]["recall"] > 0.9
    # the ceiling under the rule keeps every ground-truth token and `=`
    assert kept["oracle_sent"]["0.5"]["recall"] == 1.0 and kept["oracle_sent"]["0.5"]["equals"] == 1.0


def test_a_stored_seed_is_not_scored_again(tmp_path, monkeypatch):
    """A seed whose arms and kept shares are all stored (a resumed or re-rendered run) is
    returned as stored, without scoring; an arm added to it scores that method alone."""
    from pipelines.loop import testbed

    root = tmp_path / "seed0"
    root.mkdir()
    arms = {a: {"budgets": {"1.0": {"accuracy": 0.5}}, "train_seconds": 1.0}
            for a in list(testbed.CONTROLS) + ["h2o", "all_of_k"]}
    sizes = testbed.Sizes(mix="per_budget")
    state = {"sizes": json.loads(json.dumps(testbed.asdict(sizes))),
             "target": {"accuracy": 0.7}, "arms": arms, "kept": {"h2o": {}}}
    (root / "results.json").write_text(json.dumps(state))
    chain = {"correct": True, "finished": True}
    monkeypatch.setattr(testbed, "train_target", lambda *a: None)
    monkeypatch.setattr(testbed, "phase0", lambda *a, **k: [chain])
    samples = [{"id": "q#0", "source_id": "q", "tokens": 9}, {"id": "q#3", "source_id": "q", "tokens": 5}]
    sampled = []
    monkeypatch.setattr(testbed, "samples_of_k", lambda *a: sampled.append(1) or samples)
    scored, trained, asked = [], {}, []

    def score_and_prune(lm, chains, methods, seed, unit, budgets):
        scored.append(list(methods))
        asked.append(budgets)
        return ({m: {c.get("id", "p0"): {g: f"{m}@{g}" for g in budgets} for c in chains}
                 for m in methods}, {m: {"0.5": {}} for m in methods})

    def chains_of(method, cid, budgets=testbed.TRAIN_BUDGETS):
        return {cid: {g: f"{method}@{g}" for g in budgets}}

    def run_per_budget(arm, target, chains, compressed, *a):
        trained[arm] = (chains, compressed)
        return {"budgets": {"0.5": {"accuracy": 0.1}}, "train_seconds": 2.0}

    monkeypatch.setattr(testbed, "score_and_prune", score_and_prune)
    monkeypatch.setattr(testbed, "run_per_budget", run_per_budget)
    out = testbed.run_seed(0, sizes, ["h2o", "all_of_k"], tmp_path, None)
    # nothing needs k samples: all_of_k (no kept shares, trained whole) is stored
    assert scored == [] and out["arms"] == arms and sampled == []
    out = testbed.run_seed(0, sizes, ["h2o", "uniform"], tmp_path, None)
    assert scored == [["uniform"]] and set(out["kept"]) == {"h2o", "uniform"}
    assert out["arms"]["uniform"]["train_seconds"] == 2.0
    assert trained["uniform"] == ([chain], chains_of("uniform", "p0")) and sampled == []
    # an arm on the shortest chains scores its base method on them and trains on them
    out = testbed.run_seed(0, sizes, ["h2o", "uniform", "shortest_sent"], tmp_path, None)
    assert scored[1:] == [["writer_hybrid_sent"]] and "shortest_sent" in out["kept"]
    assert trained["shortest_sent"] == ([samples[1]], chains_of("writer_hybrid_sent", "q#3"))
    assert sampled == [1]
    # a mixture arm scores its base on the Phase 0 chains and trains one model on every γ
    # of them under its own mix, whatever the recipe's
    runs = []
    monkeypatch.setattr(testbed, "arm_records", lambda arm, corpus, comp, seed, mix, *a:
                        runs.append((arm, corpus, comp, mix)) or ["record"])
    monkeypatch.setattr(testbed, "run_arm", lambda arm, target, records, *a: {
        "budgets": {"0.5": {"accuracy": 0.2}, "1.0": {"accuracy": 0.6}}, "train_seconds": 3.0})
    out = testbed.run_seed(0, sizes, ["h2o", "sent_mix_all"], tmp_path, None)
    assert scored[2:] == [["writer_hybrid_sent"]] and "sent_mix_all" in out["kept"]
    assert runs == [("sent_mix_all", [chain], chains_of("writer_hybrid_sent", "p0"), "all")]
    assert out["arms"]["sent_mix_all"]["budgets"]["1.0"]["accuracy"] == 0.6
    # ... or on the shortest chains, where its base is an arm on them
    out = testbed.run_seed(0, sizes, ["h2o", "shortest_mix_all"], tmp_path, None)
    assert scored[3:] == [["writer_hybrid_sent"]] and "shortest_mix_all" in out["kept"]
    assert runs[1:] == [("shortest_mix_all", [samples[1]], chains_of("writer_hybrid_sent", "q#3"),
                         "all")]
    # the job's five budgets: the base pruned at each (a mixture scored beside it keeps its own)
    five = tuple(testbed.DEFAULT_BUDGETS)
    out = testbed.run_seed(0, sizes, ["h2o", "sent_mix_five", "sent_mix_sample"], tmp_path, None)
    assert scored[4:] == [["writer_hybrid_sent"]] and asked[-1] == five
    assert runs[2:] == [("sent_mix_five", [chain], chains_of("writer_hybrid_sent", "p0", five), "all"),
                        ("sent_mix_sample", [chain], chains_of("writer_hybrid_sent", "p0"), "sample")]


def test_seeds_in_parallel_share_one_target_trained_first(tmp_path, monkeypatch):
    """--jobs 2: the shared target is trained once, before any seed starts; each seed runs
    once in the pool and is yielded as it finishes; --jobs 1 runs them here, in order."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    from pipelines.loop import testbed

    events = []
    monkeypatch.setattr(testbed, "train_target",
                        lambda tok, problems, sizes, seed, path: events.append(("target", path)))
    monkeypatch.setattr(testbed, "target_problems", lambda sizes, seed: [])
    monkeypatch.setattr(testbed, "_pool", lambda workers, context: ThreadPoolExecutor(workers))

    def seed_in_worker(seed, sizes, methods, work, threads):
        time.sleep(0.3 * (2 - seed))  # seed 1 finishes before seed 0
        events.append(("seed", seed))
        return seed, {"seed": seed}

    monkeypatch.setattr(testbed, "_seed_in_worker", seed_in_worker)
    got = list(testbed.each_seed(range(2), testbed.Sizes(), ["h2o"], tmp_path, None, jobs=2))
    assert sorted(got, key=lambda x: x[0]) == [(0, {"seed": 0}), (1, {"seed": 1})]
    assert events[0] == ("target", tmp_path / "target") and len(events) == 3
    assert [s for s, _ in got] == [1, 0]  # as they finish

    monkeypatch.setattr(testbed, "run_seed", lambda seed, *a: {"here": seed})
    assert list(testbed.each_seed(range(2), testbed.Sizes(), [], tmp_path, None)) == \
        [(0, {"here": 0}), (1, {"here": 1})]


def test_the_default_arm_is_what_mist_compress_writes_by_default():
    """testbed.json's default_arm trains on the job's output under its defaults: the scorer's
    settings, the pruning rule, the budgets and the SFT mixture."""
    from pipelines.job.config import JobConfig
    from pipelines.loop import testbed

    job = JobConfig()
    base, mix, budgets = testbed.MIXTURES[testbed.DEFAULT_ARM]
    assert (list(budgets), mix) == (job.budgets, job.sft_mix)
    scorer = testbed.SENTENCES_OF[base]
    assert testbed.VARIANTS[scorer] == (job.method, {"layer_weights": job.layer_weights,
                                                     "target": job.target})
    assert testbed.SENTENCE_KEEP.get(base, "equations") == job.sentences_first
    assert job.facts_first


def test_the_default_arm_against_the_others_and_the_line(tmp_path):
    from pipelines.loop.testbed import DEFAULT_ARM, line_margin, plot, render, Sizes

    def arm(acc, tokens):
        return {"budgets": {g: {"accuracy": acc + d, "chain_tokens": tokens}
                            for g, d in (("0.5", 0.0), ("0.7", 0.01), ("1.0", 0.02))}}

    def ctl(acc, tokens):
        return {"budgets": {"1.0": {"accuracy": acc, "chain_tokens": tokens}}}

    kept = {g: {"precision": 0.4, "recall": 0.8, "n": 5} for g in ("0.5", "0.7")}
    seeds = {i: {"target": {"accuracy": 0.7}, "phase0": {"kept": 5},
                 "kept": {DEFAULT_ARM: kept, "h2o": kept, "_chains": {"needed_share": 0.2, "tokens": 40.0}},
                 "arms": {DEFAULT_ARM: arm(0.60 + 0.01 * i, 20.0), "h2o": arm(0.40 + 0.02 * i, 20.0),
                          "full_chain": ctl(0.8, 40.0), "no_chain": ctl(0.1, 0.0),
                          "shortest_of_k": ctl(0.62 - 0.03 * i, 30.0)}} for i in range(4)}
    # the line at 20 of 40 tokens: 0.1 + 0.7 / 2 = 0.45
    assert line_margin(seeds[0], DEFAULT_ARM, 0.5) == pytest.approx(0.15)
    assert line_margin(seeds[0], "h2o", 0.5) == pytest.approx(-0.05)
    md = render(seeds, [DEFAULT_ARM, "h2o"], Sizes(), "mist testbed", "")
    assert "| h2o | 18.5 ± 2.1 | ahead | 18.5 ± 2.1 | ahead |" in md  # 0.20 − 0.01·i, t(3) = 3.182
    assert "| full_chain | -18.5 ± 2.1 | behind |" in md
    assert "| shortest_of_k | 4.0 ± 8.2 | tie |" in md  # −0.02 + 0.04·i: the interval spans 0
    assert f"| {DEFAULT_ARM} | 0.5 | 16.5 ± 2.1 | ahead |" in md
    assert "| h2o | 0.5 | -2.0 ± 4.1 | tie |" in md
    assert "Calibration" not in md  # no ceiling ran
    for i, sd in seeds.items():  # a ceiling at 0.72 and 0.76 of 0.8, 20 of 40 tokens
        sd["arms"]["oracle_cue"] = arm(0.72 + 0.04 * (i % 2), 20.0)
        sd["arms"]["oracle_cue"]["budgets"]["1.0"]["accuracy"] = 0.8  # one model per γ
        sd["kept"]["oracle_cue"] = kept
    md = render(seeds, [DEFAULT_ARM, "h2o", "oracle_cue"], Sizes(), "mist testbed", "")
    # shares 0.90 and 0.95 of the control: mean 92.5, t(3)·sd/2 = 3.182 · 0.0289 / 2 = 4.6
    assert "| oracle_cue | 92.5 ± 4.6% | 50.0 ± 0.0% | 93.8 ± 4.6% | 50.0 ± 0.0% | yes |" in md
    for sd in seeds.values():
        sd["arms"]["oracle_cue"]["budgets"]["0.5"]["chain_tokens"] = 26.0  # 65% of 40: too long
    md = render(seeds, [DEFAULT_ARM, "h2o", "oracle_cue"], Sizes(), "mist testbed", "")
    assert "| 65.0 ± 0.0% | 93.8 ± 4.6% | 50.0 ± 0.0% | no |" in md
    plot(seeds, [DEFAULT_ARM, "h2o"], tmp_path / "downstream.png")
    assert (tmp_path / "downstream.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.integration
def test_smoke_run_has_signal(tmp_path):
    """The whole loop at smoke size: a target trained from scratch, its own chains scored
    by MIST and H2O, fine-tuned copies, the controls. The experiment has signal only if a
    model trained on full chains answers better than one trained on answers alone."""
    from pipelines.loop.testbed import main

    out = tmp_path / "out"
    assert main(["--smoke", "--out", str(out), "--work", str(tmp_path / "work")]) == 0
    result = json.loads((out / "testbed.json").read_text())
    seed = result["seeds"]["0"]
    full = seed["arms"]["full_chain"]["budgets"]["1.0"]["accuracy"]
    none = seed["arms"]["no_chain"]["budgets"]["1.0"]["accuracy"]
    assert full >= none + 0.15, (full, none)
    assert seed["arms"]["no_chain"]["budgets"]["1.0"]["chain_tokens"] < 2
    for method in ("mist", "h2o"):
        assert set(seed["arms"][method]["budgets"]) == {"0.5", "0.7", "1.0"}
        kept = seed["kept"][method]["0.5"]
        assert 0 <= kept["precision"] <= 1 and 0 <= kept["recall"] <= 1 and kept["n"] > 0
    md = (out / "downstream.md").read_text()
    assert "mist testbed --smoke" in md
    assert "| mist | 0.5 |" in md and "| no_chain | 1 |" in md


def test_calibration_table_appends_and_judges_the_bar(tmp_path):
    """benchmarks/testbed_calibration.py: the oracle arms' shares of the full-chain control,
    the bar judged on them, and --append keeping rows of runs no longer at hand."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "testbed_calibration.py"
    spec = importlib.util.spec_from_file_location("testbed_calibration", path)
    cal = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cal)

    def run(folder, acc, tokens, corpus):
        budgets = {"1.0": {"accuracy": 0.8, "chain_tokens": 50.0},
                   "0.5": {"accuracy": acc, "chain_tokens": tokens},
                   "0.7": {"accuracy": 0.7, "chain_tokens": 40.0}}
        seed = {"arms": {"full_chain": {"budgets": {"1.0": budgets["1.0"]}},
                         "oracle_cue": {"budgets": budgets}}}
        folder.mkdir()
        (folder / "testbed.json").write_text(json.dumps({
            "sizes": {"mix": "per_budget", "ft_epochs": 4, "ft_lr": 1e-3, "phase0": corpus},
            "seeds": {"0": seed}}))
        return str(folder)

    md = tmp_path / "calibration.md"
    md.write_text("# Calibration\n\n## Reading\n\nby hand\n")
    assert cal.main([run(tmp_path / "a", 0.6, 25.0, 1000), "--out", str(md)]) == 0
    assert cal.main([run(tmp_path / "b", 0.76, 29.0, 3000), "--append", "--out", str(md)]) == 0
    text = md.read_text()
    rows = [ln for ln in text.splitlines() if ln.startswith("| mix")]
    assert len(rows) == 2 and "corpus 1000" in rows[0] and "corpus 3000" in rows[1]
    assert "| 75.0% | 50.0% |" in rows[0] and rows[0].endswith("| no |")  # 0.6 / 0.8
    assert "| 95.0% | 58.0% |" in rows[1] and rows[1].endswith("| yes |")  # 0.76 / 0.8, 29 / 50
    assert text.startswith("# Calibration\n") and text.endswith("## Reading\n\nby hand\n")


@pytest.mark.integration
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl's parent-death signal")
def test_seed_workers_die_with_the_testbed(tmp_path):
    """A `--jobs N` testbed killed (SIGKILL: no cleanup runs) takes its seed workers with it."""
    import signal
    import subprocess

    script = ("import multiprocessing, os, time\n"
              "from pipelines.loop import testbed\n"
              "pool = testbed._pool(1, multiprocessing.get_context('spawn'))\n"
              "print(pool.submit(os.getpid).result(), flush=True)\n"
              "time.sleep(120)\n")
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                              text=True, cwd=Path(__file__).resolve().parents[1])
    worker = int(parent.stdout.readline())
    assert _alive(worker)
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 30
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(worker)


def _alive(pid: int) -> bool:
    """A process that runs (not a zombie waiting for its reaper)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_the_sample_controls_train_on_every_right_sample_or_each_questions_shortest(monkeypatch):
    """samples_of_k: the Phase 0 chains, then the right and finished ones of the k − 1 more
    samples, each chain once per question; all_of_k trains on every one of them whole,
    shortest_of_k on each question's shortest (the first among equals)."""
    from mist_core.distill.generation import shortest_per_question
    from pipelines.loop import testbed

    def s(q, i, cot, correct=True):
        return {"id": f"{q}#{i}", "source_id": q, "question": f"Q{q}", "cot": cot, "answer": "1",
                "tokens": len(cot.split()), "correct": correct, "finished": True}

    chains = [s("a", 0, "one two three"), s("b", 0, "x y")]
    more = [s("a", 1, "one two"), s("a", 2, "one two three"), s("a", 3, "no", correct=False),
            s("b", 1, "u v"), s("b", 2, "w")]
    monkeypatch.setattr(testbed, "phase0", lambda *a, **k: more)
    samples = testbed.samples_of_k(None, [], chains, testbed.Sizes(), 0, None)
    assert [x["id"] for x in samples] == ["a#0", "b#0", "a#1", "b#1", "b#2"]
    assert {q: x["id"] for q, x in shortest_per_question(samples).items()} == {"a": "a#1", "b": "b#2"}
    every = testbed.arm_records("all_of_k", chains, None, 0, samples=samples)
    assert [r["completion"][0]["content"].split("\n")[0] for r in every] == [
        x["cot"] for x in samples]
    short = testbed.arm_records("shortest_of_k", chains, None, 0, samples=samples)
    assert [r["completion"][0]["content"].split("\n")[0] for r in short] == ["one two", "w"]
    assert testbed._whole("all_of_k") and not testbed._whole("shortest_sent")
