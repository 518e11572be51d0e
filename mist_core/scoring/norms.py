"""The RMSNorm of a pass that backpropagates: the same forward, a shorter backward.

Autograd takes transformers' RMSNorm apart into its operations (a square, a mean, a sum
with ε, a reciprocal square root, two products) and runs a backward for each: about a dozen
passes over a [T, d] tensor, where the derivative needs four. A block has two norms and the
model a final one, 2L + 1 a pass (what that saves: docs/results/performance.md)."""
from __future__ import annotations

import functools
from contextlib import contextmanager

import torch

from ..models import LM
from .tracing import transformers_classes, wrapped_forwards


# transformers' RMSNorm classes whose forward is y = w · x / sqrt(mean(x²) + ε), computed in
# fp32 and cast back before the product with w (their code, checked for each).
KNOWN = {"llama": "LlamaRMSNorm", "mistral": "MistralRMSNorm", "qwen2": "Qwen2RMSNorm",
         "qwen3": "Qwen3RMSNorm"}


@functools.cache
def known_norms() -> tuple[type, ...]:
    """The classes of KNOWN that this transformers has."""
    return transformers_classes(KNOWN)


class _RMSNorm(torch.autograd.Function):
    """transformers' RMSNorm, operation for operation in the forward (so the same numbers),
    with its derivative in closed form: with g' = g · w and r = 1 / sqrt(mean(x²) + ε),
    ∂/∂x = g' · r − x · r³ · mean(g' · x)."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        x32 = x.to(torch.float32)
        r = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, r)
        return weight * (x32 * r).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight, r = ctx.saved_tensors
        x32 = x.to(torch.float32)
        gw = (grad * weight).to(torch.float32)
        c = (gw * x32).mean(-1, keepdim=True).mul_(r.pow(3))
        return gw.mul_(r).sub_(x32 * c).to(x.dtype), None, None


@contextmanager
def fused_norms(lm: LM):
    """Within the block, the model's RMSNorms of `known_norms` run as _RMSNorm where autograd
    records them and their weight takes no gradient (MIST's passes backpropagate to the
    residual stream only); elsewhere, and for any other norm or one whose forward was
    replaced on the instance (the tests' fp64 norms), as they are."""
    norms = [m for m in lm.model.modules()
             if type(m) in known_norms() and "forward" not in m.__dict__]

    def fused(norm, forward):
        def run(x):
            if torch.is_grad_enabled() and x.requires_grad and not norm.weight.requires_grad:
                return _RMSNorm.apply(x, norm.weight, norm.variance_epsilon)
            return forward(x)
        return run

    with wrapped_forwards(norms, fused):
        yield
