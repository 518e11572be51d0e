"""The RMSNorm with a backward of its own (mist_core.scoring.norms): the forward of transformers'
norms bit for bit, their derivative, and the passes that use it."""
import contextlib

import numpy as np
import pytest
import torch

from mist_core import MistScorer
from mist_core.scoring import norms
from mist_core.scoring.passes import Plan
from pipelines.bench.scorer import synthetic_encoded


def norm_modules(model):
    return [m for m in model.modules() if type(m) in norms.known_norms()]


@pytest.fixture
def calls(monkeypatch):
    """One entry for each call of the closed-form norm."""
    from conftest import counted_applies

    return counted_applies(monkeypatch, norms._RMSNorm)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_norm_forward_is_transformers_and_its_backward_the_derivative(arch, dtype):
    from conftest import make_model
    from mist_core.models import wrap_model

    assert len(norms.known_norms()) == len(norms.KNOWN)  # this transformers has them all
    lm = wrap_model(make_model(arch, 300, dtype=dtype), None, f"tiny-{arch}")
    found = norm_modules(lm.model)
    # two a block and the final one (Qwen3 also normalises its queries and keys)
    assert len(found) == (4 if arch == "qwen3" else 2) * lm.n_layers + 1
    gen = torch.Generator().manual_seed(3)
    for m in found:
        m.weight.copy_(torch.randn(m.weight.shape, generator=gen) + 1)
    for m in found[:3] + found[-1:]:
        d = m.weight.shape[0]
        x = (3 * torch.randn(2, 7, d, generator=gen)).to(dtype).requires_grad_(True)
        g = torch.randn(2, 7, d, generator=gen).to(dtype)
        expected = m(x)
        (autograd,) = torch.autograd.grad(expected, x, g)
        with norms.fused_norms(lm):
            got = m(x)
            assert got.grad_fn is not None and "_RMSNorm" in type(got.grad_fn).__name__
            (fused,) = torch.autograd.grad(got, x, g)
        assert torch.equal(got, expected)
        # the derivative in fp64 of the same function, against which both are roundings
        x64 = x.detach().double().requires_grad_(True)
        y64 = m.weight.double() * x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True)
                                                   + m.variance_epsilon)
        (exact,) = torch.autograd.grad(y64, x64, g.double())
        scale = exact.abs().max()
        tol = 1e-6 if dtype == torch.float32 else 2e-2
        assert (fused.double() - exact).abs().max() <= tol * scale
        assert (fused.double() - autograd.double()).abs().max() <= 2 * tol * scale
    assert all("forward" not in m.__dict__ for m in found)


def test_the_norm_runs_as_it_is_where_no_derivative_is_taken_this_way(calls, tiny_lm):
    m = norm_modules(tiny_lm.model)[0]
    x = torch.randn(1, 5, m.weight.shape[0], requires_grad=True)
    with norms.fused_norms(tiny_lm):
        with torch.no_grad():  # no graph
            m(x)
        m(x.detach())  # an input without a graph
        m.weight.requires_grad_(True)  # a weight that wants its gradient: autograd's backward
        try:
            m(x)
        finally:
            m.weight.requires_grad_(False)
        assert not calls
        m(x)
        assert len(calls) == 1
    m(x)  # and afterwards, as it was
    assert len(calls) == 1 and "forward" not in m.__dict__


@pytest.mark.parametrize("plan", [Plan(), Plan(recompute=True, mlp_pieces=True)],
                         ids=["stored", "recomputed"])
def test_both_passes_use_it_with_autograds_numbers(monkeypatch, calls, tiny_lm, plan):
    """Every norm a pass backpropagates through runs as _RMSNorm, and the scores are those
    of autograd's backward (fp32: to rounding)."""
    from test_memory import FIELDS, forced

    encs = synthetic_encoded(2, 30, vocab=300, seed=4)
    # The paper's signed weights: clipped ones leave this random model's necessity at 1e-9,
    # fp32 rounding; the per-layer terms compared are the same either way.
    fused = forced(MistScorer(tiny_lm, share_prefix=False, layer_weights="signed"), plan).score_encoded(encs)
    L = tiny_lm.n_layers
    # the no-chain pass and the source pass, each through 2 norms a block and the final
    # one; a recomputed source pass through the reruns of blocks L..2 and the final norm
    assert len(calls) == (2 * L + 1) + ((2 * (L - 1) + 1) if plan.recompute else (2 * L + 1))

    monkeypatch.setattr("mist_core.scoring.passes.fused_norms", lambda lm: contextlib.nullcontext())
    plain = forced(MistScorer(tiny_lm, share_prefix=False, layer_weights="signed"), plan).score_encoded(encs)
    for a, b in zip(fused, plain):
        for name in FIELDS:  # to 1e-5 of each field's largest value
            # but `scores`, Eq. 8 of the two axes, whose log(|necessity|) makes the rounding of
            # a necessity near 0 large (on one CPU 2e-5, where each axis agreed to 1e-6)
            tol = 1e-4 if name == "scores" else 1e-5
            want = np.asarray(getattr(b, name))
            np.testing.assert_allclose(getattr(a, name), want, rtol=tol,
                                       atol=tol * np.abs(want).max(), err_msg=name)
