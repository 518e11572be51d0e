"""Attention outputs kept from a forward without a graph, so that a recomputed pass's
rerun of a block skips its attention.

A recomputed backward (mist_core.passes) runs each block twice: once without a graph to
get the states, once with one just before the block's own backward. On long chains
attention is most of that rerun (on SmolLM2 at 4k tokens, 5.1 of an 11.2-s forward). Its
backward needs only the queries, keys and values, which the rerun recomputes cheaply, and
the output and log-sum-exp of the first forward, which is what is kept: one position's
output is one state's worth of memory (heads × head_dim), so a pass keeps it for as many
of the top blocks as its memory cap leaves room for (`Plan.attention_kept`).

The kept numbers are those of the same kernel SDPA runs (PyTorch's fused CPU attention,
its causal case without a mask), and the backward is that kernel's own, so scores are
bit-identical with or without keeping. Other cases (a mask, a cache, another device or
attention implementation) run SDPA as usual."""
from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar

import torch

from .models import LM

_fused = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
NAME = "mist_kept_sdpa"  # the transformers attention implementation registered here
_ACTIVE: ContextVar["Kept | None"] = ContextVar("mist_kept_attention", default=None)


def keepable(lm: LM) -> bool:
    """Whether this model's passes can keep attention outputs: SDPA attention on CPU."""
    return (lm.device.type == "cpu"
            and getattr(lm.model.config, "_attn_implementation", None) == "sdpa"
            and _fused is not None)


class Kept:
    """Output and log-sum-exp per layer index, recorded while `recording`, each handed out
    once to the block's rerun with a graph."""

    def __init__(self, layers: set[int]):
        self.layers = layers  # 0-based layer indices (attention modules' `layer_idx`)
        self.recording = True
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}


@contextmanager
def keeping(lm: LM, blocks: int):
    """Within the block, the attention of the top `blocks` blocks keeps its output in the
    forward recorded first (until `Kept.recording` is set False) and hands it to the next
    rerun of that block under autograd. Yields the Kept, or None where nothing is kept."""
    if blocks <= 0 or not keepable(lm):
        yield None
        return
    _register()
    L = lm.n_layers
    kept = Kept(set(range(L - min(blocks, L), L)))
    try:
        lm.model.set_attn_implementation(NAME)
    except (ValueError, KeyError, NotImplementedError):  # a model that takes no other
        yield None
        return
    token = _ACTIVE.set(kept)
    try:
        yield kept
    finally:
        _ACTIVE.reset(token)
        lm.model.set_attn_implementation("sdpa")
        kept.outputs.clear()


_registered = False


def _register() -> None:
    global _registered
    if not _registered:
        from transformers import AttentionInterface, AttentionMaskInterface
        from transformers.masking_utils import sdpa_mask

        AttentionInterface.register(NAME, _attention)
        # the masks SDPA gets (None where is_causal does it); without a mask function of
        # its own an implementation gets no mask at all
        AttentionMaskInterface.register(NAME, sdpa_mask)
        _registered = True


def _attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
               is_causal=None, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    kept = _ACTIVE.get()
    layer = getattr(module, "layer_idx", None)
    fused = (kept is not None and layer in kept.layers and attention_mask is None
             and is_causal in (None, True) and getattr(module, "is_causal", True)
             and dropout == 0.0 and query.shape[2] == key.shape[2] > 1)
    if fused and kept.recording and not torch.is_grad_enabled():
        out, lse = _fused(query, key, value, 0.0, True, scale=scaling)
        kept.outputs[layer] = (out, lse)
        return out.transpose(1, 2).contiguous(), None
    if fused and not kept.recording and torch.is_grad_enabled() and layer in kept.outputs:
        out, lse = kept.outputs.pop(layer)
        if out.shape == query.shape:
            return _Replayed.apply(query, key, value, out, lse, scaling), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                  scaling=scaling, is_causal=is_causal, **kwargs)


class _Replayed(torch.autograd.Function):
    """The kept output of the attention over (query, key, value), with the fused kernel's
    own backward."""

    @staticmethod
    def forward(ctx, query, key, value, out, lse, scale):
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.scale = scale
        return out.transpose(1, 2).contiguous()

    @staticmethod
    def backward(ctx, grad):
        query, key, value, out, lse = ctx.saved_tensors
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad.transpose(1, 2), query, key, value, out, lse, 0.0, True, scale=ctx.scale)
        return dq, dk, dv, None, None, None
