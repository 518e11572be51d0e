"""The first-order MIST scorer (Eq. 4-8 of ../shared/MIST.md) and the scorer interface."""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

import numpy as np
import torch

from .examples import Example
from .models import LM
from .templates import Encoded, get_template
from .tracing import Prefix, length_batches, span_logprobs, trace, wide

AXES = ("necessity", "sufficiency")


@dataclass
class ScoredChain:
    """Per-token scores of one chain. `scores` is what pruning ranks (keep the highest)."""

    example: Example
    method: str
    scores: np.ndarray  # [T]
    source_ids: np.ndarray
    chain_start: int
    answer_start: int
    answer_stop: int
    target_ids: np.ndarray
    target_final: int
    chain_offsets: np.ndarray  # [T, 2] character spans within example.cot
    necessity: np.ndarray | None = None  # [T] Eq. 7, before normalisation
    sufficiency: np.ndarray | None = None
    necessity_per_layer: np.ndarray | None = None  # [L, T] Eq. 4
    sufficiency_per_layer: np.ndarray | None = None  # [L, T] Eq. 5
    layer_weights: np.ndarray | None = None  # [L] Eq. 6
    layers: np.ndarray | None = None  # the block numbers l (1-based) of the per-layer rows
    log_likelihood: float | None = None  # log p(a | x, c)
    nochain_log_likelihood: float | None = None  # log p(a | x, ∅)

    @property
    def id(self) -> str:
        return self.example.key

    @property
    def chain_ids(self) -> np.ndarray:
        return self.source_ids[self.chain_start: self.chain_start + len(self.scores)]

    @classmethod
    def from_encoded(cls, enc: Encoded, method: str, scores: np.ndarray, **fields) -> "ScoredChain":
        return cls(example=enc.example, method=method, scores=np.asarray(scores, np.float64),
                   source_ids=enc.source_ids, chain_start=enc.chain_start,
                   answer_start=enc.answer_start, answer_stop=enc.answer_stop,
                   target_ids=enc.target_ids, target_final=enc.target_final,
                   chain_offsets=enc.chain_offsets, **fields)


class Scorer:
    """Scores chains in batches. Subclasses implement `_score_batch` over encoded examples;
    batching is by token budget over length-sorted examples, and results come back in
    input order."""

    method = "base"

    def __init__(self, lm: LM, template: str = "auto", max_tokens: int = 4096,
                 max_batch: int = 32):
        self.lm = lm
        self.template_name = template
        self.max_tokens = max_tokens
        self.max_batch = max_batch

    @cached_property
    def template(self):
        # built on first use: a scorer fed pre-encoded inputs needs no tokenizer
        return get_template(self.template_name, self.lm.tokenizer, self.lm.max_length)

    def encode(self, ex: Example) -> Encoded:
        """Tokenise one example; raises InvalidExample for what cannot be scored."""
        return self.template.encode(ex)

    def score(self, examples: Sequence[Example]) -> list[ScoredChain]:
        return self.score_encoded([self.encode(ex) for ex in examples])

    def score_encoded(self, encoded: Sequence[Encoded]) -> list[ScoredChain]:
        out: list[ScoredChain | None] = [None] * len(encoded)
        lengths = [self.batch_length(e) for e in encoded]
        for idx in length_batches(lengths, self.max_tokens, self.max_batch):
            for i, res in zip(idx, self._score_batch([encoded[i] for i in idx])):
                out[i] = res
        return out  # type: ignore[return-value]

    def batch_length(self, enc: Encoded) -> int:
        """The length batches are formed by: what the scorer's passes actually run over."""
        return len(enc.source_ids)

    def _score_batch(self, batch: list[Encoded]) -> list[ScoredChain]:
        raise NotImplementedError


def shared_prefix(enc: Encoded) -> int:
    """Leading tokens both passes can share: the common prefix, ending before the chain and
    before the no-chain final position (which needs its own gradient)."""
    return max(0, min(enc.prefix_len, enc.chain_start, enc.target_final))


def zscore(v: np.ndarray) -> np.ndarray:
    sd = v.std()
    if not np.isfinite(sd) or sd < 1e-12 * max(1.0, float(np.abs(v).max())):
        return np.zeros_like(v)
    return (v - v.mean()) / sd


def combine(necessity: np.ndarray | None, sufficiency: np.ndarray | None,
            alpha: float) -> np.ndarray:
    """Eq. 8 with the per-chain normalisation: necessity z-scored in log space,
    sufficiency with a plain z-score. With one axis, that axis alone."""
    nec = zscore(np.log(np.abs(necessity) + 1e-12)) if necessity is not None else None
    suf = zscore(sufficiency) if sufficiency is not None else None
    if nec is None:
        return suf
    if suf is None:
        return nec
    return alpha * nec + (1.0 - alpha) * suf


class MistScorer(Scorer):
    """First-order MIST: one source pass and one no-chain pass per batch, each a forward
    and a backward to the residual stream (no parameter gradients).

    axes: ("necessity", "sufficiency") or one of them; layers: block numbers 1..L to
    aggregate over (default all)."""

    method = "mist"

    def __init__(self, lm: LM, alpha: float = 0.6, axes: Sequence[str] = AXES,
                 layers: Sequence[int] | None = None, **kwargs):
        super().__init__(lm, **kwargs)
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha must lie in [0, 1], not {alpha}")
        bad = set(axes) - set(AXES)
        if bad or not axes:
            raise ValueError(f"axes must be a non-empty subset of {AXES}, not {tuple(axes)}")
        self.alpha = alpha
        self.axes = tuple(a for a in AXES if a in axes)
        L = lm.n_layers
        self.layers = sorted(set(layers)) if layers is not None else list(range(1, L + 1))
        if not self.layers or self.layers[0] < 1 or self.layers[-1] > L:
            raise ValueError(f"layers must be block numbers in 1..{L}, not {layers}")
        if self.axes != AXES:
            self.method = self.axes[0]

    def batch_length(self, enc: Encoded) -> int:
        return len(enc.source_ids) - shared_prefix(enc)

    def _pass(self, prefix: Prefix, seqs: list[np.ndarray], spans: list[tuple[int, int]],
              grad: bool, keep: bool = False):
        """Continue the prefix with `seqs`; log p of each span and, with `grad`, its gradient
        with respect to h^(l) of the selected layers. Returns (states, grads, log-likelihoods)."""
        with trace(self.lm, grad=grad) as tr:
            ids, out = prefix.continue_with(self.lm, seqs, keep=keep)
            lps = span_logprobs(self.lm, out.last_hidden_state, spans, ids)
            grads = None
            if grad:
                grads = torch.autograd.grad(torch.stack([lp.sum() for lp in lps]).sum(),
                                            [tr.states[l] for l in self.layers])
        return [s.detach() for s in tr.states], grads, [float(lp.detach().sum()) for lp in lps]

    def _source_pass(self, batch: list[Encoded], prefix: Prefix):
        """h^(l) at the continuation's positions and ∇_{h^(l)} log p(a|x,c), selected layers."""
        k = prefix.lengths
        return self._pass(prefix, [e.source_ids[n:] for e, n in zip(batch, k)],
                          [(e.answer_start - n, e.answer_stop - n) for e, n in zip(batch, k)],
                          grad="necessity" in self.axes, keep="sufficiency" in self.axes)

    def _target_pass(self, batch: list[Encoded], prefix: Prefix):
        """∇ log p(a|x,∅) and h at the no-chain final position f, for the selected layers."""
        k = prefix.lengths
        states, grads, lls = self._pass(
            prefix, [e.target_ids[n:] for e, n in zip(batch, k)],
            [(e.target_final + 1 - n, len(e.target_ids) - n) for e, n in zip(batch, k)], grad=True)
        rows = torch.arange(len(batch), device=self.lm.device)
        final = torch.tensor([e.target_final - n for e, n in zip(batch, k)], device=self.lm.device)
        g_f = torch.stack([g[rows, final] for g in grads], 1)  # [B, Lsel, d]
        h_f = torch.stack([states[l][rows, final] for l in self.layers], 1)
        return g_f, h_f, lls

    def _score_batch(self, batch: list[Encoded]) -> list[ScoredChain]:
        # The question prefix is the same in both inputs and, under causal attention, nothing
        # after it changes it: its keys and values are computed once, without gradients.
        prefix = Prefix.run(self.lm, [e.source_ids[:shared_prefix(e)] for e in batch])
        states, grads, ll_src = self._source_pass(batch, prefix)
        if "sufficiency" in self.axes:
            g_f, h_f, ll_tgt = self._target_pass(batch, prefix)
        sel = torch.tensor(self.layers, device=self.lm.device)
        out = []
        for b, enc in enumerate(batch):
            cs = enc.chain_start - prefix.lengths[b]
            ce = cs + enc.chain_len
            H = wide(torch.stack([s[b, cs:ce] for s in states]))  # [L+1, T, d], h^(0..L)
            w_u = wide(self.lm.unembedding[int(enc.source_ids[enc.answer_start])])
            proj = H @ w_u  # [L+1, T]
            cbar = (proj[1:] - proj[:-1]).mean(1)[sel - 1]  # Eq. 6, [Lsel]
            H_sel = H[sel]
            fields = {"layer_weights": cbar, "layers": np.asarray(self.layers),
                      "log_likelihood": ll_src[b]}
            if "necessity" in self.axes:
                G = wide(torch.stack([g[b, cs:ce] for g in grads]))
                phi = (G * H_sel).sum(-1)  # Eq. 4, [Lsel, T]
                fields.update(necessity_per_layer=phi,
                              necessity=(cbar[:, None] * phi.abs()).sum(0))  # Eq. 7
            if "sufficiency" in self.axes:
                g, h = wide(g_f[b]), wide(h_f[b])  # [Lsel, d]
                psi = torch.einsum("ltd,ld->lt", H_sel, g) - (g * h).sum(-1)[:, None]  # Eq. 5
                fields.update(sufficiency_per_layer=psi,
                              sufficiency=(cbar[:, None] * psi.abs()).sum(0),  # Eq. 7
                              nochain_log_likelihood=ll_tgt[b])
            fields = {k: v.detach().cpu().double().numpy() if torch.is_tensor(v) else v
                      for k, v in fields.items()}
            scores = combine(fields.get("necessity"), fields.get("sufficiency"), self.alpha)
            out.append(ScoredChain.from_encoded(enc, self.method, scores, **fields))
        return out
