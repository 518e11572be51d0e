"""The gated MLP of a pass that backpropagates: the same forward, one tensor fewer saved.

transformers' gated MLPs compute down(act(gate(x)) · up(x)). Under autograd the product
keeps both of its factors for the backward, and the activation keeps its input: three
tensors of the MLP's width a position, where the derivative needs two (the activation's
input and the up projection; act(gate) is cheap to compute again). The MLP's width is most
of a block's activations, so a stored pass's block keeps one tensor of that width a position
fewer (and a recomputed pass's block rerun, or MLP piece, as much less; the sizes on SmolLM2
in docs/results/performance.md)."""
from __future__ import annotations

import functools
from contextlib import contextmanager

import torch

from ..models import LM
from .tracing import transformers_classes, wrapped_forwards

# transformers' gated MLP classes whose forward is down_proj(act_fn(gate_proj(x)) * up_proj(x))
# (their code, checked for each)
KNOWN = {"llama": "LlamaMLP", "mistral": "MistralMLP", "qwen2": "Qwen2MLP",
         "qwen3": "Qwen3MLP"}


@functools.cache
def known_mlps() -> tuple[type, ...]:
    """The classes of KNOWN that this transformers has."""
    return transformers_classes(KNOWN)


def _is_silu(act) -> bool:
    from transformers.activations import SiLUActivation

    return type(act) in (torch.nn.SiLU, SiLUActivation)


class _SiLUProduct(torch.autograd.Function):
    """silu(gate) · up, computed as transformers does (so the same numbers), keeping gate
    and up only: silu(gate) is computed again in the backward."""

    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return torch.nn.functional.silu(gate) * up

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        d_gate = torch.ops.aten.silu_backward(grad * up, gate)
        d_up = torch.nn.functional.silu(gate).mul_(grad)
        return d_gate, d_up


@contextmanager
def fused_swiglu(lm: LM):
    """Within the block, the model's gated MLPs of `known_mlps` whose activation is SiLU take
    their product as _SiLUProduct where autograd records it; elsewhere, and for any other
    MLP or one whose forward was replaced on the instance, they run as they are."""
    mlps = [m for m in lm.model.modules()
            if type(m) in known_mlps() and "forward" not in m.__dict__
            and _is_silu(getattr(m, "act_fn", None))]

    def fused(mlp, forward):
        def run(x):
            if torch.is_grad_enabled() and x.requires_grad:
                return mlp.down_proj(_SiLUProduct.apply(mlp.gate_proj(x), mlp.up_proj(x)))
            return forward(x)
        return run

    with wrapped_forwards(mlps, fused):
        yield
