"""The gated MLP product that keeps two tensors instead of three (mist_core.scoring.swiglu): the
forward and the backward of transformers' MLPs bit for bit, the memory it saves, and the
passes that use it."""
import contextlib

import numpy as np
import pytest
import torch

from mist_core import MistScorer
from mist_core.scoring import swiglu
from mist_core.scoring.memory import saved_bytes
from mist_core.scoring.passes import Plan
from pipelines.bench.scorer import synthetic_encoded


def mlp_modules(model):
    return [m for m in model.modules() if type(m) in swiglu.known_mlps()]


@pytest.fixture
def calls(monkeypatch):
    """One entry for each call of the fused product."""
    from conftest import counted_applies

    return counted_applies(monkeypatch, swiglu._SiLUProduct)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_mlp_is_transformers_bit_for_bit_with_a_third_less_saved(calls, arch, dtype):
    from conftest import make_model
    from mist_core.models import wrap_model

    assert len(swiglu.known_mlps()) == len(swiglu.KNOWN)  # this transformers has them all
    lm = wrap_model(make_model(arch, 300, dtype=dtype), None, f"tiny-{arch}")
    found = mlp_modules(lm.model)
    assert len(found) == lm.n_layers
    params = {p.untyped_storage().data_ptr() for p in lm.model.parameters()}
    gen = torch.Generator().manual_seed(5)
    m = found[1]
    d, inter = m.gate_proj.in_features, m.gate_proj.out_features
    x = (2 * torch.randn(2, 7, d, generator=gen)).to(dtype).requires_grad_(True)
    g = torch.randn(2, 7, d, generator=gen).to(dtype)
    outs = []
    plain_saved = saved_bytes(lambda: outs.append(m(x)), params)
    (autograd,) = torch.autograd.grad(outs[0], x, g)
    with swiglu.fused_swiglu(lm):
        fused_saved = saved_bytes(lambda: outs.append(m(x)), params)
        (fused,) = torch.autograd.grad(outs[1], x, g)
    expected, got = outs
    assert len(calls) == 1
    assert torch.equal(got, expected) and torch.equal(fused, autograd)
    width = 2 * 7 * inter * x.element_size()  # one tensor of the MLP's width
    assert plain_saved - fused_saved == width
    assert fused_saved == 2 * width  # gate(x) and up(x), nothing else
    assert all("forward" not in m.__dict__ for m in found)


def test_the_mlp_runs_as_it_is_where_no_derivative_is_taken_this_way(calls, tiny_lm):
    m = mlp_modules(tiny_lm.model)[0]
    x = torch.randn(1, 5, m.gate_proj.in_features, requires_grad=True)
    with swiglu.fused_swiglu(tiny_lm):
        with torch.no_grad():  # no graph
            m(x)
        m(x.detach())  # an input without a graph
        assert not calls
        m(x)
        assert len(calls) == 1
    m(x)  # and afterwards, as it was
    assert len(calls) == 1 and "forward" not in m.__dict__


def test_an_mlp_with_another_activation_or_its_own_forward_is_left_alone(calls, tiny_lm):
    first, second = mlp_modules(tiny_lm.model)[:2]
    act = first.act_fn
    first.act_fn = torch.nn.GELU()  # a product this derivative is not
    own = lambda x: type(second).forward(second, x)  # noqa: E731  (as a hook library sets one)
    second.forward = own
    x = torch.randn(1, 5, first.gate_proj.in_features, requires_grad=True)
    try:
        with swiglu.fused_swiglu(tiny_lm):
            first(x), second(x)
            assert not calls and second.forward is own
    finally:
        first.act_fn = act
        del second.forward


@pytest.mark.parametrize("plan", [Plan(), Plan(recompute=True),
                                  Plan(recompute=True, mlp_pieces=True)],
                         ids=["stored", "recomputed", "pieces"])
def test_every_pass_uses_it_with_autograds_numbers(monkeypatch, calls, tiny_lm, plan):
    """Every MLP a pass backpropagates through takes the fused product (each piece of it,
    where the MLP runs in pieces), and the scores are autograd's to the last bit."""
    from test_memory import FIELDS, forced

    monkeypatch.setattr("mist_core.scoring.passes.MLP_POSITIONS", 16)
    encs = synthetic_encoded(2, 30, vocab=300, seed=4)
    answer = MistScorer(tiny_lm, share_prefix=False, target="answer")
    fused = forced(answer, plan).score_encoded(encs)
    L = tiny_lm.n_layers
    width = max(len(e.source_ids) for e in encs)
    # a checkpointed piece runs twice: in the rerun, and again in its backward
    pieces = 2 * -(-width // (16 // len(encs))) if plan.mlp_pieces else 1
    # the no-chain pass through every block; a stored source pass through every block, a
    # recomputed one through the reruns of blocks L..2
    assert len(calls) == L + (pieces * (L - 1) if plan.recompute else L)

    monkeypatch.setattr("mist_core.scoring.passes.fused_swiglu",
                        lambda lm: contextlib.nullcontext())
    plain = forced(MistScorer(tiny_lm, share_prefix=False, target="answer"),
                   plan).score_encoded(encs)
    for a, b in zip(fused, plain):
        for name in FIELDS:
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)


def test_the_footprint_counts_the_mlp_as_the_passes_run_it(tiny_lm):
    """memory.measure's MLP share is the fused MLP's: a stored pass's blocks hold gate(x) and
    up(x) a position, and so does the share the planner takes off a block for MLP pieces."""
    from mist_core.scoring import memory

    fp = memory.measure(tiny_lm)
    config = tiny_lm.model.config
    assert fp.mlp == 2 * config.intermediate_size * 4  # fp32
    assert fp.mlp < fp.block
