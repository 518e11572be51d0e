"""The attention of a pass that backpropagates on a CPU: PyTorch's fused kernel, its
backward with the work split evenly over the threads, and outputs kept from a forward
without a graph so that a recomputed pass's rerun of a block skips its attention.

- Even threads. PyTorch's CPU flash-attention backward divides its work by batch row and
  key/value head: a grouped-query model with 3 key/value heads (SmolLM2-135M) leaves one of
  2 threads waiting while the other works on the third, much of the threads' idle time in a
  long scoring (measured in docs/results/performance.md). Here a long causal attention's
  backward runs as two calls of that kernel, each over twice the pieces: the two causal
  halves of the sequence stacked in one, the queries of the second half against the keys of
  the first (two quarters, stacked) in the other, with the full attention's output and
  log-sum-exp, so each piece's gradients are its share of the whole and they add up to them
  (`split_backward`). With one batch row, as long chains run, the pieces are views: copying
  them cost a visible share of the backward.
- Live rows. A model's last block reaches only the answer's logits, so its output gradient
  is zero at every other position; its backward runs only the answer's queries: one of the L - 1
  attention backwards of a pass, nearly free.
- Kept outputs. A recomputed backward (mist_core.scoring.passes) runs each block twice: once
  without a graph to get the states, once with one just before the block's own backward.
  On long chains attention is most of that rerun (docs/results/performance.md). Its
  backward needs only the queries, keys and values, which the rerun recomputes cheaply, and
  the output and log-sum-exp of the first forward, which is what is kept: one position's
  output is one state's worth of memory (heads × head_dim), so a pass keeps it for as many
  of the top blocks as its memory cap leaves room for (`Plan.attention_kept`).

- Grouped heads under a mask. Where a pass continues a prefix cache it needs a mask, and
  there transformers repeats a grouped-query model's keys and values to every query head
  before SDPA; here SDPA takes them as they are (its CPU kernel does, mask or not).

The numbers are those of the kernel SDPA runs (its causal case without a mask), so kept or
not the scores are bit-identical; against SDPA's own backward they differ by rounding where
a backward runs in pieces. Other calls (a mask on a model without grouped heads, a
position bias, a softcap, a single query) go to transformers' SDPA as usual."""
from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar

import torch

from ..models import LM

_fused = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_fused_backward = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward",
                          None)
NAME = "mist_cpu_sdpa"  # the transformers attention implementation registered here
_ACTIVE: ContextVar["Kept | None"] = ContextVar("mist_kept_attention", default=None)
# Query positions from which a backward is split: below, the split saves nothing or costs
# time, above it saves (one layer's backward timed from 256 to 4k positions in
# docs/results/performance.md).
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
    if (attention_mask is not None and key.shape[1] < query.shape[1] and query.shape[2] > 1
            and kwargs.get("position_bias") is None and kwargs.get("softcap") is None):
        # A mask (a prefix cache continued): transformers would repeat the keys and values
        # to every query head first, since CUDA's kernels take grouped heads only without a
        # mask; the CPU kernel takes them as they are, without the copies and their backward.
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling,
            enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None
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


# Query positions at the end of a gradient that live_rows looks at before the whole.
TAIL = 64


def live_rows(grad: torch.Tensor) -> tuple[int, int]:
    """The first query position whose output gradient is not zero, in any batch row or head,
    and one past the last ((0, 0) where there is none). NaN counts as not zero. Below a
    model's last block the gradient is live from the first position to the answer's, a few
    before the end: there the first position and the last TAIL settle it, without reading
    the whole."""
    def live(start, stop):
        return grad[:, :, start:stop].ne(0).any(-1).any(1).any(0).nonzero()

    T = grad.shape[2]
    if T > 2 * TAIL and live(0, 1).numel():
        tail = live(T - TAIL, T)
        if tail.numel():
            return 0, T - TAIL + int(tail[-1]) + 1
    rows = live(0, T)
    return (int(rows[0]), int(rows[-1]) + 1) if rows.numel() else (0, 0)


def _stack(x: torch.Tensor, start: int, step: int, count: int, length: int) -> torch.Tensor:
    """x[:, :, start + i·step : start + i·step + length] for i < count, stacked along the
    batch: a view where the batch has one row (the kernel takes any strides), else a copy."""
    if count == 1:
        return x[:, :, start:start + length]
    if x.shape[0] == 1:
        s = x.stride()
        return x.as_strided((count, x.shape[1], length, *x.shape[3:]), (step * s[2], *s[1:]),
                            x.storage_offset() + start * s[2])
    return torch.cat([x[:, :, start + i * step:start + i * step + length] for i in range(count)])


def split_backward(grad, query, key, value, out, lse, scale=None, threads: int | None = None):
    """The gradients of causal attention with respect to query, key and value ([B, H, T, D],
    key and value with as many or fewer heads), given its output and log-sum-exp
    ([B, H, T]), from PyTorch's fused CPU kernel.

    - Live rows only. Where at most half the query positions have an output gradient that
      is not zero (a model's last block, whose output reaches only the answer's logits),
      only those queries run: against their own keys causally, and against the keys before
      them as a rectangle. The other queries would add exact zeros.
    - Even threads. The kernel's threads each take whole (batch row, key/value head)
      pieces; where those do not share out evenly over `threads` (by default torch's) and
      at least SPLIT_FROM queries run, the work runs as twice as many pieces of half the
      size: the causal attention of each half (stacked as two batch rows) and the second
      half's queries against the first half's keys (two quarters, stacked). The last 0-3
      positions, which do not divide into quarters, run as a small causal block and a
      rectangle against the keys before them.

    Each piece's gradients are its share of the whole, given the whole's output and
    log-sum-exp, and they add up to the whole's. With one batch row the pieces are views."""
    B, T = query.shape[0], query.shape[2]
    lo, hi = live_rows(grad)
    if 2 * (hi - lo) > T:  # most rows live: the dead ones are not worth the extra calls
        lo, hi = 0, T
    halve = hi - lo >= SPLIT_FROM and _evener(B * key.shape[1], threads or torch.get_num_threads())
    if (lo, hi) == (0, T) and not halve:
        return _fused_backward(grad, query, key, value, out, lse, 0.0, True, scale=scale)
    grads = [torch.zeros_like(x) for x in (query, key, value)]

    def run(q0, k0, n_q, n_k, causal, count=1, q_step=0, k_step=0):
        # `count` pieces stacked as batch rows: piece i's queries q0 + i·q_step onwards
        # (n_q of them), its keys k0 + i·k_step onwards (n_k)
        g, q, o, l = (_stack(x, q0, q_step, count, n_q) for x in (grad, query, out, lse))
        k, v = (_stack(x, k0, k_step, count, n_k) for x in (key, value))
        pieces = _fused_backward(g, q, k, v, o, l, 0.0, causal, scale=scale)
        for whole, piece, (start, step, n) in zip(grads, pieces,
                                                  [(q0, q_step, n_q), (k0, k_step, n_k),
                                                   (k0, k_step, n_k)]):
            for i in range(count):
                whole[:, :, start + i * step:start + i * step + n] += piece[i * B:(i + 1) * B]

    tail = lo
    if halve:
        m = (hi - lo) // 4
        run(lo, lo, 2 * m, 2 * m, True, count=2, q_step=2 * m, k_step=2 * m)  # the halves
        run(lo + 2 * m, lo, m, 2 * m, False, count=2, q_step=m)  # the second half's quarters
        tail = lo + 4 * m
        if lo > 0:
            run(lo, 0, tail - lo, lo, False)
    if tail < hi:
        run(tail, tail, hi - tail, hi - tail, True)
        if tail > 0:
            run(tail, 0, hi - tail, tail, False)
    return tuple(grads)
