"""The paper's baseline scorers, behind the same interface as MIST (../shared/MIST.md).

Attention-based baselines read the attention rows of the positions whose logits score the
answer (answer_start-1 .. answer_stop-2): the rows through which the chain reaches the
objective."""
from __future__ import annotations

import hashlib
from contextlib import contextmanager

import numpy as np
import torch

from ..data.templates import Encoded
from ..errors import MissingDependency
from ..models import LM, check_reachable
from .passes import Plan, residual_pass
from .scorer import BackpropScorer, ScoredChain, Scorer
from .tracing import pad, run_base, span_logprobs


class UniformScorer(Scorer):
    """A uniformly random subset: random scores, seeded per example so reruns agree."""

    method = "uniform"

    def __init__(self, lm: LM, seed: int = 0, **kwargs):
        super().__init__(lm, **kwargs)
        self.seed = seed

    def _score_batch(self, batch: list[Encoded], plan=None) -> list[ScoredChain]:
        out = []
        for enc in batch:
            key = hashlib.sha256(f"{self.seed}|{enc.example.key}".encode()).digest()
            rng = np.random.default_rng(int.from_bytes(key[:8], "little"))
            out.append(ScoredChain.from_encoded(enc, self.method, rng.random(enc.chain_len)))
        return out


class PerplexityScorer(Scorer):
    """Self-information −log p(t_i | x, t_<i) of each chain token: keep the surprising ones."""

    method = "perplexity"

    @torch.no_grad()
    def _score_batch(self, batch: list[Encoded], plan=None) -> list[ScoredChain]:
        ids, mask = pad([e.source_ids for e in batch], self.lm.pad_id, self.lm.device)
        hidden = run_base(self.lm, ids, mask).last_hidden_state
        lps = span_logprobs(self.lm, hidden, [(e.chain_start, e.chain_stop) for e in batch], ids)
        return [ScoredChain.from_encoded(e, self.method, -lp.double().cpu().numpy())
                for e, lp in zip(batch, lps)]


@contextmanager
def eager_attention(lm: LM):
    """Attention probabilities exist only in the eager implementation; switch to it for
    the duration and back."""
    config = lm.model.config
    before = getattr(config, "_attn_implementation", None)
    if before != "eager":
        lm.model.set_attn_implementation("eager")
    try:
        yield
    finally:
        if before not in (None, "eager"):
            lm.model.set_attn_implementation(before)


class _AttentionScorer(Scorer):
    def _rows(self, enc: Encoded) -> tuple[int, int]:
        """The attention rows read: those whose logits score the answer."""
        return enc.answer_start - 1, enc.answer_stop - 1

    @torch.no_grad()
    def _score_batch(self, batch: list[Encoded], plan=None) -> list[ScoredChain]:
        ids, mask = pad([e.source_ids for e in batch], self.lm.pad_id, self.lm.device)
        with eager_attention(self.lm):
            attentions = run_base(self.lm, ids, mask, output_attentions=True).attentions
        if not attentions or attentions[0] is None:
            raise RuntimeError(f"{type(self.lm.model).__name__} returned no attention weights")
        out = []
        for b, enc in enumerate(batch):
            n = len(enc.source_ids)
            per_layer = [a[b, :, :n, :n].double() for a in attentions]  # [H, S, S] each
            rows = torch.arange(*self._rows(enc), device=ids.device)
            scores = self._attribute(per_layer, rows)[enc.chain_start: enc.chain_stop]
            out.append(ScoredChain.from_encoded(enc, self.method, scores.cpu().numpy()))
        return out


class H2OScorer(_AttentionScorer):
    """Attention mass each chain token receives from the answer rows, summed over layers
    and heads."""

    method = "h2o"

    def _attribute(self, per_layer, rows):
        return sum(a[:, rows].sum((0, 1)) for a in per_layer)


class CrispScorer(H2OScorer):
    """CRISP-style (arXiv 2604.17297): the attention the end-of-thinking position (the first
    token after the chain, where the model turns from reasoning to answering) pays each
    chain token, summed over layers and heads. One row, where H2O reads every answer row."""

    method = "crisp"

    def _rows(self, enc: Encoded) -> tuple[int, int]:
        return enc.chain_stop, enc.chain_stop + 1


class AttentionRolloutScorer(_AttentionScorer):
    """A^(l) = (Ã^(l) + I)·A^(l−1), A^(0) = I, Ã head-averaged; the score is the column sum
    of A^(L) over the answer rows. Computed from the top down on those rows only, which
    gives the same numbers with R×S×S work per layer instead of S³."""

    method = "attention_rollout"

    def _attribute(self, per_layer, rows):
        n = per_layer[0].shape[-1]
        eye = torch.eye(n, dtype=torch.float64, device=rows.device)
        v = eye[rows]  # [R, S]
        for a in reversed(per_layer):
            v = v @ (a.mean(0) + eye)
        return v.sum(0)


class GoGIScorer(BackpropScorer):
    """GoGI-ℓ1: ‖∇_{h_i^(l*)} log p(a|x,c)‖₁ at l* = max(L−2, 0)."""

    method = "gogi_l1"

    def need(self, batch: list[Encoded], plan: Plan) -> float:
        width = max(len(e.source_ids) for e in batch)
        return self.footprint.need(len(batch) * width, plan,
                                   logit_rows=sum(e.answer_len for e in batch),
                                   vocab=self.lm.unembedding.shape[0])

    def lowest_grad_layer(self) -> int:
        return max(self.lm.n_layers - 2, 0)  # l*

    def _score_batch(self, batch: list[Encoded], plan: Plan) -> list[ScoredChain]:
        layer = self.lowest_grad_layer()
        ids, _ = pad([e.source_ids for e in batch], self.lm.pad_id, self.lm.device)
        norms = {}

        def on_grad(l, g, h):
            norms[l] = g.abs().sum(-1)

        residual_pass(self.lm, ids, [(e.answer_start, e.answer_stop) for e in batch],
                      grad_layers=[layer], plan=plan, on_grad=on_grad)
        return [ScoredChain.from_encoded(
                    e, self.method, norms[layer][b, e.chain_start: e.chain_stop].double().cpu().numpy())
                for b, e in enumerate(batch)]


LLMLINGUA2 = "microsoft/llmlingua-2-xlm-roberta-large-meetingbank"


class LLMLingua2Scorer(Scorer):
    """TokenSkip's external scorer: LLMLingua-2's token classifier, P(keep) per classifier
    token, mapped onto the chain tokens by character overlap (mean over overlapping pieces).
    The classifier is read with transformers; `classifier` may be a hub id or a local path."""

    method = "llmlingua2"

    def __init__(self, lm: LM, classifier: str = LLMLINGUA2, **kwargs):
        super().__init__(lm, **kwargs)
        try:
            from transformers import AutoModelForTokenClassification, AutoTokenizer

            # out of reach, transformers would retry for about a minute before failing
            check_reachable(classifier)
            # a classifier's own Python never runs: the one TokenSkip uses needs none
            self.cls_tok = AutoTokenizer.from_pretrained(classifier, trust_remote_code=False)
            self.cls_model = AutoModelForTokenClassification.from_pretrained(
                classifier, trust_remote_code=False).eval()
        except (OSError, ValueError) as err:
            raise MissingDependency(
                f"the llmlingua2 scorer needs the LLMLingua-2 classifier {classifier!r} (a hub "
                f"id reachable from here, or a local copy passed as classifier=PATH): {err}") from err

    @torch.no_grad()
    def _score_batch(self, batch: list[Encoded], plan=None) -> list[ScoredChain]:
        out = []
        for enc in batch:
            cot = enc.example.cot
            c = self.cls_tok(cot, return_offsets_mapping=True, truncation=True, return_tensors="pt")
            offsets = c.pop("offset_mapping")[0].numpy()
            probs = torch.softmax(self.cls_model(**c).logits[0].float(), -1)[:, 1].numpy()
            scores = np.zeros(enc.chain_len)
            for i, (s, e) in enumerate(enc.chain_offsets):
                hit = (offsets[:, 0] < max(e, s + 1)) & (offsets[:, 1] > s) & (offsets[:, 1] > offsets[:, 0])
                scores[i] = probs[hit].mean() if hit.any() else 0.0
            out.append(ScoredChain.from_encoded(enc, self.method, scores))
        return out
