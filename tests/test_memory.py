"""The scorer's memory regimes: stored activations or per-block recomputation, a prefix cache
or a from-scratch source pass, all with the same numbers; batches that run out of memory are
split, and only a chain that cannot fit alone is given up, with its reason."""
import os
from dataclasses import replace

import numpy as np
import pytest
import torch

from mist_core import InvalidExample, MistScorer
from mist_core.scoring import allocator
from mist_core.scoring.allocator import CPU_SCORING_ENV, cpu_scoring_env
from mist_core.scoring.baselines import GoGIScorer
from mist_core.scoring.memory import Footprint, measure, parse_bytes
from mist_core.scoring.passes import Plan
from pipelines.bench.scorer import synthetic_encoded
from reference import first_order

FIELDS = ["necessity_per_layer", "sufficiency_per_layer", "layer_weights", "necessity",
          "sufficiency", "scores", "log_likelihood", "nochain_log_likelihood"]
REGIMES = [(share, recompute) for share in (True, False) for recompute in (False, True)]


def long_model(arch: str, dtype=torch.float64, vocab: int = 400):
    """A tiny model with a context long enough for 1,000-token chains."""
    from conftest import full_precision_norms, make_model
    from mist_core.models import wrap_model

    model = make_model(arch, vocab, dtype=dtype)
    model.config.max_position_embeddings = 2048
    model.model.rotary_emb.__init__(model.config)  # rebuild the rotary table for the new length
    if dtype == torch.float64:
        full_precision_norms(model)
    return wrap_model(model, None, f"tiny-{arch}-long")


def assert_agrees_with_the_reference(scorer, examples, got):
    """Every field of each scored chain against the independent autograd computation (fp64)."""
    for ex, res in zip(examples, got):
        ref = first_order(scorer.lm, scorer.encode(ex), layer_weights=scorer.layer_weights)
        for name in FIELDS:
            np.testing.assert_allclose(getattr(res, name), ref[name], rtol=1e-5, atol=1e-9,
                                       err_msg=name)


@pytest.mark.parametrize("share,recompute", REGIMES, ids=[f"share={s}-recompute={r}" for s, r in REGIMES])
def test_every_regime_equals_plain_autograd_fp64(tiny_lm64, examples, share, recompute):
    scorer = MistScorer(tiny_lm64, share_prefix=share, recompute=recompute, max_batch=8,
                        target="answer")
    got = scorer.score(examples)
    assert_agrees_with_the_reference(scorer, examples, got)
    for res in got:
        assert np.abs(res.necessity_per_layer).max() > 1e-4


def test_a_masked_pass_takes_the_grouped_heads_as_they_are(tiny_lm64, examples, monkeypatch):
    """The passes that continue the question prefix's cache have a mask, where transformers
    would repeat a grouped-query model's keys and values to every query head before SDPA:
    those passes take them as they are, with the reference's numbers."""
    from transformers.integrations import sdpa_attention

    config = tiny_lm64.model.config
    assert config.num_key_value_heads < config.num_attention_heads
    repeated = []
    real = sdpa_attention.repeat_kv

    def counted(hidden, n_rep):
        if torch.is_grad_enabled():  # a pass that backpropagates (the prefix's runs without)
            repeated.append(n_rep)
        return real(hidden, n_rep)

    monkeypatch.setattr(sdpa_attention, "repeat_kv", counted)
    scorer = MistScorer(tiny_lm64, share_prefix=True, max_batch=8, target="answer")
    got = scorer.score(examples)
    assert repeated == []
    assert_agrees_with_the_reference(scorer, examples, got)


def forced(scorer: MistScorer, plan: Plan) -> MistScorer:
    scorer.plan = lambda batch: plan
    return scorer


@pytest.mark.parametrize("keep_every", [2, 3])
def test_keeping_every_kth_state_equals_plain_autograd_fp64(tiny_lm64, examples, keep_every):
    """The states between two kept ones are computed again when the backward reaches them:
    the same numbers as the reference, whether the kept ones fall on the top block or not."""
    scorer = forced(MistScorer(tiny_lm64, share_prefix=False, max_batch=8, target="answer"),
                    Plan(recompute=True, mlp_pieces=True, keep_every=keep_every))
    assert_agrees_with_the_reference(scorer, examples, scorer.score(examples))


def test_two_objectives_through_kept_states_equal_plain_autograd_fp64(tiny_lm64, examples):
    """target="both" in the leanest regime (MLP in pieces, every other state kept): each
    block's rerun is backpropagated twice, the answer's and the facts' gradients."""
    scorer = forced(MistScorer(tiny_lm64, share_prefix=False, max_batch=8, target="both"),
                    Plan(recompute=True, mlp_pieces=True, keep_every=2))
    for ex, res in zip(examples, scorer.score(examples)):
        enc = scorer.encode(ex)
        for name, target in (("necessity", "answer"), ("facts_necessity", "facts")):
            ref = first_order(scorer.lm, enc, layer_weights="clipped", target=target)
            np.testing.assert_allclose(getattr(res, name), ref["necessity"], rtol=1e-5,
                                       atol=1e-9, err_msg=name)


def test_long_chains_every_regime_agrees_with_the_reference_fp32(monkeypatch):
    """Chains of ~600 tokens (past the tiny models' usual context) in fp32, two of unequal
    length in one batch: every regime agrees with the independent computation to 1e-5 of
    each field's scale, with the recomputed MLP run in pieces of 64 positions (32 a chain)
    and with every second state kept."""
    import mist_core.scoring.attention as attention
    import mist_core.scoring.passes as passes
    import mist_core.scoring.tracing as tracing

    monkeypatch.setattr(passes, "MLP_POSITIONS", 64)
    monkeypatch.setitem(tracing.BATCH_OVERHEAD, "cpu", 10**6)  # the two chains in one batch
    # and each attention backward split in two calls of the fused kernel
    # (mist_core.scoring.attention)
    monkeypatch.setattr(attention, "SPLIT_FROM", 64)
    monkeypatch.setattr(attention, "_evener", lambda units, threads: True)
    kernel, stacked = attention._fused_backward, []  # calls over pieces stacked as batch rows
    monkeypatch.setattr(attention, "_fused_backward",
                        lambda *a, **k: (stacked.append(1) if a[1].shape[0] == 4 else None)
                        or kernel(*a, **k))
    pieces = []
    real = passes.checkpoint
    monkeypatch.setattr(passes, "checkpoint", lambda *a, **k: pieces.append(1) or real(*a, **k))
    lm = long_model("llama", dtype=torch.float32)
    encs = synthetic_encoded(2, 600, vocab=400, seed=1)
    assert len({len(e.source_ids) for e in encs}) == 2
    refs = [first_order(lm, e) for e in encs]
    regimes = [(share, Plan(recompute=r)) for share, r in REGIMES]
    regimes += [(share, Plan(recompute=True, mlp_pieces=True)) for share in (True, False)]
    regimes += [(False, Plan(recompute=True, mlp_pieces=True, keep_every=2))]
    regimes += [(False, Plan(recompute=True, attention_kept=2)),
                (False, Plan(recompute=True, mlp_pieces=True, keep_every=2, attention_kept=3))]
    for share, plan in regimes:
        scorer = MistScorer(lm, share_prefix=share, max_batch=8, max_tokens=8192,
                            target="answer")
        got = forced(scorer, plan).score_encoded(encs)
        for g, ref in zip(got, refs):
            for name in ["necessity_per_layer", "sufficiency_per_layer", "layer_weights"]:
                scale = np.abs(ref[name]).max()
                np.testing.assert_allclose(getattr(g, name), ref[name], rtol=1e-4, atol=1e-5 * scale,
                                           err_msg=f"{name} share={share} {plan}")
    # 3 blocks rerun with a graph, ~20 pieces of 32 positions each, in each of the 4 regimes
    # with the MLP in pieces
    assert len(pieces) >= 4 * 3 * 19
    # a split backward (the halves, then the quarters) for each of the 3 blocks above h^(1),
    # kept or not, in each of the 6 regimes without a prefix cache (a pass that continues a
    # cache runs SDPA)
    assert len(stacked) == 6 * 3 * 2


def test_the_cost_model_runs_long_chains_from_scratch(tiny_lm):
    short = synthetic_encoded(1, 20, vocab=300, seed=0)[0]
    scorer = MistScorer(tiny_lm)
    assert scorer.shares_prefix(short)
    lm = long_model("llama", dtype=torch.float32)
    long = synthetic_encoded(1, 1500, vocab=400, seed=0)[0]
    assert not MistScorer(lm).shares_prefix(long)


def test_gogi_recomputed_equals_stored(tiny_lm64, examples):
    stored = GoGIScorer(tiny_lm64, recompute=False).score(examples)
    recomputed = GoGIScorer(tiny_lm64, recompute=True).score(examples)
    for a, b in zip(stored, recomputed):
        np.testing.assert_allclose(b.scores, a.scores, rtol=1e-9)
        assert a.scores.max() > 0


def test_the_cap_picks_recomputation_only_where_needed(tiny_lm, monkeypatch):
    from mist_core.scoring import passes

    monkeypatch.setattr(passes, "MLP_POSITIONS", 16)  # pieces shorter than the chain
    encs = synthetic_encoded(4, 60, vocab=300, seed=2)
    scorer = MistScorer(tiny_lm, max_memory=10**9)
    batch = encs[:1]
    plans = scorer.plans()
    assert plans == [Plan(), Plan(recompute=True), Plan(recompute=True, mlp_pieces=True),
                     Plan(recompute=True, mlp_pieces=True, keep_every=2)]  # k = √(L + 1), L = 4
    needs = [scorer.need(batch, p) for p in plans]
    # states are cheaper than the graph, the MLP in pieces cheaper still, fewer states too
    assert needs == sorted(needs, reverse=True) and len(set(needs)) == 4
    assert scorer.plan(batch) == plans[0]
    kept = []
    for i in range(1, 4):
        scorer.max_memory = int((needs[i - 1] + needs[i]) / 2)
        got = scorer.plan(batch)
        assert replace(got, attention_kept=0) == plans[i]
        # the rest of the cap keeps attention outputs: as many blocks as fit, one more would not
        assert 0 <= got.attention_kept <= tiny_lm.n_layers - 1
        assert scorer.need(batch, got) <= scorer.max_memory
        if got.attention_kept < tiny_lm.n_layers - 1:
            more = replace(got, attention_kept=got.attention_kept + 1)
            assert scorer.need(batch, more) > scorer.max_memory
        kept.append(got.attention_kept)
    assert max(kept) > 0
    scorer.max_memory = needs[1]  # recomputation fits exactly: no room to keep anything
    assert scorer.plan(batch) == plans[1]
    scorer.max_memory = None
    assert MistScorer(tiny_lm, recompute=True, max_memory=None).plan(batch) == \
        replace(plans[1], attention_kept=tiny_lm.n_layers - 1)
    # only the blocks a backward reruns keep theirs: above the lowest layer it reaches
    assert MistScorer(tiny_lm, recompute=True, layers=[3, 4]).plan(batch).attention_kept == 1
    assert GoGIScorer(tiny_lm, recompute=True).plan(batch).attention_kept == 2  # l* = L - 2
    scorer.max_memory = int(needs[3] / 2)
    assert scorer.plan(batch) is None
    assert MistScorer(tiny_lm, recompute=True).plans() == plans[1:]
    assert MistScorer(tiny_lm, recompute=False).plans() == plans[:1]


def test_footprint_is_measured_per_token(tiny_lm):
    fp = measure(tiny_lm)
    d, L = tiny_lm.unembedding.shape[1], tiny_lm.n_layers
    inter = tiny_lm.model.config.intermediate_size
    assert fp.state == d * 4 and fp.layers == L
    assert fp.states_kept(1) == L + 1 and fp.states_kept(2) == 3 + 1
    # a block saves several [d]-sized tensors per token (norm input, q, k, v, MLP halves, …)
    assert 4 * d * 4 < fp.block < 200 * d * 4
    assert fp.stored == pytest.approx(fp.block * L)
    # the MLP saves its input and its intermediate activations (gate, up, their product, …)
    assert 2 * inter * 4 <= fp.mlp < fp.block
    # a kept attention output: heads × head_dim values and one log-sum-exp per head
    heads = tiny_lm.model.config.num_attention_heads
    assert fp.attention == heads * (d // heads * 4 + 4)


def test_a_chain_that_cannot_fit_alone_is_given_up_with_its_reason(tiny_lm64):
    tiny_lm = tiny_lm64
    encs = synthetic_encoded(3, 30, vocab=300, seed=4)
    encs[1] = synthetic_encoded(1, 180, vocab=300, seed=5)[0]
    probe = MistScorer(tiny_lm)
    cap = int(probe.need([encs[0]], probe.plans()[-1]) * 1.5)
    assert probe.need([encs[1]], probe.plans()[-1]) > cap
    scorer = MistScorer(tiny_lm, max_memory=cap)
    got = scorer.score_encoded(encs, errors="return")
    assert isinstance(got[1], InvalidExample) and got[1].reason == "too_long_for_memory"
    n = scorer.batch_length(encs[1])
    assert f"{n} tokens" in got[1].detail and "max_memory" in got[1].detail
    alone = MistScorer(tiny_lm).score_encoded([encs[0], encs[2]])
    for a, b in zip(alone, [got[0], got[2]]):
        np.testing.assert_allclose(b.scores, a.scores, rtol=1e-9, atol=1e-9)
    with pytest.raises(InvalidExample, match="too_long_for_memory"):
        scorer.score_encoded(encs)


class OOMOnce:
    """Raises an out-of-memory error for any batch holding more than `limit` chains."""

    def __init__(self, scorer, limit):
        self.inner, self.limit, self.sizes = scorer._score_batch, limit, []
        scorer._score_batch = self

    def __call__(self, batch, plan):
        self.sizes.append(len(batch))
        if len(batch) > self.limit:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return self.inner(batch, plan)


def test_a_batch_that_runs_out_of_memory_is_split_and_retried(tiny_lm64):
    encs = synthetic_encoded(6, 20, vocab=300, seed=6)
    scorer = MistScorer(tiny_lm64, max_batch=8, max_tokens=10**6)
    inject = OOMOnce(scorer, limit=2)
    got = scorer.score_encoded(encs)
    assert inject.sizes[0] == 6 and max(s for s in inject.sizes[1:]) <= 3 and min(inject.sizes) <= 2
    alone = [MistScorer(tiny_lm64).score_encoded([e])[0] for e in encs]
    for a, b in zip(alone, got):
        assert a.id == b.id
        np.testing.assert_allclose(b.scores, a.scores, rtol=1e-9, atol=1e-9)


def test_out_of_memory_alone_is_a_reject_not_a_crash(tiny_lm):
    encs = synthetic_encoded(3, 20, vocab=300, seed=7)
    scorer = MistScorer(tiny_lm, max_batch=8)
    OOMOnce(scorer, limit=0)
    got = scorer.score_encoded(encs, errors="return")
    assert all(isinstance(g, InvalidExample) and g.reason == "too_long_for_memory" for g in got)
    assert "ran out of memory even alone" in got[0].detail


def test_other_errors_are_not_taken_for_out_of_memory(tiny_lm):
    scorer = MistScorer(tiny_lm)

    def boom(batch, plan):
        raise RuntimeError("shape mismatch")

    scorer._score_batch = boom
    with pytest.raises(RuntimeError, match="shape mismatch"):
        scorer.score_encoded(synthetic_encoded(2, 10, vocab=300))


def test_the_cpu_scoring_environment_yields_to_the_callers():
    assert cpu_scoring_env({}) == CPU_SCORING_ENV == {"THP_MEM_ALLOC_ENABLE": "1"}
    assert cpu_scoring_env({"THP_MEM_ALLOC_ENABLE": "0", "OTHER": "x"}) == {"THP_MEM_ALLOC_ENABLE": "0"}


def wide_model():
    """A tiny Llama whose stored pass over 1,500 tokens keeps some 100 MB: more than glibc
    keeps of its own accord."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from mist_core.models import wrap_model

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=300, hidden_size=256, intermediate_size=1024,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=2048)
    return wrap_model(AutoModelForCausalLM.from_config(config, attn_implementation="sdpa"),
                      None, "tiny-llama-wide")


def minor_faults() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


@pytest.mark.skipif(allocator.glibc() is None, reason="the allocator kept is glibc's")
def test_stored_passes_map_their_pages_once_until_released():
    """Each page a stored pass faults in stays in the process: a later pass faults in only
    what the heap grows by. That need not be nothing: the free pieces a pass leaves among the
    kept pages depend on what the process allocated before, and the heap can grow over a few
    passes before every pass fits in what it holds (alone, the second pass grew it by up to
    12k pages; after the rest of the suite the third of three by 7.7k, the second by 14).
    What glibc gives back to the system and maps again (an allocation over its mmap
    threshold, a trimmed heap) is a fault that leaves nothing resident: 3-69k pages a pass
    here without keep_freed."""
    lm = wide_model()
    enc = synthetic_encoded(1, 1500, vocab=300)
    scorer = MistScorer(lm, recompute=False, max_memory=None)
    allocator.release(lm.device)  # as a process that never scored
    page = os.sysconf("SC_PAGE_SIZE")
    faults, mapped_again = [], []
    for _ in range(4):
        before, resident = minor_faults(), allocator.resident()
        first = scorer.score_encoded(enc)[0].scores
        faults.append(minor_faults() - before)
        # faults beyond the pages the process grew by: pages given back and mapped anew
        mapped_again.append(faults[-1] - (allocator.resident() - resident) // page)
    # the first pass maps its ~100 MB (25k pages of 4 KB, fewer where huge); the later ones
    # map nothing anew, and together less than the first did: mostly they reuse its pages
    assert faults[0] > 2000, faults
    assert max(mapped_again[1:]) < faults[0] / 20, (faults, mapped_again)
    assert sum(faults[1:]) < faults[0], (faults, mapped_again)
    kept = allocator.resident()
    allocator.release(lm.device)
    assert allocator.resident() < kept - 50 * 2**20
    before = minor_faults()
    np.testing.assert_array_equal(scorer.score_encoded(enc)[0].scores, first)
    assert minor_faults() - before > faults[0] / 2  # given back: mapped anew


@pytest.mark.skipif(allocator.glibc() is None, reason="the allocator kept is glibc's")
def test_what_stored_passes_kept_goes_back_over_the_cap_and_before_a_recomputed_pass():
    lm = wide_model()
    enc = synthetic_encoded(1, 1500, vocab=300)
    MistScorer(lm, recompute=False, max_memory=None).score_encoded(enc)
    kept = allocator.resident()
    with allocator.freed_to_the_system(lm.device):
        assert allocator.resident() < kept - 50 * 2**20
    allocator.release(lm.device)
    base = allocator.resident()
    MistScorer(lm, recompute=False, max_memory=None).score_encoded(enc)
    kept = allocator.resident()
    assert kept > base + 50 * 2**20
    assert allocator.hold_at_most(lm.device, None, base) == base
    assert allocator.hold_at_most(lm.device, kept - base, base) == base  # within: kept
    assert allocator.resident() > kept - 2**20
    # a cap below what its pass kept (the plan forced past it): the scorer gives it back
    scorer = forced(MistScorer(lm, max_memory=20 * 2**20), Plan())
    scorer.score_encoded(enc)
    assert allocator.resident() < base + 20 * 2**20
    assert abs(scorer._resident - allocator.resident()) < 2**20  # based anew


def test_parse_bytes():
    assert parse_bytes("1GB") == parse_bytes("1GiB") == parse_bytes("1g") == 2**30
    assert parse_bytes("512MB") == 512 * 2**20
    assert parse_bytes("1.5G") == int(1.5 * 2**30)
    assert parse_bytes("1000") == 1000 and parse_bytes(None) is None
    with pytest.raises(ValueError, match="memory size"):
        parse_bytes("lots")


def test_need_grows_with_positions():
    fp = Footprint(stored=1000.0, block=100.0, mlp=60.0, state=5.0, layers=9, transient=20.0,
                   mlp_transient=40.0, kv=10.0, attention=6.0)
    stored, recomputed = Plan(), Plan(recompute=True)
    assert fp.need(200, stored) == pytest.approx(2 * fp.need(100, stored))
    assert fp.need(100, recomputed) < fp.need(100, stored)
    assert fp.need(100, Plan(recompute=True, keep_every=3)) < fp.need(100, recomputed)
    # each kept attention output costs its bytes per position, at most one per layer
    kept = [fp.need(100, replace(recomputed, attention_kept=n)) for n in (0, 1, 9, 20)]
    assert kept[1] - kept[0] == pytest.approx(fp.OVERHEAD * 100 * 6.0)
    assert kept[2] == pytest.approx(kept[0] + 9 * (kept[1] - kept[0])) == kept[3]
    # with the MLP in pieces a recomputed pass holds one piece, whatever its length
    from mist_core.scoring.passes import MLP_POSITIONS
    n = 4 * MLP_POSITIONS
    pieces = Plan(recompute=True, mlp_pieces=True)
    assert fp.need(n, pieces) < fp.need(n, recomputed)
    assert fp.need(2 * n, pieces) - fp.need(n, pieces) == \
        pytest.approx(fp.OVERHEAD * n * fp.per_token(pieces))
    # a second objective backpropagated through the pass holds one more gradient state
    assert fp.need(100, pieces, gradients=2) - fp.need(100, pieces) == \
        pytest.approx(fp.OVERHEAD * 100 * fp.state)


def test_mlp_pieces_give_the_same_numbers_and_leave_the_model_as_it_was(tiny_lm):
    from mist_core.scoring.passes import chunked_mlp

    mlp, other = tiny_lm.blocks[0].mlp, tiny_lm.blocks[1].mlp
    own = lambda x: type(mlp).forward(mlp, x)  # noqa: E731  (as a hook library sets one)
    mlp.forward = own
    try:
        x = torch.randn(2, 21, tiny_lm.unembedding.shape[1], requires_grad=True)
        whole = mlp(x)
        (g_whole,) = torch.autograd.grad(whole.square().sum(), [x])
        with chunked_mlp(tiny_lm, positions=8):  # 4 positions a row: 6 pieces
            assert mlp.forward is not own
            pieces = mlp(x)
            (g_pieces,) = torch.autograd.grad(pieces.square().sum(), [x])
        torch.testing.assert_close(pieces, whole)
        torch.testing.assert_close(g_pieces, g_whole)
        assert mlp.forward is own and "forward" not in other.__dict__
    finally:
        del mlp.forward


def test_kept_attention_gives_the_same_numbers_bit_for_bit(monkeypatch):
    """A recomputed pass that keeps the attention outputs of its first forward gives exactly
    the numbers of one that recomputes them, and its reruns do skip attention: the kept
    blocks run the fused kernel once in the forward and never again. Afterwards the model
    is on SDPA again. Where a pass has a mask (a prefix cache) nothing is kept."""
    import mist_core.scoring.attention as attention
    import mist_core.scoring.tracing as tracing

    monkeypatch.setitem(tracing.BATCH_OVERHEAD, "cpu", 10**6)  # the two chains in one batch
    lm = long_model("qwen2", dtype=torch.float32)
    encs = synthetic_encoded(2, 300, vocab=400, seed=3)
    calls = {"kept": 0, "computed": 0}  # fused forwards kept for a rerun, and in a rerun
    fused = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu

    class Counted:
        def __call__(self, *a, **k):
            kept = attention._ACTIVE.get()
            calls["kept" if kept is not None and kept.recording else "computed"] += 1
            return fused(*a, **k)

    monkeypatch.setattr(attention, "_fused", Counted())

    def run(plan, share=False):
        scorer = forced(MistScorer(lm, share_prefix=share, max_tokens=8192), plan)
        return scorer.score_encoded(encs)

    L = lm.n_layers
    for plan in [Plan(recompute=True), Plan(recompute=True, mlp_pieces=True, keep_every=2)]:
        plain = run(plan)
        # blocks L..2 are rerun (the backward stops at h^(1)), each computing its attention
        assert calls == {"kept": 0, "computed": L - 1}
        calls.update(kept=0, computed=0)
        for kept in (1, L - 1, L):
            got = run(replace(plan, attention_kept=kept))
            # L - 1 at most are kept, and their reruns compute no attention
            assert calls == {"kept": min(kept, L - 1), "computed": L - 1 - min(kept, L - 1)}
            calls.update(kept=0, computed=0)
            for a, b in zip(plain, got):
                for name in FIELDS:
                    np.testing.assert_array_equal(getattr(b, name), getattr(a, name), err_msg=name)
            assert lm.model.config._attn_implementation == "sdpa"
    shared = run(Plan(recompute=True, attention_kept=L - 1), share=True)
    assert calls == {"kept": 0, "computed": 0}
    for a, b in zip(run(Plan(recompute=True), share=True), shared):
        np.testing.assert_array_equal(b.scores, a.scores)


@pytest.mark.parametrize("batch,heads,kv_heads,positions",
                         [(1, 9, 3, 64), (1, 9, 3, 67), (1, 3, 3, 131), (3, 2, 1, 133), (2, 4, 1, 5)])
def test_a_split_attention_backward_equals_the_kernels(monkeypatch, batch, heads, kv_heads,
                                                       positions):
    """The two calls of the fused kernel over halves and quarters of the sequence (and two
    small ones over the last 1-3 positions, where the length does not divide by 4) give the
    gradients of the one call over the whole, grouped heads or not; where the pieces share
    out evenly over the threads the kernel runs once, as it is."""
    from mist_core.scoring import attention

    monkeypatch.setattr(attention, "SPLIT_FROM", 2)
    g = torch.Generator().manual_seed(positions)
    q = torch.randn(batch, heads, positions, 16, dtype=torch.float64, generator=g)
    k, v = (torch.randn(batch, kv_heads, positions, 16, dtype=torch.float64, generator=g)
            for _ in range(2))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)
    grad = torch.randn(out.shape, dtype=out.dtype, generator=g)
    whole = attention._fused_backward(grad, q, k, v, out, lse, 0.0, True)
    kernel, calls = attention._fused_backward, []
    monkeypatch.setattr(attention, "_fused_backward", lambda *a, **kw: calls.append(a[7]) or kernel(*a, **kw))
    even = attention.split_backward(grad, q, k, v, out, lse, threads=batch * kv_heads)
    assert calls == [True] and all(torch.equal(e, w) for e, w in zip(even, whole))
    calls.clear()
    split = attention.split_backward(grad, q, k, v, out, lse, threads=2 * batch * kv_heads + 1)
    # the causal halves, then the rectangle's quarters, then the last positions
    assert calls == [True, False] + [True, False] * (positions % 4 > 0)
    for name, w, s in zip("qkv", whole, split):
        assert s.shape == w.shape
        torch.testing.assert_close(s, w, rtol=1e-12, atol=1e-12, msg=name)
    assert attention._evener(3, 2) and attention._evener(1, 2) and not attention._evener(2, 2)
    assert not attention._evener(24, 2) and not attention._evener(3, 1)


@pytest.mark.parametrize("batch,positions,live,split", [
    (1, 64, (60, 63), False), (2, 67, (40, 67), False), (1, 131, (0, 50), False),
    (1, 301, (200, 298), True), (3, 133, (66, 130), True), (1, 40, (0, 0), False)])
def test_an_attention_backward_runs_only_the_live_rows(monkeypatch, batch, positions, live,
                                                      split):
    """Where most query positions have a zero output gradient (a last block, whose output
    reaches only the answer's logits), only the others run, split or not, and the
    gradients are the whole kernel's."""
    from mist_core.scoring import attention

    monkeypatch.setattr(attention, "SPLIT_FROM", 64)
    g = torch.Generator().manual_seed(positions)
    q = torch.randn(batch, 6, positions, 8, dtype=torch.float64, generator=g)
    k, v = (torch.randn(batch, 2, positions, 8, dtype=torch.float64, generator=g) for _ in range(2))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)
    grad = torch.zeros(out.shape, dtype=out.dtype)
    lo, hi = live
    grad[-1, :, lo:hi] = torch.randn(grad[-1, :, lo:hi].shape, dtype=out.dtype, generator=g)
    if hi > lo:
        grad[0, 1, lo] = 1.0  # live in another batch row and one head
    assert attention.live_rows(grad) == (lo, hi)
    assert attention.live_rows(grad.new_full((1, 1, 9, 2), float("nan"))) == (0, 9)
    whole = attention._fused_backward(grad, q, k, v, out, lse, 0.0, True)
    kernel, queries = attention._fused_backward, []
    monkeypatch.setattr(attention, "_fused_backward",
                        lambda *a, **kw: queries.append(a[1].shape[0] * a[1].shape[2]) or kernel(*a, **kw))
    got = attention.split_backward(grad, q, k, v, out, lse, threads=4 * batch * 2 + 1 if split else 1)
    for name, w, s in zip("qkv", whole, got):
        torch.testing.assert_close(s, w, rtol=1e-12, atol=1e-12, msg=name)
    n, before = hi - lo, int(lo > 0)  # live queries; whether keys before them run
    if 2 * n > positions:
        assert queries == [batch * positions]
    elif split:  # halves, quarters (half the queries again), the keys before, the last 0-3
        m, r = n // 4, n % 4
        assert sum(queries) == batch * (4 * m + 2 * m + before * 4 * m + r + r * (lo + m > 0))
    else:  # against their own keys, then against the keys before them
        assert sum(queries) == batch * n * (1 + before)


def test_live_rows_are_the_first_and_last_rows_that_are_not_zero():
    """Whether the ends settle it (the first row live and the last live one among the last
    TAIL) or the whole is read: the same rows as a plain scan."""
    from mist_core.scoring import attention

    g = torch.Generator().manual_seed(11)
    tail = attention.TAIL
    for positions in (5, 2 * tail, 2 * tail + 1, 3 * tail + 7):
        for lo, hi in [(0, positions), (0, positions - 3), (0, positions - tail),
                       (0, positions - tail - 1), (1, positions - 2), (0, 1), (0, 0),
                       (positions - 1, positions), (2, 3)]:
            grad = torch.zeros(2, 3, positions, 4)
            if hi > lo:  # the ends live in different batch rows and heads, some rows between dead
                grad[1, 2, lo, 1] = 1.0
                grad[0, 0, hi - 1, 3] = float("nan") if positions % 2 else -1.0
                inner = torch.rand(hi - lo, generator=g) < 0.5
                grad[0, 1, lo:hi][inner] = torch.randn(int(inner.sum()), 4, generator=g)
            assert attention.live_rows(grad) == ((lo, hi) if hi > lo else (0, 0)), (positions, lo, hi)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "qwen3"])
def test_a_rerun_does_not_compute_the_unread_projection(monkeypatch, arch):
    """A recomputed pass's reruns, whose outputs only their own backward reads, skip the
    last MLP projection (which in these models feeds the block's output alone) and run its
    backward, with the stored pass's numbers; a model not known to add it straight to the
    residual stream computes it."""
    lm = long_model(arch)
    encs = synthetic_encoded(2, 40, vocab=400, seed=5)
    computed = []  # each call under autograd: whether the projection's output was computed

    def spy(module, args, out):
        if torch.is_grad_enabled():
            computed.append(out.stride(-1) != 0)

    hooks = [b.mlp.down_proj.register_forward_hook(spy) for b in lm.blocks]
    try:
        def run(plan):
            computed.clear()
            return forced(MistScorer(lm, share_prefix=False), plan).score_encoded(encs)

        stored = run(Plan())
        assert computed.count(False) == 0 and computed.count(True) == 2 * lm.n_layers
        rerun = run(Plan(recompute=True, mlp_pieces=True))
        # blocks L..2 rerun, each once (pieces of 1,024 positions: one here)
        assert computed.count(False) == lm.n_layers - 1
        for a, b in zip(stored, rerun):
            for name in FIELDS:
                np.testing.assert_allclose(getattr(b, name), getattr(a, name), rtol=1e-9,
                                           atol=1e-12, err_msg=name)
        monkeypatch.setattr(lm.model.config, "model_type", "another")
        run(Plan(recompute=True))
        assert computed.count(False) == 0
    finally:
        for h in hooks:
            h.remove()
    assert all("forward" not in b.mlp.down_proj.__dict__ for b in lm.blocks)


def test_kept_attention_only_where_it_applies(tiny_lm, monkeypatch):
    from mist_core.scoring import attention

    assert attention.keepable(tiny_lm)
    with attention.cpu_attention(tiny_lm, 0) as kept:  # attention here, nothing kept
        assert kept is None and tiny_lm.model.config._attn_implementation == attention.NAME
    assert tiny_lm.model.config._attn_implementation == "sdpa"
    tiny_lm.model.set_attn_implementation("eager")
    try:
        assert not attention.keepable(tiny_lm)
        with attention.cpu_attention(tiny_lm, 2) as kept:
            assert kept is None and tiny_lm.model.config._attn_implementation == "eager"
    finally:
        tiny_lm.model.set_attn_implementation("sdpa")

    def refuse(name, *args, **kwargs):
        raise ValueError(f"{name} is not supported by this model")

    # a model that refuses another attention implementation keeps nothing, and still scores
    monkeypatch.setattr(tiny_lm.model, "set_attn_implementation", refuse)
    with attention.cpu_attention(tiny_lm, 2) as kept:
        assert kept is None and tiny_lm.model.config._attn_implementation == "sdpa"
    encs = synthetic_encoded(1, 30, vocab=300, seed=8)
    kept_plan = Plan(recompute=True, attention_kept=tiny_lm.n_layers - 1)
    got = forced(MistScorer(tiny_lm, share_prefix=False), kept_plan).score_encoded(encs)
    monkeypatch.undo()
    ref = forced(MistScorer(tiny_lm, share_prefix=False), Plan(recompute=True)).score_encoded(encs)
    # the same kernel, but here the last block's backward runs only the answer's rows
    np.testing.assert_allclose(got[0].scores, ref[0].scores, rtol=1e-5, atol=1e-6)
