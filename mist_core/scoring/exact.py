"""Exact interventions (validation mode): the definitions of necessity and sufficiency
evaluated by actually editing the residual stream, one (layer, token) at a time.

A clean pass records every block's inputs; an intervention at layer l then reruns only
blocks l+1..L, on a batch whose rows each edit a different chain token. Cost O(T·L) passes
of the upper blocks per chain: for validation, not production."""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from ..data.examples import Example
from ..data.templates import Encoded, get_template
from ..models import LM
from .tracing import pad, run_base, span_logprobs, trace


def _clean_pass(lm: LM, ids: np.ndarray):
    ids_t, mask = pad([ids], lm.pad_id, lm.device)
    with trace(lm, capture_inputs=True) as tr:
        run_base(lm, ids_t, mask)
    return ids_t, tr


@torch.no_grad()
def _rerun(lm: LM, tr, layer: int, h: torch.Tensor, ids: torch.Tensor,
           span: tuple[int, int]) -> torch.Tensor:
    """log p(answer) for each row of h, an edited h^(layer) ([B, S, d])."""
    for block, (args, kwargs) in zip(lm.blocks[layer:], tr.block_inputs[layer:]):
        out = block(h, *args, **kwargs)
        h = out[0] if isinstance(out, (tuple, list)) else out
    hidden = lm.final_norm(h)
    rows = ids.expand(h.shape[0], -1)
    return torch.stack([lp.sum() for lp in span_logprobs(lm, hidden, [span] * h.shape[0], rows)])


def exact_scores_encoded(lm: LM, enc: Encoded, epsilon: float = 1.0,
                         layers: Sequence[int] | None = None,
                         max_tokens: int = 8192) -> tuple[np.ndarray, np.ndarray]:
    """Exact necessity and sufficiency, float [len(layers), T] each.

    Necessity replaces h_i^(l) by (1-ε)·h_i^(l) (ε = 1: zeroed) and measures the drop of
    log p(a|x,c). Sufficiency replaces the no-chain run's h_f^(l) by
    h_f^(l) + ε·(h_i^(l),src − h_f^(l)) (ε = 1: patched) and measures the gain of
    log p(a|x,∅). Small ε gives the first-order terms times ε."""
    L = lm.n_layers
    layers = list(range(1, L + 1)) if layers is None else sorted(layers)
    T, cs = enc.chain_len, enc.chain_start
    src_ids, src = _clean_pass(lm, enc.source_ids)
    tgt_ids, tgt = _clean_pass(lm, enc.target_ids)
    src_span = (enc.answer_start, enc.answer_stop)
    tgt_span = (enc.target_final + 1, len(enc.target_ids))
    f = enc.target_final
    ll_src = float(_rerun(lm, src, L, src.states[L], src_ids, src_span)[0])
    ll_tgt = float(_rerun(lm, tgt, L, tgt.states[L], tgt_ids, tgt_span)[0])
    chunk = max(1, max_tokens // len(enc.source_ids))
    nec = np.zeros((len(layers), T))
    suf = np.zeros((len(layers), T))
    for row, l in enumerate(layers):
        h_src, h_tgt = src.states[l], tgt.states[l]
        for i0 in range(0, T, chunk):
            pos = torch.arange(i0, min(T, i0 + chunk), device=lm.device)
            r = torch.arange(len(pos), device=lm.device)
            h = h_src.expand(len(pos), -1, -1).clone()
            h[r, cs + pos] *= 1.0 - epsilon
            nec[row, i0: i0 + len(pos)] = (ll_src - _rerun(lm, src, l, h, src_ids, src_span)).cpu().numpy()
            h = h_tgt.expand(len(pos), -1, -1).clone()
            h[r, f] += epsilon * (h_src[0, cs + pos] - h_tgt[0, f])
            suf[row, i0: i0 + len(pos)] = (_rerun(lm, tgt, l, h, tgt_ids, tgt_span) - ll_tgt).cpu().numpy()
    return nec, suf


def exact_scores(lm: LM, ex: Example, template: str = "auto", **kwargs):
    """Exact per-layer necessity and sufficiency of one example: float [L, T] each."""
    enc = get_template(template, lm.tokenizer, lm.max_length).encode(ex)
    return exact_scores_encoded(lm, enc, **kwargs)
