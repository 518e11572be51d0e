import numpy as np
import pytest

from mist_core import MistScorer, get_scorer
from reference import first_order

FIELDS = ["necessity_per_layer", "sufficiency_per_layer", "layer_weights", "necessity",
          "sufficiency", "scores", "log_likelihood", "nochain_log_likelihood"]


def test_first_order_equals_plain_autograd_fp64(tiny_lm64, examples):
    # the paper's
    scorer = MistScorer(tiny_lm64, alpha=0.6, layer_weights="signed", target="answer")
    results = scorer.score(examples)
    for ex, got in zip(examples, results):
        ref = first_order(tiny_lm64, scorer.encode(ex))
        for name in FIELDS:
            np.testing.assert_allclose(getattr(got, name), ref[name], rtol=1e-5, atol=1e-9,
                                       err_msg=name)
        assert np.abs(got.necessity_per_layer).max() > 1e-4  # the test compares real signal


def test_first_order_equals_plain_autograd_fp32(tiny_lm, examples):
    scorer = MistScorer(tiny_lm, layer_weights="signed", target="answer")
    for ex, got in zip(examples, scorer.score(examples)):
        ref = first_order(tiny_lm, scorer.encode(ex))
        for name in ["necessity_per_layer", "sufficiency_per_layer", "layer_weights"]:
            scale = np.abs(ref[name]).max()
            np.testing.assert_allclose(getattr(got, name), ref[name], rtol=1e-4,
                                       atol=1e-5 * scale, err_msg=name)


def test_alpha_weights_the_axes(tiny_lm64, examples):
    both = MistScorer(tiny_lm64, alpha=0.25, target="answer").score(examples[:1])[0]
    nec = MistScorer(tiny_lm64, axes=["necessity"], target="answer").score(examples[:1])[0]
    suf = MistScorer(tiny_lm64, axes=["sufficiency"]).score(examples[:1])[0]
    np.testing.assert_allclose(both.scores, 0.25 * nec.scores + 0.75 * suf.scores, atol=1e-10)
    np.testing.assert_allclose(nec.necessity, both.necessity, rtol=1e-10)
    assert nec.sufficiency is None and suf.necessity is None
    assert nec.method == "necessity" and suf.method == "sufficiency" and both.method == "mist"
    np.testing.assert_allclose(nec.scores.mean(), 0, atol=1e-9)
    np.testing.assert_allclose(nec.scores.std(), 1, atol=1e-9)


@pytest.mark.parametrize("share_prefix", [True, False])
def test_mean_ablation_equals_plain_autograd_fp64(tiny_lm64, examples, share_prefix):
    """ablation="mean" (a variant): necessity's baseline is the chain's mean state at each
    layer, ⟨∇h_i, h_i − h̄⟩; one batch of chains of different lengths, with and without the
    prefix cache."""
    scorer = MistScorer(tiny_lm64, ablation="mean", share_prefix=share_prefix, target="answer")
    zero = MistScorer(tiny_lm64, share_prefix=share_prefix, target="answer").score(examples)
    for ex, got, paper in zip(examples, scorer.score(examples), zero):
        ref = first_order(tiny_lm64, scorer.encode(ex), ablation="mean",
                          layer_weights=scorer.layer_weights)
        for name in ["necessity_per_layer", "necessity", "sufficiency"]:
            np.testing.assert_allclose(getattr(got, name), ref[name], rtol=1e-5, atol=1e-9,
                                       err_msg=name)
        # the scores are z-scores of those two axes (necessity's in log space), so they
        # agree to what the axes do: 1e-5 relative, absolute near a score of 0
        np.testing.assert_allclose(got.scores, ref["scores"], rtol=1e-5, atol=1e-6)
        assert np.abs(got.necessity_per_layer - paper.necessity_per_layer).max() > 1e-4
    with pytest.raises(ValueError, match="ablation"):
        MistScorer(tiny_lm64, ablation="median")


@pytest.mark.parametrize("share_prefix,recompute", [(True, False), (False, False), (False, True)])
def test_facts_target_equals_plain_autograd_fp64(tiny_lm64, examples, share_prefix, recompute):
    """target="facts" (a variant): necessity's gradient is of log p(answer) plus the log p of
    each of the chain's numbers and operators; the reported log-likelihoods stay Eq. 1's,
    and the sufficiency axis is the answer's as before."""
    scorer = MistScorer(tiny_lm64, target="facts", share_prefix=share_prefix, recompute=recompute,
                        max_batch=8)
    answer = MistScorer(tiny_lm64, share_prefix=share_prefix, max_batch=8,
                        target="answer").score(examples)
    for ex, got, paper in zip(examples, scorer.score(examples), answer):
        ref = first_order(tiny_lm64, scorer.encode(ex), layer_weights="clipped", target="facts")
        for name in FIELDS:
            np.testing.assert_allclose(getattr(got, name), ref[name], rtol=1e-5, atol=1e-9,
                                       err_msg=name)
        assert got.log_likelihood == pytest.approx(paper.log_likelihood, rel=1e-9)
        np.testing.assert_allclose(got.sufficiency, paper.sufficiency, rtol=1e-9)
        assert np.abs(got.necessity_per_layer - paper.necessity_per_layer).max() > 1e-4
    with pytest.raises(ValueError, match="target"):
        MistScorer(tiny_lm64, target="question")


@pytest.mark.parametrize("share_prefix,recompute", [(True, False), (False, False), (False, True)])
def test_both_targets_from_one_source_pass_fp64(tiny_lm64, examples, share_prefix, recompute):
    """target="both": one source forward, two backwards. The answer's axes are target
    "answer"'s, `facts_necessity` is target "facts"'s necessity (both against the
    plain-autograd reference), and the scores are the mean of the two rankings z-scored:
    MIST's and the writer's necessity (0.5·z(mist) + 0.5·z(necessity with target facts))."""
    kw = dict(share_prefix=share_prefix, recompute=recompute, max_batch=8)
    scorer = MistScorer(tiny_lm64, target="both", **kw)
    mist = MistScorer(tiny_lm64, **kw, target="answer").score(examples)
    writer = MistScorer(tiny_lm64, axes=["necessity"], target="facts", **kw).score(examples)
    for ex, got, paper, w in zip(examples, scorer.score(examples), mist, writer):
        enc = scorer.encode(ex)
        ref = first_order(tiny_lm64, enc, layer_weights="clipped")
        ref_facts = first_order(tiny_lm64, enc, layer_weights="clipped", target="facts")
        for name in ["necessity_per_layer", "sufficiency_per_layer", "necessity", "sufficiency",
                     "log_likelihood", "nochain_log_likelihood"]:
            np.testing.assert_allclose(getattr(got, name), ref[name], rtol=1e-5, atol=1e-9,
                                       err_msg=name)
        np.testing.assert_allclose(got.facts_necessity, ref_facts["necessity"], rtol=1e-5,
                                   atol=1e-9)
        assert np.abs(got.facts_necessity - got.necessity).max() > 1e-4  # two signals
        z = lambda v: (v - v.mean()) / v.std()
        np.testing.assert_allclose(got.scores, 0.5 * z(paper.scores) + 0.5 * z(w.scores),
                                   rtol=1e-6, atol=1e-6)
        assert paper.facts_necessity is None and got.method == "mist"


def test_clipped_layer_weights_drop_the_layers_that_count_against(tiny_lm64, examples):
    """layer_weights="clipped" (the default): Eq. 7 with max(c̄_l, 0), from the plain-autograd
    reference's per-layer terms; the reported c̄ and per-layer terms are the paper's."""
    clipped = MistScorer(tiny_lm64)
    assert clipped.layer_weights == "clipped"
    signed = MistScorer(tiny_lm64, layer_weights="signed")
    negative = 0
    for ex, got, paper in zip(examples, clipped.score(examples), signed.score(examples)):
        ref = first_order(tiny_lm64, clipped.encode(ex))
        c = ref["layer_weights"]
        for axis in ("necessity", "sufficiency"):
            want = (np.maximum(c, 0)[:, None] * np.abs(ref[f"{axis}_per_layer"])).sum(0)
            if not want.any():  # clipping left no signal: the layers weigh by |c̄|
                want = (np.abs(c)[:, None] * np.abs(ref[f"{axis}_per_layer"])).sum(0)
            np.testing.assert_allclose(getattr(got, axis), want, rtol=1e-5, atol=1e-9, err_msg=axis)
        np.testing.assert_allclose(got.layer_weights, paper.layer_weights, rtol=1e-10)
        negative += (ref["layer_weights"] < 0).any()
    assert negative  # some chain has a layer that counts against: the variants differ there
    with pytest.raises(ValueError, match="layer_weights"):
        MistScorer(tiny_lm64, layer_weights="absolute")


def test_clipping_every_layer_away_weighs_the_layers_by_magnitude():
    """Where clipped weights would score every token 0 (no positive c̄, or only the last
    block's, whose chain states never reach the answer), a flat axis would be pruned by
    position; the signed weights, all ≤ 0 there, would rank the biggest effects last: the
    layers weigh by |c̄| instead."""
    import torch

    from mist_core.scoring.scorer import eq7

    terms = np.array([[1.0, -2.0, 3.0], [0.5, 0.0, -1.0], [0.0, 0.0, 0.0]])
    for cbar, clipped in (([-1.0, -0.5, 3.0], [1.25, 2.0, 3.5]),  # |c̄|: nothing left
                          ([-1.0, 2.0, 3.0], [1.0, 0.0, 2.0])):
        cbar = np.array(cbar)
        np.testing.assert_allclose(eq7(terms, cbar, "clipped"), clipped)
        np.testing.assert_allclose(eq7(torch.tensor(terms), torch.tensor(cbar), "clipped").numpy(), clipped)
    np.testing.assert_allclose(eq7(terms, np.array([-1.0, 2.0, 3.0]), "signed"), [0.0, -2.0, -1.0])


def test_layer_restriction_keeps_the_selected_rows(tiny_lm64, examples):
    full = MistScorer(tiny_lm64, layer_weights="signed").score(examples[:1])[0]
    part = MistScorer(tiny_lm64, layers=[2, 4], layer_weights="signed").score(examples[:1])[0]
    assert list(part.layers) == [2, 4]
    np.testing.assert_allclose(part.necessity_per_layer, full.necessity_per_layer[[1, 3]], rtol=1e-10)
    np.testing.assert_allclose(part.sufficiency_per_layer, full.sufficiency_per_layer[[1, 3]], rtol=1e-10)
    np.testing.assert_allclose(part.layer_weights, full.layer_weights[[1, 3]], rtol=1e-10)
    w = full.layer_weights[[1, 3]]
    np.testing.assert_allclose(part.necessity, (w[:, None] * np.abs(full.necessity_per_layer[[1, 3]])).sum(0),
                               rtol=1e-10)
    with pytest.raises(ValueError):
        MistScorer(tiny_lm64, layers=[0])


def assert_batch_free(lm, examples, wide: bool) -> None:
    """Padding and masks are exact: in fp64 alone and batched agree to rounding; in fp32
    what differs is only the GEMM summation order of another batch shape. (The paper's
    signed weights: clipped ones leave these tiny random models' necessity at 1e-7 nats,
    where log|necessity|'s z-scores amplify rounding to 1e-9.)"""
    lengths = {len(MistScorer(lm).encode(e).source_ids) for e in examples}
    assert len(lengths) > 1  # the batch is really padded
    alone = [MistScorer(lm, layer_weights="signed").score([ex])[0] for ex in examples]
    together = MistScorer(lm, max_batch=8, layer_weights="signed").score(examples)
    for a, b in zip(alone, together):
        assert a.id == b.id
        for name in FIELDS:
            want = getattr(a, name)
            if wide:
                np.testing.assert_allclose(getattr(b, name), want, rtol=1e-10, atol=1e-12, err_msg=name)
            elif name == "scores":  # z-scores of log|necessity|: O(1) values
                np.testing.assert_allclose(getattr(b, name), want, atol=1e-4, err_msg=name)
            else:
                np.testing.assert_allclose(getattr(b, name), want, rtol=1e-5,
                                           atol=1e-5 * np.abs(want).max(), err_msg=name)


# One test a width: a test asking for both models would run each model once for every
# architecture of the other (8 runs for 4 cases).
def test_scores_do_not_depend_on_the_batch_fp64(tiny_lm64, examples):
    assert_batch_free(tiny_lm64, examples, wide=True)


def test_scores_do_not_depend_on_the_batch_fp32(tiny_lm, examples):
    assert_batch_free(tiny_lm, examples, wide=False)


def test_results_come_back_in_input_order(tiny_lm, examples):
    order = [examples[2], examples[0], examples[1]]
    got = MistScorer(tiny_lm, max_batch=2).score(order)
    assert [g.id for g in got] == ["c", "a", "b"]


def test_no_parameter_gradients_and_logits_only_at_answer(tiny_lm, examples):
    rows_seen = []
    scorer = MistScorer(tiny_lm, max_batch=8, target="answer")
    scorer.footprint  # the memory probe, once per scorer, before the count
    handle = tiny_lm.lm_head.register_forward_hook(lambda m, a, o: rows_seen.append(a[0].shape))
    try:
        results = scorer.score(examples)
    finally:
        handle.remove()
    assert all(p.grad is None and not p.requires_grad for p in tiny_lm.model.parameters())
    answer_tokens = sum(r.answer_stop - r.answer_start for r in results)
    # one source and one no-chain pass, each computing logits for the answer tokens only
    assert [s[0] for s in rows_seen] == [answer_tokens, answer_tokens]


def test_scored_chain_spans(tiny_lm, examples):
    [s] = MistScorer(tiny_lm, target="answer").score(examples[:1])
    tok = tiny_lm.tokenizer
    T = len(s.scores)
    assert s.necessity_per_layer.shape == s.sufficiency_per_layer.shape == (tiny_lm.n_layers, T)
    assert tok.decode(s.chain_ids) == examples[0].cot
    assert tok.decode(s.source_ids[s.answer_start:s.answer_stop]).strip() == "13"
    assert tok.decode(s.target_ids[s.target_final + 1:]).strip() == "13"
    np.testing.assert_array_equal(s.source_ids[s.answer_start:s.answer_stop], s.target_ids[s.target_final + 1:])
    assert np.isfinite(s.scores).all()


def test_get_scorer_rejects_unknown_names(tiny_lm):
    with pytest.raises(ValueError, match="unknown method"):
        get_scorer("nope", tiny_lm)
    assert isinstance(get_scorer("mist", tiny_lm, alpha=0.3), MistScorer)


def test_batches_mixing_shared_prefixes_with_none(tiny_lm64):
    """A row whose inputs share no prefix (shared length 0) batched with rows that do."""
    from dataclasses import replace

    from pipelines.bench.scorer import synthetic_encoded

    encs = synthetic_encoded(3, 12, vocab=tiny_lm64.model.config.vocab_size, seed=3)
    e = encs[0]
    q = e.chain_start
    encs[0] = replace(e, source_ids=e.source_ids[q:], chain_start=0, answer_start=e.answer_start - q,
                      target_ids=e.target_ids[q:], target_final=e.target_final - q)
    scorer = MistScorer(tiny_lm64, max_batch=8)
    together = scorer.score_encoded(encs)
    for enc, b in zip(encs, together):
        [a] = scorer.score_encoded([enc])
        for name in FIELDS:
            np.testing.assert_allclose(getattr(b, name), getattr(a, name), rtol=1e-9, atol=1e-12, err_msg=name)
