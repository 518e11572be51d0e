"""The attention of a pass that backpropagates on a CPU: PyTorch's fused kernel, its
backward with the work split evenly over the threads, and outputs kept from a forward
without a graph so that a recomputed pass's rerun of a block skips its attention.

- Even threads. PyTorch's CPU flash-attention backward divides its work by batch row and
  key/value head: a grouped-query model with 3 key/value heads (SmolLM2-135M) leaves one of
  2 threads idle a third of the time, a quarter of the threads' time over a 4k-token
  scoring. Here a long causal attention's backward runs as two calls of that kernel, each
  over twice the pieces: the two causal halves of the sequence stacked in one, the queries
  of the second half against the keys of the first (two quarters, stacked) in the other,
  with the full attention's output and log-sum-exp, so each piece's gradients are its share
  of the whole and they add up to them (`split_backward`).
- Kept outputs. A recomputed backward (mist_core.passes) runs each block twice: once
  without a graph to get the states, once with one just before the block's own backward.
  On long chains attention is most of that rerun (on SmolLM2 at 4k tokens, 5.1 of an
  11.2-s forward). Its backward needs only the queries, keys and values, which the rerun
  recomputes cheaply, and the output and log-sum-exp of the first forward, which is what
  is kept: one position's output is one state's worth of memory (heads × head_dim), so a
  pass keeps it for as many of the top blocks as its memory cap leaves room for
  (`Plan.attention_kept`).

The numbers are those of the kernel SDPA runs (its causal case without a mask), so kept or
not the scores are bit-identical. Other cases (a mask, a cache, another device or attention
implementation) run SDPA as usual."""
from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar

import torch

from .models import LM

_fused = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_fused_backward = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward",
                          None)
NAME = "mist_cpu_sdpa"  # the transformers attention implementation registered here
_ACTIVE: ContextVar["Kept | None"] = ContextVar("mist_kept_attention", default=None)
# Query positions from which a backward is split: below, the copies cost about what the
# idle threads do (one layer of SmolLM2 on 2 threads: ~10% less time at 2k and 4k
# positions, within noise at 512 and 1k, 46% more at 256).
SPLIT_FROM = 1024


def keepable(lm: LM) -> bool:
    """Whether this model's passes run their attention here: SDPA attention on CPU."""
    return (lm.device.type == "cpu"
            and getattr(lm.model.config, "_attn_implementation", None) == "sdpa"
            and _fused is not None and _fused_backward is not None)


class Kept:
    """Output and log-sum-exp per layer index, recorded while `recording`, each handed out
    once to the block's rerun with a graph."""

    def __init__(self, layers: set[int]):
        self.layers = layers  # 0-based layer indices (attention modules' `layer_idx`)
        self.recording = True
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}


@contextmanager
def cpu_attention(lm: LM, keep: int = 0):
    """Within the block, a CPU model's causal attention without a mask runs here, its
    backward split evenly over the threads; with `keep`, the attention of the top `keep`
    blocks also keeps its output in the forward recorded first (until `Kept.recording` is
    set False) and hands it to the next rerun of that block under autograd. Yields the
    Kept, or None where nothing is kept; a model this does not apply to runs as it is."""
    if not keepable(lm):
        yield None
        return
    _register()
    L = lm.n_layers
    kept = Kept(set(range(L - min(keep, L), L))) if keep > 0 else None
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
        if kept is not None:
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

    causal = (attention_mask is None and is_causal in (None, True)
              and getattr(module, "is_causal", True) and dropout == 0.0
              and query.shape[2] == key.shape[2] > 1
              and query.shape[-1] == key.shape[-1] == value.shape[-1]
              and kwargs.get("position_bias") is None and kwargs.get("softcap") is None)
    if causal:
        kept = _ACTIVE.get()
        layer = getattr(module, "layer_idx", None)
        keeps = kept is not None and layer in kept.layers
        if not torch.is_grad_enabled() and keeps and kept.recording:
            out, lse = _fused(query, key, value, 0.0, True, scale=scaling)
            kept.outputs[layer] = (out, lse)
            return out.transpose(1, 2).contiguous(), None
        if torch.is_grad_enabled():
            out_lse = kept.outputs.pop(layer, None) if keeps and not kept.recording else None
            if out_lse is None or out_lse[0].shape != query.shape:
                with torch.no_grad():
                    out_lse = _fused(query, key, value, 0.0, True, scale=scaling)
            return _Attention.apply(query, key, value, *out_lse, scaling), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                  scaling=scaling, is_causal=is_causal, **kwargs)


class _Attention(torch.autograd.Function):
    """The causal attention over (query, key, value) whose output and log-sum-exp the fused
    kernel gave, with that kernel's backward (split_backward)."""

    @staticmethod
    def forward(ctx, query, key, value, out, lse, scale):
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.scale = scale
        return out.transpose(1, 2).contiguous()

    @staticmethod
    def backward(ctx, grad):
        query, key, value, out, lse = ctx.saved_tensors
        dq, dk, dv = split_backward(grad.transpose(1, 2), query, key, value, out, lse, ctx.scale)
        return dq, dk, dv, None, None, None


def _evener(units: int, threads: int) -> bool:
    """Whether twice as many pieces of half the work end sooner on `threads` threads."""
    return -(-2 * units // threads) * units < -(-units // threads) * 2 * units


def split_backward(grad, query, key, value, out, lse, scale=None, threads: int | None = None):
    """The gradients of causal attention with respect to query, key and value ([B, H, T, D],
    key and value with as many or fewer heads), given its output and log-sum-exp
    ([B, H, T]), from PyTorch's fused CPU kernel. Its threads each take whole (batch row,
    key/value head) pieces; where those do not share out evenly over `threads` (by default
    torch's) and the sequence is at least SPLIT_FROM long, the work runs as twice as many
    pieces of half the size: the causal attention of each half of the sequence (stacked as
    two batch rows) and the second half's queries against the first half's keys (two
    quarters, stacked). Each piece's gradients are its share of the whole, given the whole's
    output and log-sum-exp; a piece shorter than its pair is padded with rows whose output
    gradient is zero, which add nothing."""
    B, T = query.shape[0], query.shape[2]
    if T < SPLIT_FROM or not _evener(B * key.shape[1], threads or torch.get_num_threads()):
        return _fused_backward(grad, query, key, value, out, lse, 0.0, True, scale=scale)
    h = T // 2
    n2 = T - h  # the second half, as long as the first or one longer

    def rows(x, a, b, length):  # x[:, :, a:b], padded with zero rows to `length`
        x = x[:, :, a:b]
        return torch.nn.functional.pad(x, [0, 0] * (x.dim() - 3) + [0, length - (b - a)])

    def halves(x):
        return torch.cat([rows(x, 0, h, n2), x[:, :, h:]], 0)

    dq1, dk1, dv1 = _fused_backward(*map(halves, (grad, query, key, value, out, lse)), 0.0, True,
                                    scale=scale)
    m = n2 // 2
    m2 = n2 - m

    def quarters(x):
        return torch.cat([rows(x, h, h + m, m2), x[:, :, h + m:]], 0)

    def first_keys(x):
        return x[:, :, :h].repeat(2, *[1] * (x.dim() - 1))

    q4, g4, o4, l4 = map(quarters, (query, grad, out, lse))
    dq2, dk2, dv2 = _fused_backward(g4, q4, first_keys(key), first_keys(value), o4, l4, 0.0,
                                    False, scale=scale)
    dq = torch.cat([dq1[:B, :, :h], dq1[B:] + torch.cat([dq2[:B, :, :m], dq2[B:]], 2)], 2)
    dk = torch.cat([dk1[:B, :, :h] + dk2[:B] + dk2[B:], dk1[B:]], 2)
    dv = torch.cat([dv1[:B, :, :h] + dv2[:B] + dv2[B:], dv1[B:]], 2)
    return dq, dk, dv
