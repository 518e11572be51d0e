"""The downstream testbed: which compression trains the better model, on a generated task
whose needed chain tokens are known (mist_core/distill/synthetic.py).

Per seed, in this process (no Ray; a few tiny models on a CPU):
  1. problems: the target's training set, the Phase 0 questions and the test set;
  2. the target: a tiny Llama trained from scratch on the generator's full chains (one
     for all seeds by default: it is most of a seed's time; --target-per-seed for one each);
  3. Phase 0: the target writes its own chain for each Phase 0 question (sampled); the
     correct ones are the chains to compress, labelled with the generator's ground truth;
  4. every method scores those chains; pruning keeps ⌈γT⌉ tokens at γ = 0.5 and 0.7; each
     kept set is measured against the ground truth (precision, recall);
  5. Phase 2: fresh copies of the trained target are fine-tuned on each method's chains
     (the calibrated recipe, mix "per_budget": one model per pruned γ, the directive in
     the prompt; or a mixture, formats.sft_records), and on the controls: full chains,
     the answer alone (no chain), and each question's shortest correct chain of k;
  6. Phase 3: each fine-tuned model answers the test set greedily under γ = 0.5, 0.7 and
     1.0 (the controls, trained without directives, under 1.0): accuracy and the tokens of
     the chain it writes.
Everything a seed produced is kept in --work (models, Phase 0 chains, per-arm results; by
default under $MIST_CACHE or ~/.cache/mist), so a rerun resumes where it stopped. The seeds' numbers go to <out>/testbed.json and the
table, mean and 95% interval over seeds, to <out>/downstream.md; the text under its
`## Reading` heading is written by hand and kept when the file is regenerated.

    mist testbed --seeds 8 --jobs 2 --out docs/results  # hours: resume with the same --work
    mist testbed --smoke --out /tmp/testbed-smoke       # ~2 min

docs/results/calibration.md measures the recipe and what a seed costs.
"""
from __future__ import annotations

import json
import logging
import math
import os
import shlex
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
from pydantic import field_validator

from ..common.errors import ConfigError
from ..common.settings import DEFAULT_BUDGETS, Kit, listed, parse, positive, setting
from ..common.exits import run_main

log = logging.getLogger("pipelines.loop.testbed")

METHODS = ("mist", "necessity", "sufficiency", "h2o", "crisp", "perplexity", "gogi_l1", "uniform",
           "tail", "head", "mist_clipped", "mist_mean", "mist_equation", "mist_alpha", "hybrid",
           "mist_facts", "h2o_facts", "mist_writer", "necessity_writer", "writer_hybrid",
           "mist_writer_facts", "necessity_writer_facts", "writer_hybrid_facts", "mist_eq",
           "h2o_eq", "mist_writer_eq", "necessity_writer_eq", "writer_hybrid_eq",
           "writer_hybrid_sent", "writer_hybrid_sentf", "uniform_sent", "oracle", "oracle_near",
           "oracle_cue", "oracle_sent", "shortest_sent", "all_of_k", "sent_mix_all",
           "sent_mix_sample", "shortest_mix_all", "sent_mix_five")
# Not scorers: `head` keeps the first tokens (truncation), `tail` the last; `oracle` keeps the
# generator's ground truth (operands, operators, results) and the equations' `=` first, then
# random tokens up to ⌈γT⌉: the ceiling for any scorer. `oracle_near` fills with the tokens
# nearest the ground truth instead (the words that lead to each equation, "loses 5, so"),
# dropping the filler and distractor sentences first. `oracle_cue` is oracle_near with each
# step's cue verb (`loses`, `doubles`: what points the writer at the question's next
# sentence) in the ground truth too: the ceiling for a writer rather than a reader.
# `oracle_sent` prunes oracle_cue's scores with the sentence rule (SENTENCES_OF): the ceiling
# for a scorer under the job's default pruning.
POSITIONAL = ("head", "tail")
# Variants beyond the paper (issue: keep one only where it wins here and on the GSM8K/MATH
# proxies): name -> (scorer, its options).
ANSWER = {"target": "answer"}  # necessity of the answer alone (Eq. 1), the paper's
VARIANTS = {"mist": ("mist", {"layer_weights": "signed", **ANSWER}),  # the paper's MIST, axes
            "necessity": ("necessity", {"layer_weights": "signed", **ANSWER}),
            "sufficiency": ("sufficiency", {"layer_weights": "signed"}),
            "mist_clipped": ("mist", {"layer_weights": "clipped", **ANSWER}),
            # clipped weights and necessity against the chain's mean state
            "mist_mean": ("mist", {"layer_weights": "clipped", "ablation": "mean", **ANSWER}),
            # clipped weights, pruned by equations (UNIT_OF)
            "mist_equation": ("mist", {"layer_weights": "clipped", **ANSWER}),
            # clipped weights, α chosen on a validation slice by Eq. 1 (ALPHAS)
            "mist_alpha": ("mist", {"layer_weights": "clipped", **ANSWER}),
            # clipped weights, necessity of the answer and of the chain's own numbers and
            # operators (target "facts": the words later steps are written from count too)
            "mist_writer": ("mist", {"layer_weights": "clipped", "target": "facts"}),
            "necessity_writer": ("necessity", {"layer_weights": "clipped", "target": "facts"}),
            # both, one scorer: 0.5·z(mist_clipped) + 0.5·z(necessity_writer), each chain
            "writer_hybrid": ("mist", {"layer_weights": "clipped", "target": "both"})}
UNIT_OF = {"mist_equation": "equation"}
# Another method's scores, pruned with the numbers and operators first (prune's facts_first)
# or with the equations first (equations_first).
FACTS_OF = {"mist_facts": "mist_clipped", "h2o_facts": "h2o", "mist_writer_facts": "mist_writer",
            "necessity_writer_facts": "necessity_writer", "writer_hybrid_facts": "writer_hybrid"}
EQUATIONS_OF = {"mist_eq": "mist_clipped", "h2o_eq": "h2o", "mist_writer_eq": "mist_writer",
                "necessity_writer_eq": "necessity_writer", "writer_hybrid_eq": "writer_hybrid"}
# Another method's scores, pruned with whole sentences dropped first (prune's
# sentences_first: the sentences without an equation, lowest mean score first), the numbers
# and operators first in what is left. uniform_sent: random scores, the same rule (what the
# rule does without a scorer); oracle_sent: the writer's ceiling, the same rule.
SENTENCES_OF = {"writer_hybrid_sent": "writer_hybrid", "uniform_sent": "uniform",
                "writer_hybrid_sentf": "writer_hybrid", "oracle_sent": "oracle_cue"}
# sentences_first of each: the sentences without an equation go whole, or (sentf) those
# without a number or an operator.
SENTENCE_KEEP = {"writer_hybrid_sentf": "facts"}
TRAIN_BUDGETS = (0.5, 0.7)  # the pruned budgets of the mixture; 1.0 (the full chain) joins them
# Another method run on each question's shortest correct chain of k (shortest_of_k's corpus)
# instead of its Phase 0 chain: whether sampling's shortening and pruning's add up.
OF_SHORTEST = {"shortest_sent": "writer_hybrid_sent"}
# Another method's chains under a mixture recipe whatever --mix says: one model for every γ,
# trained on every chain at each pruned γ and whole ("all", `mist compress`'s default
# sft_mix) or on one γ per chain ("sample", its earlier default), answering under each;
# against the per-budget models of the base: what a mixture costs or buys at each γ.
# name -> (base, mix, the pruned budgets trained on): TRAIN_BUDGETS, or `mist compress`'s
# default five (sent_mix_five: the job's output as it ships).
MIXTURES = {"sent_mix_all": ("writer_hybrid_sent", "all", TRAIN_BUDGETS),
            "sent_mix_sample": ("writer_hybrid_sent", "sample", TRAIN_BUDGETS),
            "shortest_mix_all": ("shortest_sent", "all", TRAIN_BUDGETS),
            "sent_mix_five": ("writer_hybrid_sent", "all", tuple(DEFAULT_BUDGETS))}
ALPHAS = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
ALPHA_SLICE = 60  # Phase 0 chains α is chosen on
# name -> (method a, method b, w, whether b's scores are taken in log): w·z(a) + (1 − w)·z(b).
# hybrid: MIST with the attention signal that keeps intermediate results better. (The
# writer's hybrid, the answer's MIST with the necessity of the chain's own facts, is one
# scorer: MistScorer's target "both", VARIANTS.)
HYBRIDS = {"hybrid": ("mist_clipped", "h2o", 0.5, True)}
CONTROLS = ("full_chain", "no_chain", "shortest_of_k")
# Controls run only when asked for (--methods), trained whole and answering under 1.0 like
# the three: `all_of_k`, every right sample of k of each question (what `mist generate
# --keep all` writes), against shortest_of_k's one (--keep shortest).
WHOLE = ("all_of_k",)
# the ceilings: random fill, the nearest tokens, with the writer's cues, and those under the
# sentence rule
ORACLES = ("oracle", "oracle_near", "oracle_cue", "oracle_sent")
# The arm of the project's default method and output (MistScorer's and `mist compress`'s
# defaults: clipped layer weights, target "both", the sentences without an equation dropped
# first, then the numbers and operators kept first; SFT records of every chain at each of the
# job's default budgets and whole, sft_mix "all", one model trained on them). A test holds it
# to the job's defaults.
DEFAULT_ARM = "sent_mix_five"
EVAL_BUDGETS = (0.5, 0.7, 1.0)
STYLE = "gsm8k"  # numeric answers: answers.answer_correct compares numbers


@dataclass(frozen=True)
class Sizes:
    n_steps: tuple[int, int] = (2, 4)  # operations per problem
    # One target for every seed (trained once, on seed-independent problems), or one per
    # seed. Seeds always vary the Phase 0 questions and samples, the fine-tuning runs and
    # the test set.
    shared_target: bool = True
    target_train: int = 8000  # problems the target learns the task from
    phase0: int = 1000  # questions the target answers in Phase 0: the SFT corpus
    test: int = 300
    layers: int = 4
    hidden: int = 128
    # 1500 steps: 77% test accuracy in a probe (12 min on one contended core); lr 4e-3
    # trained worse, 750 steps reached 35%.
    target_epochs: float = 3.0
    target_lr: float = 3e-3  # from scratch: a tiny model takes a large step
    ft_epochs: float = 2.0
    ft_lr: float = 1e-3
    # The fine-tuning recipe: "sample", one γ per chain drawn by its id (formats.sft_records);
    # "all", every chain at every γ (three times the records); "per_budget", one model per
    # pruned γ on that γ's chains alone (γ = 1.0: the full-chain control).
    mix: str = "sample"
    unit: str = "token"  # the pruning unit (mist_core.scoring.prune.UNITS)
    shortest_k: int = 4  # samples per Phase 0 question for the shortest-of-k control
    batch_size: int = 16
    temperature: float = 0.7  # Phase 0 sampling
    max_new_tokens: int = 160  # the longest generator chain plus answer is about 110 tokens
    gen_batch: int = 100


# The calibrated recipe (docs/results/calibration.md, 2026-12-05): with 12000 Phase 0
# questions and one model per γ the writer's oracle keeps 91% of the full-chain accuracy
# at γ = 0.5 (6000: 88%; 3000: 73%).
FULL = Sizes(phase0=12000, mix="per_budget", ft_epochs=4.0)
# Two-step problems and a 2-block target, so that it answers some right after a couple of
# minutes (2 blocks: 2 min and the same signal as 4 blocks' 3.3 min; 3000 problems lose it).
# 1.5 epochs of the target (2026-12-07, one run each, alone): full chain 63% against no
# chain 8%, 111 s in all (2 epochs: 68% / 9%, 122 s; 1 epoch: 39% / 10%; lr 5e-3: the
# target itself answered 11%).
SMOKE = Sizes(n_steps=(2, 2), shared_target=False, target_train=6000, layers=2, phase0=300,
              test=100, target_epochs=1.5, shortest_k=2)


# ---------------------------------------------------------------- one seed

def _rows(problems) -> list[dict]:
    return [{"id": p.id, "question": p.question, "answer": p.answer} for p in problems]


def _save_json(path: Path, obj) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    os.replace(tmp, path)


def _whole(arm: str) -> bool:
    """A control: trained on whole chains (or none), answering under γ = 1.0 alone."""
    return arm in CONTROLS or arm in WHOLE


def _base(arm: str) -> str:
    """The method whose chains an arm trains on: a mixture's base, else the arm itself."""
    return MIXTURES[arm][0] if arm in MIXTURES else arm


def _trained(path: Path) -> bool:
    return (path / "config.json").is_file()


def train_target(tok, problems, sizes: Sizes, seed: int, path: Path):
    """The target: a fresh tiny Llama trained on the generator's full chains (no
    directive), or the one a previous run saved."""
    from mist_core.data.formats import sft_prompt_completion
    from mist_core.distill.finetune import finetune
    from mist_core.distill.synthetic import tiny_llama
    from mist_core.models import load_model, wrap_model

    if not _trained(path):
        lm = wrap_model(tiny_llama(tok, layers=sizes.layers, hidden=sizes.hidden, seed=seed), tok,
                        "target")
        records = [sft_prompt_completion(id=p.id, question=p.question, cot=p.cot, answer=p.answer,
                                         budget=1.0) for p in problems]
        finetune(lm, records, path, epochs=sizes.target_epochs, learning_rate=sizes.target_lr,
                 batch_size=sizes.batch_size, seed=seed, log_every=50,
                 gradient_checkpointing=False)  # a tiny model: the memory is not worth 30%
    return load_model(str(path))


def phase0(lm, problems, sizes: Sizes, seed: int, path: Path, k: int = 1) -> list[dict]:
    """The target's own chains for the Phase 0 questions (k samples each), with the
    problem's steps carried along for labelling."""
    from mist_core.distill.generation import sample_chains

    if path.is_file():
        return json.loads(path.read_text())
    by_id = {p.id: p for p in problems}
    samples = sample_chains(lm, _rows(problems), k=k, style=STYLE, temperature=sizes.temperature,
                            max_new_tokens=sizes.max_new_tokens, seed=seed,
                            batch_size=sizes.gen_batch)
    for s in samples:
        s["steps"] = by_id[s["source_id"]].row()["steps"]
    _save_json(path, samples)
    return samples


def samples_of_k(lm, problems, chains: list[dict], sizes: Sizes, seed: int, path: Path
                 ) -> list[dict]:
    """Every correct, finished sample of the corpus questions, each chain once per question:
    the Phase 0 chains, then those of k − 1 more samples of each question."""
    corpus = {c["source_id"] for c in chains}
    more = phase0(lm, [p for p in problems if p.id in corpus], sizes, seed + 1, path,
                  k=sizes.shortest_k - 1) if sizes.shortest_k > 1 else []
    seen, out = set(), []
    for s in list(chains) + [s for s in more if s["correct"] and s["finished"]]:
        if (s["source_id"], s["cot"]) not in seen:
            seen.add((s["source_id"], s["cot"]))
            out.append(s)
    return out


def score_and_prune(lm, chains: list[dict], methods, seed: int, unit: str = "token",
                    budgets=TRAIN_BUDGETS) -> tuple[dict, dict]:
    """Every method's compressed chains at each of `budgets` ({method: {chain id: {γ: text}}})
    and what they keep against the ground truth ({method: {γ: {precision, recall, n}}}: means
    over the chains whose every step the labeller found)."""
    from mist_core.data.examples import Example
    from mist_core.data.templates import get_template
    from mist_core.distill.synthetic import (Step, cue_spans, needed_spans, precision_recall,
                                             token_mask)
    from mist_core.errors import InvalidExample
    from mist_core.scoring.prune import prune

    template = get_template("auto", lm.tokenizer, lm.max_length)
    encoded, needed, labelled, equals, cues = [], [], [], [], []
    for c in chains:
        enc = template.encode(Example(c["question"], c["cot"], c["answer"], id=c["id"]))
        steps = [Step(*s) for s in c["steps"]]
        spans, found = needed_spans(c["cot"], steps)
        encoded.append(enc)
        needed.append(token_mask(enc.chain_offsets, spans))
        labelled.append(found == len(steps))
        # The equations' `=` signs are not in the ground truth (they carry no quantity) but
        # hold the chain's structure; what each method keeps of them is reported beside it.
        equals.append(np.array([c["cot"][a:b].strip() == "=" for a, b in enc.chain_offsets]))
        cues.append(token_mask(enc.chain_offsets, cue_spans(c["cot"], steps)))
    labels = {"needed": needed, "equals": equals, "cues": cues}
    compressed, kept_stats, timings, cache = {}, {}, {}, {"unit": unit}
    for method in methods:
        t0 = time.time()
        scored = _scored(method, lm, encoded, labels, seed, cache)
        timings[method] = time.time() - t0
        out, pr = {}, {g: [] for g in budgets}
        eq_kept = {g: [0, 0] for g in budgets}
        for enc, sc, need, ok, eq in zip(encoded, scored, needed, labelled, equals):
            if isinstance(sc, InvalidExample):  # not trained on: every method loses the same
                log.warning("%s: chain %s not scored: %s", method, enc.example.id, sc)
                continue
            kept = prune(enc.example, sc, budgets=budgets, unit=UNIT_OF.get(method, unit),
                         facts_first=method in FACTS_OF or method in SENTENCES_OF,
                         equations_first=method in EQUATIONS_OF,
                         sentences_first=SENTENCE_KEEP.get(method, "equations")
                         if method in SENTENCES_OF else None)
            out[enc.example.id] = {c.budget: c.text for c in kept}
            if ok:
                for c in kept:
                    pr[c.budget].append(precision_recall(c.kept, need))
                    eq_kept[c.budget][0] += int((c.kept & eq).sum())
                    eq_kept[c.budget][1] += int(eq.sum())
        compressed[method] = out
        kept_stats[method] = {str(g): {"precision": float(np.mean([p for p, _ in v])),
                                       "recall": float(np.mean([r for _, r in v])), "n": len(v),
                                       "equals": eq_kept[g][0] / max(1, eq_kept[g][1])}
                              for g, v in pr.items() if v}
        if method == "mist_alpha":
            kept_stats[method]["alpha"] = cache["alpha"]
    shares = [n.mean() for n, ok in zip(needed, labelled) if ok]
    kept_stats["_chains"] = {"n": len(chains), "labelled": int(sum(labelled)),
                             "needed_share": float(np.mean(shares)) if shares else None,
                             "tokens": float(np.mean([e.chain_len for e in encoded])),
                             "score_seconds": {m: round(t, 2) for m, t in timings.items()}}
    return compressed, kept_stats


def _scored(method: str, lm, encoded, labels: dict, seed: int, cache: dict) -> list:
    """One method's ScoredChains (or InvalidExample per chain it could not score); scorings
    that another method reuses are kept in `cache`. `labels`: the ground truth's token masks
    per chain ("needed", the `=` signs "equals", the step cues "cues"), for the oracles."""
    from mist_core.measures.evaluation import positional_scores
    from mist_core.scoring.registry import Scoring
    from mist_core.scoring.scorer import ScoredChain, combine, zscore

    if method in cache:
        return cache[method]
    if method in POSITIONAL:  # keep the chain's first (head) or last (tail) tokens
        scored = [ScoredChain.from_encoded(e, method, positional_scores(e.chain_len, method))
                  for e in encoded]
    elif method == "oracle":  # ground truth 2, `=` 1, the rest a random fill below both
        rng = np.random.default_rng(seed)
        scored = [ScoredChain.from_encoded(e, method, 2.0 * n + q + 0.5 * rng.random(e.chain_len))
                  for e, n, q in zip(encoded, labels["needed"], labels["equals"])]
    elif method == "oracle_near":  # ground truth 2, `=` 1, the rest by nearness to them
        rng = np.random.default_rng(seed)
        scored = [ScoredChain.from_encoded(e, method, 2.0 * n + q + 0.5 * _nearness(n | q)
                                           + 1e-3 * rng.random(e.chain_len))
                  for e, n, q in zip(encoded, labels["needed"], labels["equals"])]
    elif method == "oracle_cue":  # oracle_near with each step's cue verb as ground truth too
        rng = np.random.default_rng(seed)
        scored = [ScoredChain.from_encoded(e, method, 2.0 * (n | k) + q + 0.5 * _nearness(n | k | q)
                                           + 1e-3 * rng.random(e.chain_len))
                  for e, n, q, k in zip(encoded, labels["needed"], labels["equals"],
                                        labels["cues"])]
    elif method in FACTS_OF or method in EQUATIONS_OF or method in SENTENCES_OF:
        scored = _scored({**FACTS_OF, **EQUATIONS_OF, **SENTENCES_OF}[method], lm, encoded, labels,
                         seed, cache)
    elif method in HYBRIDS:
        a, b, w, log_b = HYBRIDS[method]
        scored = [x if not isinstance(x, ScoredChain) else y if not isinstance(y, ScoredChain)
                  else ScoredChain.from_encoded(e, method, w * zscore(x.scores) + (1 - w) * zscore(
                      np.log(np.maximum(y.scores, 1e-12)) if log_b else y.scores))
                  for e, x, y in zip(encoded, _scored(a, lm, encoded, labels, seed, cache),
                                     _scored(b, lm, encoded, labels, seed, cache))]
    elif method == "mist_alpha":
        base = _scored("mist_clipped", lm, encoded, labels, seed, cache)
        cache["alpha"] = alpha = choose_alpha(lm, encoded[:ALPHA_SLICE], base[:ALPHA_SLICE],
                                              unit=cache["unit"])
        scored = [x if not isinstance(x, ScoredChain) else
                  ScoredChain.from_encoded(e, method, combine(x.necessity, x.sufficiency, alpha))
                  for e, x in zip(encoded, base)]
    else:
        name, kwargs = VARIANTS.get(method, (method, {}))
        if method == "uniform":
            kwargs = {"seed": seed}
        scorer = Scoring(name, max_memory=None, **kwargs).scorer(lm)
        scored = scorer.score_encoded(encoded, errors="return")
    cache[method] = scored
    return scored


def _nearness(anchor: np.ndarray) -> np.ndarray:
    """1 / (1 + the distance in tokens to the nearest anchor token): in (0, 1], 1 on one."""
    pos = np.flatnonzero(anchor)
    if pos.size == 0:
        return np.zeros(anchor.shape)
    dist = np.abs(np.arange(anchor.size)[:, None] - pos[None, :]).min(axis=1)
    return 1.0 / (1.0 + dist)


def choose_alpha(lm, encoded, scored, budget: float = 0.5, unit: str = "token") -> float:
    """The α of ALPHAS whose pruned chains at `budget` keep the most of Eq. 1 (the mean
    log p(a | x, c') over the chains): chosen per model, on its own chains, no labels."""
    from mist_core.measures.evaluation import compressed_input, answer_passes
    from mist_core.scoring.prune import prune
    from mist_core.scoring.scorer import ScoredChain, combine, shared_prefix

    totals = dict.fromkeys(ALPHAS, 0.0)
    for enc, sc in zip(encoded, scored):
        if not isinstance(sc, ScoredChain):
            continue
        inputs = []
        for a in ALPHAS:
            s = ScoredChain.from_encoded(enc, "mist", combine(sc.necessity, sc.sufficiency, a))
            kept = prune(enc.example, s, budgets=[budget], unit=unit)[0].kept
            inputs.append(compressed_input(enc, kept))
        for a, ans in zip(ALPHAS, answer_passes(lm, inputs, prefix_len=shared_prefix(enc))):
            totals[a] += ans.log_likelihood
    return max(ALPHAS, key=lambda a: (totals[a], -abs(a - 0.6)))


def arm_records(arm: str, chains: list[dict], compressed: dict | None, seed: int,
                mix: str = "sample", samples: list[dict] | None = None) -> list[dict]:
    """The SFT records of one arm: a method's mixture, or a control. `samples`: every
    correct sample of k of each question (samples_of_k: the all_of_k control, and the
    shortest of each the shortest_of_k control)."""
    from mist_core.data.formats import sft_prompt_completion, sft_records
    from mist_core.data.templates import ANSWER_LEAD

    if arm == "all_of_k":
        return [sft_prompt_completion(id=s["id"], question=s["question"], cot=s["cot"],
                                      answer=s["answer"], budget=1.0) for s in samples]
    from mist_core.distill.generation import shortest_per_question

    shortest = shortest_per_question(samples) if arm == "shortest_of_k" else {}
    out = []
    for c in chains:
        common = dict(id=c["id"], question=c["question"], cot=c["cot"], answer=c["answer"])
        if arm == "full_chain":
            out += sft_records(**common, compressed={}, mix="sample", seed=seed)
        elif arm == "shortest_of_k":
            out.append(sft_prompt_completion(**{**common, "cot": shortest[c["source_id"]]["cot"]},
                                             budget=1.0))
        elif arm == "no_chain":  # the answer line alone: the chain's end of the range
            rec = sft_prompt_completion(**common, budget=1.0)
            rec["completion"][0]["content"] = f"{ANSWER_LEAD}{c['answer']}"
            out.append(rec)
        elif c["id"] in compressed:
            # One γ per chain, drawn by its id: every method trains on the same γ for the
            # same chain, so methods differ only in which tokens they keep.
            out += sft_records(**common, compressed=compressed[c["id"]], mix=mix, seed=seed)
    return out


def run_arm(arm: str, target: Path, records: list[dict], test_rows: list[dict], sizes: Sizes,
            seed: int, path: Path, budgets=None) -> dict:
    """Fine-tune a fresh copy of the target on the arm's records and answer the test set
    under each of `budgets` (default: EVAL_BUDGETS, a control 1.0 alone)."""
    from mist_core.distill.finetune import finetune
    from mist_core.distill.generation import solve
    from mist_core.models import load_model

    t0 = time.time()
    if not _trained(path):
        finetune(str(target), records, path, epochs=sizes.ft_epochs, learning_rate=sizes.ft_lr,
                 batch_size=sizes.batch_size, seed=seed, log_every=50,
                 gradient_checkpointing=False)
    t1 = time.time()
    lm = load_model(str(path))
    budgets = budgets or (EVAL_BUDGETS if not _whole(arm) else (1.0,))
    out = {"records": len(records), "train_seconds": round(t1 - t0, 1), "budgets": {}}
    for g in budgets:
        solved = solve(lm, test_rows, budget=g, style=STYLE, max_new_tokens=sizes.max_new_tokens,
                       batch_size=sizes.gen_batch)
        out["budgets"][str(g)] = {
            "accuracy": float(np.mean([r["correct"] for r in solved])),
            "chain_tokens": float(np.mean([r["chain_tokens"] for r in solved])),
            "finished": float(np.mean([r["finished"] for r in solved])),
            "correct": "".join("1" if r["correct"] else "0" for r in solved),
            "example": solved[0]["completion"]}
    out["solve_seconds"] = round(time.time() - t1, 1)
    return out


def run_per_budget(arm: str, target: Path, chains: list[dict], compressed: dict,
                   test_rows: list[dict], sizes: Sizes, seed: int, root: Path, full: dict) -> dict:
    """The per-budget recipe: one model per pruned γ, trained on that γ's chains alone
    (directive in the prompt) and answering under it; γ = 1.0 is the full-chain control."""
    from mist_core.data.formats import sft_prompt_completion

    out = {"records": 0, "train_seconds": 0.0, "solve_seconds": 0.0,
           "budgets": {"1.0": full["budgets"]["1.0"]}}
    for g in TRAIN_BUDGETS:
        records = [sft_prompt_completion(id=c["id"], question=c["question"], answer=c["answer"],
                                         cot=compressed[c["id"]][g], budget=g)
                   for c in chains if c["id"] in compressed]
        one = run_arm(arm, target, records, test_rows, sizes, seed, root / f"{arm}@{g:g}", (g,))
        out["budgets"][str(g)] = one["budgets"][str(g)]
        for key in ("records", "train_seconds", "solve_seconds"):
            out[key] += one[key]
    return out


def target_of(seed: int, sizes: Sizes, work: Path) -> tuple[int, Path]:
    """The seed and folder of the target that `seed` fine-tunes: one for all seeds, or its own."""
    if sizes.shared_target:
        return 0, work / "target"
    return seed, work / f"seed{seed}" / "target"


def target_problems(sizes: Sizes, target_seed: int):
    from mist_core.distill.synthetic import make_problems

    return make_problems(sizes.target_train, seed=10_000 * target_seed + 1, prefix="a",
                         n_steps=sizes.n_steps)


def run_seed(seed: int, sizes: Sizes, methods, work: Path, tok) -> dict:
    """Everything of one seed; what is stored under work/seed<N> is reused."""
    from mist_core.distill.generation import shortest_per_question, solve
    from mist_core.distill.synthetic import make_problems

    root = work / f"seed{seed}"
    root.mkdir(parents=True, exist_ok=True)
    state_path = root / "results.json"
    state = json.loads(state_path.read_text()) if state_path.is_file() else {}
    settings = json.loads(json.dumps(asdict(sizes)))
    stored = state.get("sizes")  # a field it lacks was added since, at its default
    if stored is not None and {**json.loads(json.dumps(asdict(Sizes()))), **stored} != settings:
        raise ConfigError(f"{root} holds a run with other sizes; use another --work")
    state["sizes"] = settings
    # Disjoint sets: the target never trained on a Phase 0 or test question.
    target_seed, target_dir = target_of(seed, sizes, work)
    train = target_problems(sizes, target_seed)
    pool = make_problems(sizes.phase0, seed=10_000 * seed + 2, prefix="b", n_steps=sizes.n_steps,
                         exclude=[p.question for p in train])
    test = make_problems(sizes.test, seed=10_000 * seed + 3, prefix="t", n_steps=sizes.n_steps,
                         exclude=[p.question for p in train + pool])
    test_rows = _rows(test)

    t0 = time.time()
    target = train_target(tok, train, sizes, target_seed, target_dir)
    if "target" not in state:
        solved = solve(target, test_rows, budget=1.0, style=STYLE,
                       max_new_tokens=sizes.max_new_tokens, batch_size=sizes.gen_batch)
        state["target"] = {"accuracy": float(np.mean([r["correct"] for r in solved])),
                           "chain_tokens": float(np.mean([r["chain_tokens"] for r in solved])),
                           "seconds": round(time.time() - t0, 1)}
        _save_json(state_path, state)
    log.info("seed %d: target accuracy %.3f", seed, state["target"]["accuracy"])

    samples = phase0(target, pool, sizes, seed, root / "phase0.json")
    chains = [s for s in samples if s["correct"] and s["finished"]]
    state["phase0"] = {"sampled": len(samples), "kept": len(chains)}
    if not chains:
        raise SystemExit(f"seed {seed}: the target got no Phase 0 question right")
    arms = state.setdefault("arms", {})
    # Only what is not stored is scored: a resumed or re-rendered seed costs no scoring.
    todo = [m for m in methods
            if m not in arms or (not _whole(m) and m not in state.get("kept", {}))]
    # A mixture arm trains on its base's chains, scored here whether or not the base is run.
    bases = {MIXTURES[m][0] for m in todo if m in MIXTURES}
    budgets = tuple(sorted({*TRAIN_BUDGETS, *(g for m in todo if m in MIXTURES
                                             for g in MIXTURES[m][2])}))
    on_phase0 = [m for m in todo
                 if m not in OF_SHORTEST and m not in WHOLE and m not in MIXTURES]
    on_phase0 += sorted(bases - set(on_phase0) - set(OF_SHORTEST))
    compressed, kept = (score_and_prune(target, chains, on_phase0, seed, sizes.unit, budgets)
                        if on_phase0 else ({}, {}))
    # The k samples of each question only where an arm still to run needs them (the
    # shortest-of-k arms, all_of_k): a resumed seed samples nothing it has no use for.
    needs_k = ({"shortest_of_k"} - set(arms)) | {m for m in todo
                                                  if m in WHOLE or _base(m) in OF_SHORTEST}
    samples = (samples_of_k(target, pool, chains, sizes, seed, root / "phase0_k.json")
               if needs_k else [])
    shortest = shortest_per_question(samples)
    for arm in sorted({_base(m) for m in todo} & set(OF_SHORTEST)):
        base = OF_SHORTEST[arm]
        done, stats = score_and_prune(target, list(shortest.values()), [base], seed, sizes.unit,
                                      budgets)
        compressed[arm], kept[arm] = done[base], stats[base]
    for arm in (m for m in todo if m in MIXTURES):
        compressed[arm], kept[arm] = compressed[MIXTURES[arm][0]], kept[MIXTURES[arm][0]]
    state["kept"] = {**state.get("kept", {}), **kept}
    _save_json(state_path, state)

    for arm in list(CONTROLS) + list(methods):
        if arm in arms:
            continue
        # a mixture: its base's chains at its own budgets
        base, mix, trained = MIXTURES.get(arm, (arm, sizes.mix, TRAIN_BUDGETS))
        corpus = list(shortest.values()) if base in OF_SHORTEST else chains
        mine = ({i: {g: t for g, t in by.items() if g in trained}
                 for i, by in compressed[arm].items()} if arm in compressed else None)
        if mix == "per_budget" and not _whole(arm):
            arms[arm] = run_per_budget(arm, target_dir, corpus, mine, test_rows, sizes,
                                       seed, root, arms["full_chain"])
        else:
            records = arm_records(arm, corpus, mine, seed, mix, samples)
            arms[arm] = run_arm(arm, target_dir, records, test_rows, sizes, seed, root / arm)
        _save_json(state_path, state)
        acc = {g: round(v["accuracy"], 3) for g, v in arms[arm]["budgets"].items()}
        log.info("seed %d %s: accuracy %s (train %.0fs)", seed, arm, acc,
                 arms[arm]["train_seconds"])
    return state


# ---------------------------------------------------------------- across seeds

# Two-sided 95% Student t quantiles by degrees of freedom: intervals over a handful of seeds.
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
         9: 2.262, 10: 2.228, 15: 2.131, 20: 2.086, 30: 2.042}


def t_interval(values) -> tuple[float, float]:
    """(mean, half-width of the 95% t interval); half-width nan with one value."""
    v = np.asarray([x for x in values if x is not None and not math.isnan(x)], float)
    if len(v) == 0:
        return float("nan"), float("nan")
    if len(v) == 1:
        return float(v[0]), float("nan")
    df = len(v) - 1
    t = _T975.get(df) or _T975[max(k for k in _T975 if k <= df)]
    return float(v.mean()), float(t * v.std(ddof=1) / math.sqrt(len(v)))


def aggregate(seeds: dict[int, dict], methods) -> list[dict]:
    """One row per (arm, γ): mean and 95% interval over seeds of accuracy, chain tokens
    and (for the pruned budgets) kept-token precision and recall."""
    rows = []
    for arm in list(methods) + list(CONTROLS):
        budgets = EVAL_BUDGETS if not _whole(arm) else (1.0,)
        for g in budgets:
            per = [s["arms"][arm]["budgets"][str(g)] for s in seeds.values()
                   if arm in s.get("arms", {})]
            if not per:
                continue
            row = {"arm": arm, "budget": g, "seeds": len(per),
                   "accuracy": t_interval([p["accuracy"] for p in per]),
                   "chain_tokens": t_interval([p["chain_tokens"] for p in per])}
            if arm in methods and g < 1.0:
                kept = [s["kept"][arm][str(g)] for s in seeds.values() if arm in s.get("kept", {})]
                row["precision"] = t_interval([k["precision"] for k in kept])
                row["recall"] = t_interval([k["recall"] for k in kept])
                row["equals"] = t_interval([k.get("equals", float("nan")) for k in kept])
            rows.append(row)
    return rows


def paired(seeds: dict[int, dict], a: str, b: str, g: float, key: str) -> tuple[float, float]:
    """Mean and 95% t interval over seeds of a − b (same target and test set per seed)."""
    diffs = [s["arms"][a]["budgets"][str(g)][key] - s["arms"][b]["budgets"][str(g)][key]
             for s in seeds.values() if a in s.get("arms", {}) and b in s.get("arms", {})]
    return t_interval(diffs)


def line_margin(seed: dict, arm: str, g: float) -> float | None:
    """Accuracy above the straight line from the no-chain control (0 tokens) to the
    full-chain control, at the chain tokens the arm's model writes under γ."""
    arms = seed.get("arms", {})
    if arm not in arms or not {"full_chain", "no_chain"} <= set(arms):
        return None
    full, none = arms["full_chain"]["budgets"]["1.0"], arms["no_chain"]["budgets"]["1.0"]
    got = arms[arm]["budgets"][str(g)]
    share = got["chain_tokens"] / full["chain_tokens"] if full["chain_tokens"] else 1.0
    return got["accuracy"] - (none["accuracy"] + (full["accuracy"] - none["accuracy"]) * share)


def oracle_shares(seeds: dict, arm: str) -> dict:
    """Per γ: the arm's accuracy share of the full-chain control, its chain-token share, and
    its accuracy minus the control's (the mixture's cost at 1.0), each (mean, half-width)
    over the seeds that ran the arm; keys "0.5", "0.7", "1.0", and "seeds"."""
    out = {}
    runs = [s for s in seeds.values() if arm in s.get("arms", {})]
    for g in ("0.5", "0.7", "1.0"):
        acc, tok, diff = [], [], []
        for s in runs:
            full = s["arms"]["full_chain"]["budgets"]["1.0"]
            got = s["arms"][arm]["budgets"].get(g)
            if got is None:
                continue
            acc.append(got["accuracy"] / full["accuracy"])
            tok.append(got["chain_tokens"] / full["chain_tokens"])
            diff.append(got["accuracy"] - full["accuracy"])
        out[g] = {"acc_share": t_interval(acc), "token_share": t_interval(tok),
                  "vs_full": t_interval(diff), "seeds": len(acc)}
    return out


def meets_bar(shares: dict) -> bool:
    """Issue 29's calibration bar: at γ = 0.5 the ceiling keeps ≥ 90% of the full-chain
    control's accuracy writing ≤ 60% of its chain tokens, and the mixture costs ≤ 3 points
    at 1.0 (0 by construction with one model per γ)."""
    half, full = shares["0.5"], shares["1.0"]
    return (half["acc_share"][0] >= 0.9 and half["token_share"][0] <= 0.6
            and (full["seeds"] == 0 or full["vs_full"][0] >= -0.03))


def ahead(mi) -> str:
    """'ahead' / 'behind' where the 95% interval excludes 0, else 'tie'."""
    m, h = mi
    if math.isnan(m) or math.isnan(h):
        return "—"
    return "ahead" if m - h > 0 else "behind" if m + h < 0 else "tie"


def plot(seeds: dict[int, dict], methods, path: Path) -> None:
    """Accuracy against the chain tokens the models write, every arm and γ (means over
    seeds), with the no-chain–full-chain line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = {(r["arm"], r["budget"]): r for r in aggregate(seeds, methods)}
    fig, ax = plt.subplots(figsize=(7.5, 5))
    ends = [rows.get(("no_chain", 1.0)), rows.get(("full_chain", 1.0))]
    if all(ends):
        ax.plot([e["chain_tokens"][0] for e in ends], [100 * e["accuracy"][0] for e in ends],
                "k--", lw=1, label="no chain – full chain")
    arms = list(methods) + [c for c in CONTROLS if c not in ("full_chain", "no_chain")]
    colours = plt.get_cmap("tab10" if len(arms) <= 10 else "tab20").colors  # one per arm
    for i, arm in enumerate(arms):
        pts = [(g, rows[(arm, g)]) for g in EVAL_BUDGETS if (arm, g) in rows]
        if not pts:
            continue
        x = [r["chain_tokens"][0] for _, r in pts]
        y = [100 * r["accuracy"][0] for _, r in pts]
        style = dict(lw=2.5, zorder=3) if arm == DEFAULT_ARM else dict(lw=1, alpha=0.8)
        style["color"] = colours[i % len(colours)]
        ax.plot(x, y, "o-", label=arm + (" (default)" if arm == DEFAULT_ARM else ""), **style)
        for (g, _), xi, yi in zip(pts, x, y):
            ax.annotate(f"{g:g}", (xi, yi), fontsize=7, xytext=(3, 3), textcoords="offset points")
    for e, name in zip(ends, ("no chain", "full chain")):
        if e:
            ax.plot(e["chain_tokens"][0], 100 * e["accuracy"][0], "ks")
            ax.annotate(name, (e["chain_tokens"][0], 100 * e["accuracy"][0]), fontsize=8,
                        xytext=(4, -10), textcoords="offset points")
    ax.set_xlabel("chain tokens the fine-tuned model writes (mean over seeds)")
    ax.set_ylabel("test accuracy %")
    ax.set_title(f"Downstream testbed, {len(seeds)} seed{'s' if len(seeds) != 1 else ''}; "
                 "labels: the γ asked for")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _fmt(mi, scale=1.0, digits=1) -> str:
    m, h = mi
    if math.isnan(m):
        return "—"
    return f"{m * scale:.{digits}f}" + ("" if math.isnan(h) else f" ± {h * scale:.{digits}f}")


READING = "## Reading"


def render(seeds: dict[int, dict], methods, sizes: Sizes, command: str, reading: str) -> str:
    rows = aggregate(seeds, methods)
    n = len(seeds)
    kept0 = [s["kept"]["_chains"] for s in seeds.values()]
    lines = [
        "# Downstream testbed: which compression trains the better model",
        "",
        "*Generated by `pipelines/loop/testbed.py` from `testbed.json` (beside this file); the "
        f"reading at the end is written by hand.* {n} seed{'s' if n != 1 else ''}; each number "
        "is the mean over seeds ± the half-width of its 95% t interval (nothing after ± with "
        "one seed).",
        "",
        "Regenerate (resumes what `--work` holds):",
        "",
        "```",
        command,
        "```",
        "",
        "## Setup",
        "",
        f"- Task (`mist_core/distill/synthetic.py`): word problems with "
        f"{'–'.join(map(str, sorted(set(sizes.n_steps))))} chained +, −, × steps on "
        f"small integers, filler sentences and distractor facts with numbers of their own. "
        f"Ground truth: the operands, operator and result of each step's equation in the "
        f"chain ({_fmt(t_interval([k['needed_share'] for k in kept0]), 100)}% of the Phase 0 "
        f"chains' tokens; chains of {_fmt(t_interval([k['tokens'] for k in kept0]))} tokens).",
        f"- Target: a Llama of {sizes.layers} blocks, width {sizes.hidden}, word-level "
        f"tokenizer, trained from scratch on {sizes.target_train} generator chains "
        f"({sizes.target_epochs:g} epochs, lr {sizes.target_lr:g}, batch {sizes.batch_size}"
        f"{'; one target for all seeds' if sizes.shared_target else '; one per seed'}). "
        "Its test accuracy: "
        f"{_fmt(t_interval([s['target']['accuracy'] for s in seeds.values()]), 100)}%.",
        f"- Phase 0: the target samples one chain (T = {sizes.temperature:g}) per question "
        f"for {sizes.phase0} new questions; the correct ones "
        f"({_fmt(t_interval([s['phase0']['kept'] for s in seeds.values()]), 1, 0)}) are the "
        "corpus every method compresses.",
        f"- Phase 2: a copy of the target fine-tuned ({sizes.ft_epochs:g} epochs, lr "
        f"{sizes.ft_lr:g}, batch {sizes.batch_size}) on each method's mixture: "
        + {"sample": "one γ per chain from {0.5, 0.7, 1.0}, drawn by the chain's id (the same "
                     "for every method)",
           "all": "every chain at each γ of {0.5, 0.7, 1.0}",
           "per_budget": "one model per γ of {0.5, 0.7}, on that γ's chains alone (γ = 1.0 is "
                         "the full-chain control)"}[sizes.mix]
        + f", pruned by {sizes.unit}, the directive in the prompt below 1.0. Controls: "
        "`full_chain` (every chain whole, no directive), `no_chain` (the answer line alone) "
        f"and `shortest_of_k` (each question's shortest correct chain of {sizes.shortest_k} "
        "samples by the target). `head` keeps the first ⌈γT⌉ tokens (truncation), `tail` the "
        "last; `uniform` a random ⌈γT⌉; `oracle` the ground truth and the `=` signs, filled "
        "to ⌈γT⌉ with random tokens, `oracle_near` filled with the tokens nearest them, "
        "`oracle_cue` oracle_near with the chain's start and each step's cue verb in the "
        "ground truth too (a writer's ceiling). `mist_facts` and `h2o_facts`: mist_clipped's "
        "and h2o's scores, pruned with the numbers and operators first (`facts_first`). "
        "`mist_writer` and `necessity_writer`: MIST and its necessity axis with the writer's "
        "target (necessity of log p(answer) plus the log p of the chain's own numbers and "
        "operators, `target=\"facts\"`); `writer_hybrid` 0.5·z(mist_clipped) + "
        "0.5·z(necessity_writer), one scorer (`target=\"both\"`). A `_facts` suffix prunes "
        "with the numbers and operators first, `_eq` with the equations first "
        "(`equations_first`): the chain's computations, not the numbers it restates; `_sent` "
        "drops whole sentences first (`sentences_first`: those without an equation, lowest "
        "mean score first, while ⌈γT⌉ tokens are left), then the numbers and operators "
        "first in what is left; `_sentf` drops those without a number or an operator instead; "
        "`uniform_sent` is `_sent` on random scores, `oracle_sent` on oracle_cue's (the "
        "ceiling under the sentence rule; `writer_hybrid_sent` is the default method's). "
        "`shortest_sent`: `writer_hybrid_sent` on shortest_of_k's corpus, each question's "
        "shortest correct chain, instead of its Phase 0 chain. `sent_mix_all` and "
        "`sent_mix_sample`: `writer_hybrid_sent`'s chains under a mixture, one model for every "
        "γ trained on each chain at every γ of {0.5, 0.7, 1.0} (`all`, `mist compress`'s "
        "default `sft_mix`) or at one γ drawn by its id (`sample`), answering under each γ; "
        "`sent_mix_five`: `all` at `mist compress`'s default budgets, "
        f"{{{', '.join(f'{g:g}' for g in DEFAULT_BUDGETS)}, 1.0}} ({len(DEFAULT_BUDGETS) + 1} "
        "records a chain: the job's output as it ships); `shortest_mix_all`: `shortest_sent`'s "
        "chains under `all`. `all_of_k`, "
        "a control like the three: every correct sample of the "
        f"{sizes.shortest_k} (each chain once per question), whole.",
        f"- Phase 3: greedy answers on {sizes.test} new test questions under each γ (the "
        "controls under 1.0). *Chain tokens*: tokens the model writes before `The answer is`.",
        "- *Precision / recall*: of the chain tokens a method keeps at γ in the Phase 0 corpus "
        "(its training data), against the ground truth; over the chains the labeller "
        "matched every step of. *`=` kept*: the share of the equations' `=` signs kept "
        "(not ground truth: they carry no quantity, but they are the equations' structure).",
        "",
        "## Results",
        "",
        "| arm | γ | accuracy % | chain tokens | kept precision % | kept recall % | `=` kept % |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        prec = _fmt(r["precision"], 100) if "precision" in r else "—"
        rec = _fmt(r["recall"], 100) if "recall" in r else "—"
        eq = _fmt(r["equals"], 100) if "equals" in r else "—"
        lines.append(f"| {r['arm']} | {r['budget']:g} | {_fmt(r['accuracy'], 100)} | "
                     f"{_fmt(r['chain_tokens'])} | {prec} | {rec} | {eq} |")
    if "mist" in methods and "h2o" in methods:
        lines += ["", "### MIST − H2O, paired by seed", "",
                  "| γ | accuracy, points | chain tokens |", "|---|---|---|"]
        for g in EVAL_BUDGETS:
            lines.append(f"| {g:g} | {_fmt(paired(seeds, 'mist', 'h2o', g, 'accuracy'), 100)} | "
                         f"{_fmt(paired(seeds, 'mist', 'h2o', g, 'chain_tokens'))} |")
    if DEFAULT_ARM in methods:
        others = [a for a in list(methods) + list(CONTROLS) if a not in (DEFAULT_ARM, "no_chain")]
        lines += ["", f"### The default ({DEFAULT_ARM}) against every other arm, paired by seed",
                  "", "Accuracy points of the default arm under γ minus the other arm's under the "
                  "same γ (a control under 1.0); *ahead* where the 95% interval lies above 0.", "",
                  "| other arm | γ = 0.5 | | γ = 0.7 | |", "|---|---|---|---|---|"]
        for other in others:
            cells = []
            for g in TRAIN_BUDGETS:
                diffs = [s["arms"][DEFAULT_ARM]["budgets"][str(g)]["accuracy"]
                         - s["arms"][other]["budgets"][str(g if not _whole(other) else 1.0)]["accuracy"]
                         for s in seeds.values() if {DEFAULT_ARM, other} <= set(s.get("arms", {}))]
                mi = t_interval(diffs)
                cells += [_fmt(mi, 100), ahead(mi)]
            lines.append(f"| {other} | " + " | ".join(cells) + " |")
    lines += ["", "### Above the no-chain–full-chain line?", "",
              "Accuracy points above the straight line from the no-chain control to the "
              "full-chain control, at the chain tokens the arm's model writes (per seed, then "
              "mean ± 95% interval).", "", "| arm | γ | points above the line | |", "|---|---|---|---|"]
    for arm in list(methods) + [c for c in CONTROLS if c not in ("full_chain", "no_chain")]:
        for g in (EVAL_BUDGETS if not _whole(arm) else (1.0,)):
            margins = [m for m in (line_margin(sd, arm, g) for sd in seeds.values()) if m is not None]
            if margins:
                mi = t_interval(margins)
                lines.append(f"| {arm} | {g:g} | {_fmt(mi, 100)} | {ahead(mi)} |")
    calibrated = [a for a in ORACLES if a in methods]
    if calibrated:
        lines += ["", "### Calibration: does the ceiling clear the bar?", "",
                  "The oracle's accuracy and chain tokens as shares of the full-chain control's "
                  "(per seed, then mean ± 95% interval). The bar: ≥ 90% of the accuracy at "
                  "γ = 0.5 with ≤ 60% of the chain tokens, and ≤ 3 points lost at γ = 1.0 (0 by "
                  "construction with one model per γ). Earlier recipes: "
                  "`docs/results/calibration.md`.", "",
                  "| arm | accuracy / full-chain, γ = 0.5 | chain tokens / full-chain, 0.5 | "
                  "accuracy / full, 0.7 | tokens / full, 0.7 | bar met |",
                  "|---|---|---|---|---|---|"]
        for arm in calibrated:
            r = oracle_shares(seeds, arm)
            lines.append(f"| {arm} | {_fmt(r['0.5']['acc_share'], 100)}% | "
                         f"{_fmt(r['0.5']['token_share'], 100)}% | {_fmt(r['0.7']['acc_share'], 100)}% | "
                         f"{_fmt(r['0.7']['token_share'], 100)}% | {'yes' if meets_bar(r) else 'no'} |")
    lines += ["", "![accuracy against chain tokens](downstream.png)"]
    pairs = ([(v, base) for v, (base, _) in VARIANTS.items()] + list(FACTS_OF.items())
             + [(v, b + "_facts") for v, b in SENTENCES_OF.items()] + list(OF_SHORTEST.items())
             + [(m, base) for m, (base, *_) in MIXTURES.items()])
    for variant, base in pairs:
        if variant != base and variant in methods and base in methods:
            lines += ["", f"### {variant} − {base}, paired by seed", "",
                      "| γ | accuracy, points | chain tokens |", "|---|---|---|"]
            for g in EVAL_BUDGETS:
                lines.append(f"| {g:g} | {_fmt(paired(seeds, variant, base, g, 'accuracy'), 100)}"
                             f" | {_fmt(paired(seeds, variant, base, g, 'chain_tokens'))} |")
    lines += ["", READING, "", reading.strip() or "*Not written yet.*", ""]
    return "\n".join(lines)


def existing_reading(path: Path) -> str:
    if not path.is_file():
        return ""
    text = path.read_text()
    return text.split(READING, 1)[1] if READING in text else ""


# ---------------------------------------------------------------- entry point

class TestbedConfig(Kit):
    """`mist testbed`'s settings. The recipe settings (mix, ft_epochs, unit) left unset
    keep the sizes' own (FULL, or SMOKE with --smoke)."""

    seeds: int = setting(3, "seeds 0..N-1", group="run", metavar="N")
    methods: list[str] | None = setting(
        None, f"comma-separated (default: all of {','.join(METHODS)})", group="run",
        metavar="LIST", shown="")
    smoke: bool = setting(False, "small sizes, one seed, MIST, H2O and the controls: a few "
                          "minutes", group="run")
    target_per_seed: bool = setting(False, "train a target per seed instead of one for all "
                                    "seeds (+12 min a seed)", group="recipe")
    mix: str | None = setting(None, "the fine-tuning recipe: one γ per chain (sample), every "
                              "chain at every γ (all), or one model per pruned γ "
                              f"(per_budget); default {FULL.mix}", group="recipe",
                              choices=(None, "sample", "all", "per_budget"), shown="")
    ft_epochs: float | None = setting(None, f"fine-tuning epochs (default {FULL.ft_epochs:g})",
                                      group="recipe", metavar="N", shown="")
    corpus: int | None = setting(None, f"Phase 0 questions, whose correct chains are the corpus "
                                 f"every method compresses (default {FULL.phase0})",
                                 group="recipe", metavar="N", shown="")
    unit: str | None = setting(None, "the pruning unit (default token; numbers are one token "
                               "here)", group="recipe", choices=(None, "token", "word",
                                                                 "equation"), shown="")
    out: str = setting("docs/results", "where testbed.json and downstream.md go",
                       group="output", metavar="DIR")
    work: str | None = setting(None, "models and per-seed state, reused by a rerun (default: "
                               "$MIST_CACHE/testbed, ~/.cache/mist/testbed without it)",
                               group="output", metavar="DIR", shown="")
    threads: int = setting(1, "torch threads (of each process)", group="resources",
                           metavar="N")
    jobs: int = setting(1, "seeds run at once, each in its own process (one per core)",
                        group="resources", metavar="N")

    _positive = positive("seeds", "threads", "corpus", "jobs")
    _methods = field_validator("methods", mode="before")(
        classmethod(lambda cls, v: v if v is None else [str(m) for m in listed(v) if str(m)]))

    def _check_more(self) -> None:
        unknown = sorted(set(self.methods or ()) - set(METHODS))
        if unknown:
            raise ConfigError(f"unknown methods {unknown}; choose from {', '.join(METHODS)}")
        if self.ft_epochs is not None and not self.ft_epochs > 0:
            raise ConfigError("ft_epochs must be > 0")


def each_seed(seeds, sizes: Sizes, methods, work: Path, tok, jobs: int = 1, threads: int = 1):
    """Yield (seed, its state) as each seed finishes: in this process, or with `jobs` > 1
    in that many processes at once, `threads` torch threads each. A shared target is
    trained here first, so that no two seeds train it at once."""
    seeds = list(seeds)
    if jobs <= 1 or len(seeds) <= 1:
        for seed in seeds:
            yield seed, run_seed(seed, sizes, methods, work, tok)
        return
    if sizes.shared_target:
        target_seed, target_dir = target_of(seeds[0], sizes, work)
        train_target(tok, target_problems(sizes, target_seed), sizes, target_seed, target_dir)
    import multiprocessing
    from concurrent.futures import as_completed

    # spawn: a forked torch (its thread pools, locks) is not safe to use in the child
    with _pool(min(jobs, len(seeds)), multiprocessing.get_context("spawn")) as pool:
        running = [pool.submit(_seed_in_worker, seed, sizes, methods, work, threads)
                   for seed in seeds]
        for done in as_completed(running):
            yield done.result()


def _pool(workers: int, context):
    from concurrent.futures import ProcessPoolExecutor

    return ProcessPoolExecutor(workers, mp_context=context, initializer=_die_with_parent,
                               initargs=(os.getpid(),))


def _die_with_parent(parent: int) -> None:
    """A seed worker's first step: on Linux, ask for SIGTERM when the testbed's process
    dies, however it dies (a kill, a crash), so that no seed trains on unwatched for an hour;
    a parent already gone by now ends the worker at once."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    pr_set_pdeathsig = 1  # <linux/prctl.h>
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    if os.getppid() != parent:
        os._exit(1)


def _seed_in_worker(seed: int, sizes: Sizes, methods, work: Path, threads: int):
    """One seed in a worker process of each_seed."""
    import torch

    from mist_core.distill.synthetic import build_tokenizer, vocabulary_texts

    _quiet_logging()
    torch.set_num_threads(threads)
    return seed, run_seed(seed, sizes, methods, work, build_tokenizer(vocabulary_texts()))


def _quiet_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    for noisy in ("transformers", "datasets", "trl", "accelerate"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    import datasets

    datasets.disable_progress_bars()  # TRL maps each arm's records: one bar per map


def main(argv: list[str] | None = None, prog: str = "mist testbed") -> int:
    """`mist testbed`: train and compare models on each method's compressed chains.

    Args:
        argv: the command line after the program's name (default: sys.argv[1:]).
        prog: the program's name in --help and in the page's command.

    Returns:
        The exit status: 0, or 2 for bad settings."""
    return run_main(lambda: run(parse(TestbedConfig, argv, prog, __doc__.split("\n\n")[0]),
                                argv))


def run(args: TestbedConfig, argv: list[str] | None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _quiet_logging()
    import torch

    torch.set_num_threads(args.threads)
    from mist_core.distill.synthetic import build_tokenizer, vocabulary_texts
    from mist_core.models import cache_root

    sizes = SMOKE if args.smoke else FULL
    if args.target_per_seed:
        sizes = replace(sizes, shared_target=False)
    recipe = {k: v for k, v in (("mix", args.mix), ("ft_epochs", args.ft_epochs),
                                ("unit", args.unit), ("phase0", args.corpus)) if v is not None}
    sizes = replace(sizes, **recipe)
    methods = (list(args.methods) if args.methods else
               ["mist", "h2o"] if args.smoke else list(METHODS))
    seeds = 1 if args.smoke and args.seeds == 3 else args.seeds
    out = Path(args.out)
    work = Path(args.work) if args.work else cache_root() / ("testbed-smoke" if args.smoke
                                                             else "testbed")
    out.mkdir(parents=True, exist_ok=True)
    command = shlex.join(["mist", "testbed"] + (sys.argv[1:] if argv is None
                                                                   else list(argv)))
    tok = build_tokenizer(vocabulary_texts())
    results, t0 = {}, time.time()
    for seed, state in each_seed(range(seeds), sizes, methods, work, tok, args.jobs,
                                 args.threads):
        results = dict(sorted({**results, seed: state}.items()))
        # run_seconds: this invocation's wall time (a resumed run skips what is stored)
        _save_json(out / "testbed.json", {"command": command, "sizes": asdict(sizes),
                                          "default_arm": DEFAULT_ARM,
                                          "methods": methods, "seeds": results,
                                          "run_seconds": round(time.time() - t0, 1)})
    md = out / "downstream.md"
    md.write_text(render(results, methods, sizes, command, existing_reading(md)))
    plot(results, methods, out / "downstream.png")
    log.info("done in %.0f s: %s, %s", time.time() - t0, out / "testbed.json", md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
