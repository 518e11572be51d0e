"""An independent, deliberately plain computation of MIST Eq. 4-8 for one example:
no batching, full logits, h^(0..L-1) from `output_hidden_states`, h^(L) and every gradient
through a zero-valued perturbation added to each block's output."""
from __future__ import annotations

import numpy as np
import torch


def _answer_ll(model, ids, start, stop, deltas=None, also=()):
    handles = []
    if deltas is not None:
        for block, delta in zip(model.model.layers, deltas):
            def hook(module, args, output, delta=delta):
                out = output[0] if isinstance(output, tuple) else output
                return out + delta
            handles.append(block.register_forward_hook(hook))
    try:
        out = model(input_ids=ids[None], output_hidden_states=True)
    finally:
        for h in handles:
            h.remove()
    logp = torch.log_softmax(out.logits[0], -1)
    ll = sum(logp[t - 1, ids[t]] for t in range(start, stop))
    return ll, sum(logp[t - 1, ids[t]] for t in also) + ll, out.hidden_states


def first_order(lm, enc, alpha=0.6, ablation="zero", layer_weights="signed", target="answer"):
    model = lm.model
    L = len(model.model.layers)
    d = model.config.hidden_size
    src = torch.tensor(enc.source_ids)
    tgt = torch.tensor(enc.target_ids)
    cs, ce = enc.chain_start, enc.chain_stop
    dtype = next(model.parameters()).dtype

    # target "facts": the chain's tokens with a digit, or an operator alone, join the objective
    facts = [cs + i for i, (a, b) in enumerate(enc.chain_offsets)
             if target == "facts" and (any(c.isdigit() for c in enc.example.cot[a:b])
                                        or enc.example.cot[a:b].strip() in set("+-*/=×÷^"))
             and enc.example.cot[a:b].strip()]
    deltas = [torch.zeros(len(src), d, dtype=dtype, requires_grad=True) for _ in range(L)]
    with torch.enable_grad():
        ll, objective, hs = _answer_ll(model, src, enc.answer_start, enc.answer_stop, deltas,
                                       facts)
        g_src = torch.autograd.grad(objective, deltas)
    # hidden_states[l] for l < L is h^(l); the last entry is post-norm, so h^(L) is recaptured.
    captured = []
    handle = model.model.layers[-1].register_forward_hook(
        lambda m, a, o: captured.append((o[0] if isinstance(o, tuple) else o).detach()))
    with torch.no_grad():
        model(input_ids=src[None])
    handle.remove()
    h = [x[0].detach() for x in hs[:L]] + [captured[0][0]]

    deltas_t = [torch.zeros(len(tgt), d, dtype=dtype, requires_grad=True) for _ in range(L)]
    with torch.enable_grad():
        ll_t, _, hs_t = _answer_ll(model, tgt, enc.target_final + 1, len(tgt), deltas_t)
        g_tgt = torch.autograd.grad(ll_t, deltas_t)
    f = enc.target_final
    h_t_f = [x[0, f].detach() for x in hs_t[1:L]]
    captured.clear()
    handle = model.model.layers[-1].register_forward_hook(
        lambda m, a, o: captured.append((o[0] if isinstance(o, tuple) else o).detach()))
    with torch.no_grad():
        model(input_ids=tgt[None])
    handle.remove()
    h_t_f.append(captured[0][0, f])

    T = ce - cs
    w = model.get_output_embeddings().weight[int(src[enc.answer_start])].detach()
    phi = np.zeros((L, T))
    psi = np.zeros((L, T))
    cbar = np.zeros(L)
    for l in range(1, L + 1):
        cbar[l - 1] = np.mean([float((h[l][t] - h[l - 1][t]) @ w) for t in range(cs, ce)])
        base = h[l][cs:ce].mean(0) if ablation == "mean" else torch.zeros_like(h[l][0])
        for i, t in enumerate(range(cs, ce)):
            phi[l - 1, i] = float(g_src[l - 1][t] @ (h[l][t] - base))
            psi[l - 1, i] = float(g_tgt[l - 1][f] @ (h[l][t] - h_t_f[l - 1]))
    def eq7(terms):  # clipped: max(c̄, 0), |c̄| where that leaves every token 0
        if layer_weights == "clipped":
            clipped = (np.maximum(cbar, 0)[:, None] * np.abs(terms)).sum(0)
            return clipped if np.any(clipped != 0) else (np.abs(cbar)[:, None] * np.abs(terms)).sum(0)
        return (cbar[:, None] * np.abs(terms)).sum(0)

    nec, suf = eq7(phi), eq7(psi)

    def z(v):
        return (v - v.mean()) / v.std()

    score = alpha * z(np.log(np.abs(nec) + 1e-12)) + (1 - alpha) * z(suf)
    return dict(necessity_per_layer=phi, sufficiency_per_layer=psi, layer_weights=cbar,
                necessity=nec, sufficiency=suf, scores=score, log_likelihood=float(ll.detach()),
                nochain_log_likelihood=float(ll_t.detach()))
