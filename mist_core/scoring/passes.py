"""A forward pass and a backward pass to the residual stream, in two memory regimes.

- stored: one forward that keeps autograd's graph, then one backward. The fastest; its
  memory is every block's saved activations, O(L · T · a block's activations per token).
- recomputed: a forward without a graph that keeps only h^(0..L), then a backward block by
  block from the top, each block rerun with a graph just before its own backward. One more
  forward of work; memory O(L · T · d) for the states plus one block's activations. Where
  that is still too much, the MLP runs `MLP_POSITIONS` positions at a time, its pieces
  checkpointed (the MLP is position-wise, and its intermediate width is most of a block's
  activations), and then only every k-th state is kept through the backward. Where the
  memory cap leaves room, the forward also keeps the attention output of the top blocks,
  whose reruns then skip attention (mist_core.scoring.attention). Nothing reads a rerun's output,
  only its backward, so in the models of UNREAD_DOWN_PROJ the rerun does not compute the
  MLP's last projection (unread_down_proj).

On a CPU both run their causal attention through mist_core.scoring.attention, whose backward
keeps every thread busy; on any device both run transformers' RMSNorms with their derivative in
closed form (mist_core.scoring.norms), a few passes over the states where autograd's takes a
dozen, and the gated MLPs' product keeping two of the three tensors autograd would
(mist_core.scoring.swiglu).
On a CPU a stored pass leaves what it frees in the process for the next one
(allocator.keep_freed), where a recomputed pass gives it back first (freed_to_the_system).

Both give the same numbers. Callers see the states and the gradients through callbacks, layer
by layer, so that neither the gradients of all layers nor anything beyond the pass itself is
ever held at once."""
from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch.utils.checkpoint import checkpoint

from . import allocator, attention
from ..models import LM
from .norms import fused_norms
from .swiglu import fused_swiglu
from .tracing import _hidden, run_base, span_logprobs, token_logprobs, trace, wrapped_forwards

# on_state(l, h): h = h^(l) [B, S, d], detached, called for l = 0..L as the forward reaches it.
# on_grad(l, g, h): g = ∇_{h^(l)} Σ_rows log p(span), h = h^(l), for each l in grad_layers.
OnState = Callable[[int, torch.Tensor], None]
OnGrad = Callable[[int, torch.Tensor, torch.Tensor], None]


@dataclass(frozen=True)
class Plan:
    """How a pass runs: with stored activations, or recomputing each block in the backward
    (`recompute`), then also with the MLP in pieces (`mlp_pieces`), then also keeping only
    every k-th h^(l) (`keep_every`). Each step takes less memory and more time. A
    recomputed pass may keep the attention output of its top `attention_kept` blocks from
    the forward without a graph, for one state's memory per block and position, so that
    their reruns skip attention (mist_core.scoring.attention)."""

    recompute: bool = False
    mlp_pieces: bool = False
    keep_every: int = 1
    attention_kept: int = 0


class PrefixKV:
    """What a block's attention reads of a prefix cache when the block is rerun: the prefix
    keys and values of its layer joined to the new ones. Nothing is stored, so a block can be
    rerun any number of times (a transformers cache appends at every call)."""

    def __init__(self, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]):
        self.keys, self.values = keys, values

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return (torch.cat([self.keys[layer_idx], key_states], -2),
                torch.cat([self.values[layer_idx], value_states], -2))


def residual_pass(lm: LM, ids: torch.Tensor, spans: list[tuple[int, int]], *,
                  grad_layers: Sequence[int] = (), plan: Plan = Plan(),
                  on_state: OnState | None = None, on_grad: OnGrad | None = None,
                  prefix_kv: PrefixKV | None = None,
                  also: Sequence[Sequence[int]] | None = None,
                  on_also_grad: OnGrad | None = None, **base_kwargs) -> list[float]:
    """Run the decoder on `ids` (extra arguments go to the base model: attention_mask,
    position_ids, a prefix cache), score log p(ids[b, span_b]) and backpropagate it to the
    residual stream of `grad_layers` (block numbers 1..L). Returns each row's log p.
    `also`: per row, more positions t whose log p(ids[b, t] | ids[b, :t]) joins what is
    backpropagated, not what is returned. With `on_also_grad` too, both are backpropagated
    through the one forward: on_grad gets the spans' gradient alone, on_also_grad that of
    the spans and `also` (one more backward, no more forward).

    `plan` (with `recompute`): `mlp_pieces` runs each block's MLP `MLP_POSITIONS` positions
    at a time, each piece checkpointed (chunked_mlp): one more MLP forward per block in the
    backward, for a block's activations without most of the MLP's. `keep_every` keeps
    h^(l) through the backward only for every k-th l (and L); the states between two kept
    ones are computed again, without a graph, when the backward reaches them. With k ≈ √L
    the states take O(√L · T · d) instead of O(L · T · d), for one more forward without a
    graph. `attention_kept` blocks from the top skip attention in their rerun.
    `prefix_kv`: the prefix's keys/values, needed with `recompute` when a cache is passed."""
    grad_layers = sorted(set(grad_layers))
    if plan.recompute and grad_layers:
        return _recomputed(lm, ids, spans, grad_layers, on_state, on_grad, prefix_kv, base_kwargs,
                           plan, also, on_also_grad)
    if grad_layers:  # the saved activations' pages, mapped once, serve the next pass too
        allocator.keep_freed(lm.device)
    with trace(lm, grad=bool(grad_layers), on_state=on_state) as tr, \
            attention.cpu_attention(lm) if grad_layers else nullcontext(), \
            fused_norms(lm) if grad_layers else nullcontext(), \
            fused_swiglu(lm) if grad_layers else nullcontext():
        out = run_base(lm, ids, **base_kwargs)
        lps = span_logprobs(lm, out.last_hidden_state, spans, ids)
        objectives = (_objectives(lm, out.last_hidden_state, lps, ids, also, on_grad,
                                  on_also_grad) if grad_layers else [])
        del out
        if grad_layers:
            current = [None]  # the callback of the objective being backpropagated
            handles = [tr.states[l].register_hook(_grad_hook(current, l, tr.states[l].detach()))
                       for l in grad_layers]
            try:
                for i, (objective, callback) in enumerate(objectives):
                    current[0] = callback
                    torch.autograd.grad(objective, [tr.states[grad_layers[0]]],
                                        retain_graph=i < len(objectives) - 1)
            finally:
                for h in handles:
                    h.remove()
    return [float(lp.detach().sum()) for lp in lps]


def _grad_hook(current: list, layer: int, h: torch.Tensor):
    def hook(g):
        if current[0]:
            current[0](layer, g, h)
    return hook


def _objectives(lm: LM, hidden: torch.Tensor, lps: list[torch.Tensor], ids: torch.Tensor,
                also: Sequence[Sequence[int]] | None, on_grad: OnGrad | None,
                on_also_grad: OnGrad | None) -> list[tuple[torch.Tensor, OnGrad | None]]:
    """What the backward differentiates, each with the callback its gradients go to: the
    spans' log p and `also`'s positions' (to on_grad), or with on_also_grad the spans' alone
    (to on_grad) and both (to on_also_grad)."""
    spans = torch.stack([lp.sum() for lp in lps]).sum()
    pairs = [(b, t) for b, ts in enumerate(also or ()) for t in ts if t >= 1]
    total = spans
    if pairs:
        rows, pos = zip(*pairs)
        total = spans + token_logprobs(lm, hidden, rows, pos, ids).sum()
    if on_also_grad is None:
        return [(total, on_grad)]
    return [(spans, on_grad), (total, on_also_grad)]


# Token positions a recomputed pass runs through a block's MLP at a time.
MLP_POSITIONS = 1024


@contextmanager
def chunked_mlp(lm: LM, positions: int | None = None, enabled: bool = True):
    """Within the block, each decoder block's MLP runs `positions` token positions at a time
    and, under autograd, checkpoints each piece: the piece's activations are recomputed in
    the backward instead of held. The MLP is position-wise (a dense MLP, or a mixture of
    experts routed per token), so the numbers are the same; a model whose blocks have no
    `mlp` is run as it is."""
    positions = positions or MLP_POSITIONS
    mlps = [getattr(b, "mlp", None) for b in lm.blocks]
    if not enabled or any(not isinstance(m, torch.nn.Module) for m in mlps):
        yield
        return

    def pieces(mlp, forward):
        def run(x, *args, **kwargs):
            step = max(1, positions // x.shape[0])
            if x.dim() != 3 or x.shape[1] <= step:
                return forward(x, *args, **kwargs)
            keep = torch.is_grad_enabled() and x.requires_grad
            outs = [checkpoint(forward, x[:, s:s + step], *args, use_reentrant=False, **kwargs)
                    if keep else forward(x[:, s:s + step], *args, **kwargs)
                    for s in range(0, x.shape[1], step)]
            if not all(isinstance(o, torch.Tensor) for o in outs):  # e.g. (states, router logits)
                return forward(x, *args, **kwargs)
            return torch.cat(outs, 1)
        return run

    with wrapped_forwards(mlps, pieces):
        yield


# Models whose decoder block adds its MLP's output, which is the MLP's last projection's,
# straight to the residual stream (transformers' modeling code, checked for each).
UNREAD_DOWN_PROJ = frozenset({"llama", "mistral", "qwen2", "qwen3"})


class _BackwardOnly(torch.autograd.Function):
    """A linear map whose output nobody reads, only its backward: the input's gradient."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(weight)
        return x.new_zeros(()).expand(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        (weight,) = ctx.saved_tensors
        return grad @ weight, None


@contextmanager
def unread_down_proj(lm: LM):
    """Within the block, under autograd, the blocks' last MLP projection is not computed,
    only its backward runs. A recomputed pass reruns a block only for its backward: nothing
    reads the rerun's output, and in these models (UNREAD_DOWN_PROJ) that projection feeds
    the output alone, through a sum whose backward needs no values. About a quarter of a
    block's projections (SmolLM2: 0.9 of 3.5 M multiply-adds a token). Without autograd
    (the first forward, the states between kept ones) it runs as it is."""
    downs = [getattr(getattr(b, "mlp", None), "down_proj", None) for b in lm.blocks]
    if (getattr(lm.model.config, "model_type", None) not in UNREAD_DOWN_PROJ
            or not all(isinstance(d, torch.nn.Linear) for d in downs)):
        yield
        return

    def unread(down, forward):
        def run(x):
            if torch.is_grad_enabled() and x.requires_grad:
                return _BackwardOnly.apply(x, down.weight)
            return forward(x)
        return run

    with wrapped_forwards(downs, unread):
        yield


def _recomputed(lm, ids, spans, grad_layers, on_state, on_grad, prefix_kv, base_kwargs,
                plan, also=None, on_also_grad=None):
    # fused_swiglu first: chunked_mlp's pieces then run its forward
    with fused_swiglu(lm), chunked_mlp(lm, enabled=plan.mlp_pieces), \
            allocator.freed_to_the_system(lm.device), unread_down_proj(lm), fused_norms(lm), \
            attention.cpu_attention(lm, min(plan.attention_kept, lm.n_layers - grad_layers[0])) \
            as kept:
        return _recomputed_pass(lm, ids, spans, grad_layers, on_state, on_grad, prefix_kv,
                                base_kwargs, max(1, plan.keep_every), kept, also, on_also_grad)


def _recomputed_pass(lm, ids, spans, grad_layers, on_state, on_grad, prefix_kv, base_kwargs,
                     keep_every, kept, also=None, on_also_grad=None):
    L = lm.n_layers
    with trace(lm, capture_inputs=True, on_state=on_state,
               keep=lambda l: l % keep_every == 0 or l == L) as tr, torch.no_grad():
        run_base(lm, ids, **base_kwargs)
    states = tr.states
    if kept is not None:
        kept.recording = False

    def rerun(l: int, h_in: torch.Tensor) -> torch.Tensor:  # block l: h^(l-1) -> h^(l)
        args, kwargs = tr.block_inputs[l - 1]
        if prefix_kv is None and any(_is_cache(v) for v in kwargs.values()):
            raise ValueError("rerunning a block over a prefix cache needs prefix_kv")
        kwargs = {k: (prefix_kv if _is_cache(v) else v) for k, v in kwargs.items()}
        return _hidden(lm.blocks[l - 1](h_in, *args, **kwargs))

    with torch.enable_grad():
        top = states[L].detach().requires_grad_(True)
        hidden = lm.final_norm(top)
        lps = span_logprobs(lm, hidden, spans, ids)
        objectives = _objectives(lm, hidden, lps, ids, also, on_grad, on_also_grad)
        callbacks = [callback for _, callback in objectives]
        gs = _grads([o for o, _ in objectives], top)
    del top, objectives
    _report(callbacks, L, gs, states, grad_layers)
    for l in range(L, grad_layers[0], -1):
        if states[l - 1] is None:  # a segment between kept states: its states again, no graph
            lo = max(j for j in range(l - 1) if states[j] is not None)
            with torch.no_grad():
                for j in range(lo + 1, l):
                    states[j] = rerun(j, states[j - 1])
        with torch.enable_grad():
            h_in = states[l - 1].detach().requires_grad_(True)
            out = rerun(l, h_in)
            gs = _grads([out] * len(gs), h_in, gs)
        del out, h_in
        states[l] = None  # no longer needed: frees its memory as the backward descends
        _report(callbacks, l - 1, gs, states, grad_layers)
    return [float(lp.detach().sum()) for lp in lps]


def _grads(outputs: list[torch.Tensor], x: torch.Tensor,
           cotangents: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """∂outputs[i]/∂x (with cotangents[i]) for each i, through one graph: kept for all but
    the last."""
    n = len(outputs)
    return [torch.autograd.grad(o, [x], None if cotangents is None else cotangents[i],
                                retain_graph=i < n - 1)[0] for i, o in enumerate(outputs)]


def _report(callbacks, layer: int, gs: list[torch.Tensor], states, grad_layers) -> None:
    if layer in grad_layers:
        for callback, g in zip(callbacks, gs):
            if callback:
                callback(layer, g, states[layer])


def _is_cache(v) -> bool:
    return hasattr(v, "update") and hasattr(v, "get_seq_length")
