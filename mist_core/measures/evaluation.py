"""Measures of compressed chains, for the evaluation harness (pipelines/evaluation/evaluate.py).

For one chain and many compressed versions of it (methods x budgets):
- the paper's objective, Eq. 1: log p(a | x, c') where c' is exactly the kept chain tokens,
  spliced between the question and the answer line of the template;
- the greedy answer after c', decoded a few tokens at a time, and whether it is right;
- what the compression kept: intermediate results, number tokens, token types, and the
  chain's last statement of the answer.
(The corpus-level statistics are in stats.py, the per-token facts of what is kept in
retention.py: neither needs a model.)

How the passes share work: all compressed inputs of one chain start with the same
question prefix, whose keys and values are computed once and copied into each batch. The
teacher-forced pass over [x; c'; answer line; a] gives Eq. 1 and, for free, the greedy
tokens as long as they agree with the gold answer: where greedy decoding and the gold
answer part ways (or the answer ends without a stop), decoding continues from that point
on the same cache, with the gold tokens beyond it masked out, in one batch for all the
chain's compressions, each row leaving the batch when it stops. A row whose greedy answer
is the gold one thus needs a decoding step only for what it writes after the answer."""
from __future__ import annotations

import copy
import functools
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from ..data.templates import Encoded
from ..models import LM
from ..scoring.scorer import shared_prefix
from ..scoring.tracing import cache_kwarg, pad, run_base, wide
from .answers import answer_correct
from .retention import ChainProfile

NOCHAIN = None  # the `kept` of the no-chain input [x; a]


# ---------------------------------------------------------------- compressed inputs

def compressed_input(enc: Encoded, kept: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """(prompt ids, answer ids) of the input with only the kept chain tokens: the question
    prefix, the kept tokens in order, the template's answer line. kept=None gives the
    template's no-chain input, the one LL(∅) is measured on."""
    if kept is None:
        return enc.target_ids[: enc.target_final + 1], enc.target_ids[enc.target_final + 1:]
    kept = np.asarray(kept, dtype=bool)
    if kept.shape != (enc.chain_len,):
        raise ValueError(f"kept has shape {kept.shape}, the chain has {enc.chain_len} tokens")
    ids = enc.source_ids
    chain = ids[enc.chain_start: enc.chain_stop][kept]
    prompt = np.concatenate([ids[: enc.chain_start], chain, ids[enc.chain_stop: enc.answer_start]])
    return prompt, ids[enc.answer_start:]


@functools.lru_cache(maxsize=4)
def _stop_tokens(tokenizer) -> np.ndarray:
    """bool [vocab]: tokens that end an answer: end-of-text/turn specials and anything
    holding a newline."""
    n = len(tokenizer)
    stop = np.zeros(n, dtype=bool)
    for tid in range(n):
        if "\n" in tokenizer.decode([tid]):
            stop[tid] = True
    stop[[t for t in tokenizer.all_special_ids if t < n]] = True
    return stop


def stop_tokens(lm: LM) -> np.ndarray:
    stop = _stop_tokens(lm.tokenizer)
    if len(stop) < lm.unembedding.shape[0]:  # model vocab padded past the tokenizer's
        stop = np.concatenate([stop, np.ones(lm.unembedding.shape[0] - len(stop), bool)])
    return stop


@dataclass
class AnswerResult:
    log_likelihood: float  # log p(a | prompt), teacher-forced
    generated: list[int]  # greedy tokens after the prompt, stop token excluded
    text: str


def _cache_of(out):
    return getattr(out, "cache", None) or getattr(out, "past_key_values", None)


@torch.no_grad()
def answer_passes(lm: LM, inputs: Sequence[tuple[np.ndarray, np.ndarray]], prefix_len: int = 0,
                  extra_new: int = 8, max_tokens: int = 8192) -> list[AnswerResult]:
    """Eq. 1 and the greedy answer for each (prompt, answer) pair. All prompts must start
    with the same `prefix_len` tokens (run once). Greedy decoding stops at a stop token or
    after len(answer) + extra_new tokens."""
    stop = stop_tokens(lm)
    keys = [p.tobytes() + b"|" + a.tobytes() for p, a in inputs]
    unique = list(dict.fromkeys(keys))
    first = {key: inputs[keys.index(key)] for key in unique}
    k = min([prefix_len] + [len(p) - 1 for p, _ in inputs])  # each row keeps >= 1 prompt token
    cache0 = None
    if k > 0:
        head = inputs[0][0][:k]
        assert all(np.array_equal(p[:k], head) for p, _ in inputs), "prompts differ in the prefix"
        ids, mask = pad([head], lm.pad_id, lm.device)
        cache0 = _cache_of(run_base(lm, ids, mask, use_cache=True))
    # Chunks of rows of similar length (padding is wasted work: a row at most 1.5x the
    # chunk's shortest) whose padded continuation plus decoding room fits max_tokens.
    sizes = [len(first[u][0]) - k + 2 * len(first[u][1]) + extra_new for u in unique]
    order = sorted(range(len(unique)), key=lambda i: sizes[i])
    chunks, cur = [], []
    for i in order:
        if cur and (sizes[i] * (len(cur) + 1) > max_tokens or sizes[i] > 1.5 * sizes[cur[0]]):
            chunks.append(cur)
            cur = []
        cur.append(i)
    chunks += [cur] if cur else []
    states, parts = {}, []
    for chunk in chunks:
        rows = [first[unique[i]] for i in chunk]
        st, part = _teacher_forced(lm, rows, k, cache0, stop, extra_new)
        for i, state in zip(chunk, st):
            states[unique[i]] = state
        if part is not None:
            parts.append(([unique[chunk[j]] for j in part[0]],) + part[1:])
    if parts:
        _decode(lm, states, parts, stop)
    tok = lm.tokenizer
    return [AnswerResult(states[key].ll, states[key].gen,
                         tok.decode(states[key].gen, skip_special_tokens=True).strip())
            for key in keys]


@dataclass
class _State:
    """Greedy decoding of one input: tokens so far, the next one to feed and its position."""

    ll: float
    gen: list
    nxt: int
    pos: int
    cap: int
    done: bool


def _teacher_forced(lm: LM, rows, k: int, cache0, stop: np.ndarray, extra_new: int):
    """One pass over [prompt; answer] for a chunk of rows: log p(answer) and the greedy
    tokens up to where greedy leaves the gold answer. Returns the rows' states and, for the
    rows still decoding, (their indices, their keys/values per layer, their mask)."""
    dev = lm.device
    B = len(rows)
    kwargs = {"use_cache": True}
    if cache0 is not None:
        cache = copy.deepcopy(cache0)
        cache.batch_repeat_interleave(B)
        kwargs[cache_kwarg(lm)] = cache
    ids, mask = pad([np.concatenate([p[k:], a]) for p, a in rows], lm.pad_id, dev)
    W = ids.shape[1]
    full_mask = torch.cat([torch.ones(B, k, dtype=mask.dtype, device=dev), mask], 1)
    positions = (k + torch.arange(W, device=dev))[None].expand(B, -1)
    out = run_base(lm, ids, full_mask, position_ids=positions, **kwargs)
    hidden = out.last_hidden_state
    # logits where the answer is predicted, plus the position after its last token
    r_idx, c_idx = [], []
    for b, (p, a) in enumerate(rows):
        r_idx += [b] * (len(a) + 1)
        c_idx += range(len(p) - k - 1, len(p) - k + len(a))
    logits = wide(lm.lm_head(hidden[torch.tensor(r_idx, device=dev), torch.tensor(c_idx, device=dev)]))
    logp = torch.log_softmax(logits, -1)
    greedy = logits.argmax(-1).cpu().numpy()
    states, at = [], 0
    for b, (p, a) in enumerate(rows):
        n = len(a)
        ll = float(logp[at: at + n].gather(1, torch.as_tensor(a, device=dev)[:, None]).sum())
        g = greedy[at: at + n + 1]
        at += n + 1
        d = next((t for t in range(n) if g[t] != a[t]), n)  # where greedy leaves the gold answer
        gen = [int(t) for t in a[:d]]
        if not stop[g[d]]:
            gen.append(int(g[d]))
        # gold tokens past d are not on the greedy path: hidden from the decoding steps
        full_mask[b, len(p) + d:] = 0
        states.append(_State(ll, gen, int(g[d]), len(p) + d, n + extra_new,
                             bool(stop[g[d]]) or len(gen) >= n + extra_new))
    pending = [b for b, st in enumerate(states) if not st.done]
    if not pending:
        return states, None
    sel = torch.tensor(pending, device=dev)
    kv = [(layer.keys[sel], layer.values[sel]) for layer in _cache_of(out).layers]
    return states, (pending, kv, full_mask[sel])


def _decode(lm: LM, states: dict, parts: list, stop: np.ndarray) -> None:
    """Greedy decoding of every pending row of all chunks in one batch: their caches are
    laid side by side (right-padded, the padding masked), and a row leaves the batch when
    it stops, so late steps cost only the rows still going."""
    from transformers import DynamicCache

    dev = lm.device
    width = max(m.shape[1] for _, _, m in parts)
    grow = lambda t, dim: torch.nn.functional.pad(t, (0, 0) * (t.dim() - 1 - dim) + (0, width - t.shape[dim]))  # noqa: E731
    alive = [key for keys, _, _ in parts for key in keys]
    mask = torch.cat([grow(m, 1) for _, _, m in parts])
    kv = [(torch.cat([grow(p[1][l][0], 2) for p in parts]), torch.cat([grow(p[1][l][1], 2) for p in parts]))
          for l in range(len(parts[0][1]))]
    cache = DynamicCache(kv, config=lm.model.config)
    while alive:
        mask = torch.cat([mask, torch.ones(len(alive), 1, dtype=mask.dtype, device=dev)], 1)
        step = run_base(lm, torch.tensor([states[r].nxt for r in alive], device=dev)[:, None], mask,
                        position_ids=torch.tensor([states[r].pos for r in alive], device=dev)[:, None],
                        use_cache=True, **{cache_kwarg(lm): cache})
        toks = lm.lm_head(step.last_hidden_state[:, 0]).argmax(-1).cpu().numpy()
        for r, t in zip(alive, toks.tolist()):
            st = states[r]
            if stop[t]:
                st.done = True
            else:
                st.gen.append(t)
                st.nxt, st.pos = t, st.pos + 1
                st.done = len(st.gen) >= st.cap
        keep = [i for i, r in enumerate(alive) if not states[r].done]
        if keep and len(keep) < len(alive):
            sel = torch.tensor(keep, device=dev)
            cache.batch_select_indices(sel)
            mask = mask[sel]
        alive = [alive[i] for i in keep]


def positional_scores(T: int, where: str) -> np.ndarray:
    """Scores that make pruning keep the first (`head`) or last (`tail`) tokens."""
    if where == "head":
        return -np.arange(T, dtype=np.float64)
    if where == "tail":
        return np.arange(T, dtype=np.float64)
    raise ValueError(f"where must be head or tail, not {where!r}")


def evaluate_chain(lm: LM, enc: Encoded, variants: dict, style: str, extra_new: int = 8,
                   max_tokens: int = 8192) -> dict:
    """Every measure of one chain's compressed versions. `variants` maps a name to a kept
    mask (bool [T]; all True is the full chain) or NOCHAIN. Returns name -> {ll, pred,
    correct, kept counts; "types" counts in taxonomy.TYPES order} and the chain's totals
    under "_chain"."""
    names = list(variants)
    inputs = [compressed_input(enc, variants[n]) for n in names]
    answers = answer_passes(lm, inputs, prefix_len=shared_prefix(enc), extra_new=extra_new,
                            max_tokens=max_tokens)
    profile = ChainProfile.of(enc.example.cot, enc.chain_offsets, style, enc.example.answer)
    out = {"_chain": profile.totals()}
    for name, ans in zip(names, answers):
        kept = variants[name]
        out[name] = {"ll": round(ans.log_likelihood, 5), "pred": ans.text,
                     "correct": answer_correct(ans.text, enc.example.answer, style),
                     **profile.kept(kept if kept is not None else np.zeros(enc.chain_len, bool))}
    return out


# ---------------------------------------------------------------- greedy likelihood pruning

@torch.no_grad()
def answer_log_likelihoods(lm: LM, inputs: Sequence[tuple[np.ndarray, np.ndarray]],
                           batch_size: int = 32) -> np.ndarray:
    """Eq. 1 alone, log p(answer | prompt), for each (prompt, answer) pair: teacher-forced,
    no decoding, in batches of `batch_size` with right padding."""
    from ..scoring.tracing import span_logprobs

    out = []
    for i in range(0, len(inputs), batch_size):
        part = inputs[i: i + batch_size]
        seqs = [np.concatenate([p, a]) for p, a in part]
        ids, _ = pad(seqs, lm.pad_id, lm.device)
        hidden = run_base(lm, ids).last_hidden_state
        spans = [(len(p), len(p) + len(a)) for p, a in part]
        out += [float(lp.double().sum()) for lp in span_logprobs(lm, hidden, spans, ids)]
    return np.array(out)


def greedy_likelihood(lm: LM, enc: Encoded, budgets: Sequence[float], drop: int = 1,
                      batch_size: int = 32) -> dict[float, np.ndarray]:
    """Greedy likelihood pruning (arXiv 2601.03066), an expensive upper reference for the
    evaluation: from the whole chain, repeatedly drop the unit whose removal costs Eq. 1
    least, `drop` units a step, until each budget's ⌈γT⌉ is met. Units are the token unit
    of mist_core.scoring.prune (numbers whole), so a budget may end a few tokens under ⌈γT⌉.

    Args:
        lm: the model Eq. 1 is measured with.
        enc: the encoded chain.
        budgets: the retention budgets γ.
        drop: units dropped per step (1: the method as published; more: a cheaper
            approximation). Each step costs one forward pass per unit still kept.
        batch_size: inputs per forward pass.

    Returns:
        {γ: kept mask, bool [T]}.
    """
    from ..scoring.prune import budget_tokens, pruning_units

    units = pruning_units(enc.example.cot, enc.chain_offsets, "token")
    kept = np.ones(enc.chain_len, dtype=bool)
    targets = sorted({float(g): budget_tokens(g, enc.chain_len) for g in budgets}.items(),
                     key=lambda x: -x[1])
    out = {}
    for g, k in targets:
        while kept.sum() > k:
            alive = np.unique(units[kept])
            trials = [kept & (units != u) for u in alive]
            lls = answer_log_likelihoods(lm, [compressed_input(enc, t) for t in trials], batch_size)
            for u in alive[np.argsort(-lls, kind="stable")][:drop]:
                if kept.sum() <= k:
                    break
                kept &= units != u
        out[g] = kept.copy()
    return out
