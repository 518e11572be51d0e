"""The first-order MIST scorer (Eq. 4-8 of ../shared/MIST.md) and the scorer interface."""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property
from typing import Sequence

import numpy as np
import torch

from . import allocator, attention, memory
from ..data.examples import Example
from ..data.templates import Encoded, get_template
from ..errors import InvalidExample, NonFiniteScores
from ..models import LM
from .choices import ABLATIONS, ALPHA, LAYER_WEIGHTS, TARGETS
from .passes import Plan, PrefixKV, residual_pass
from .prune import fact_tokens
from .tracing import Prefix, batch_overhead, length_batches, pad, wide

AXES = ("necessity", "sufficiency")


@dataclass
class ScoredChain:
    """Per-token scores of one chain. `scores` is what pruning ranks (keep the highest).

    Attributes:
        example: the Example scored.
        method: the scorer's method name (`mist`, `necessity`, `h2o`, ...).
        scores: [T] one score per chain token, higher is more important.
        source_ids: the full input's token ids, [x; c; a].
        chain_start: where the chain's T tokens start in source_ids.
        answer_start, answer_stop: the answer's tokens in source_ids.
        target_ids: the no-chain input's token ids, [x; a].
        target_final: the position in target_ids before the answer's first token.
        chain_offsets: [T, 2] each chain token's character span in example.cot.
        necessity, sufficiency: (MIST) [T] Eq. 7's axes, before normalisation.
        facts_necessity: (MIST, target "both") [T] necessity with the facts' target.
        necessity_per_layer, sufficiency_per_layer: (MIST) [L, T] Eq. 4 and Eq. 5.
        layer_weights: (MIST) [L] Eq. 6's c̄ of the layers aggregated over.
        layers: (MIST) the block numbers (1-based) of the per-layer rows.
        log_likelihood: log p(a | x, c).
        nochain_log_likelihood: log p(a | x, ∅) (MIST's sufficiency axis).

    Examples:
        >>> from mist_core import Example, MistScorer, wrap_model
        >>> from mist_core.distill.synthetic import build_tokenizer, tiny_llama, vocabulary_texts
        >>> tokenizer = build_tokenizer(vocabulary_texts())  # word-level, no download
        >>> lm = wrap_model(tiny_llama(tokenizer, layers=2, hidden=32), tokenizer, "tiny")
        >>> ex = Example("Ann has 3 apples. She buys 4 more apples. How many apples does Ann "
        ...              "have?", "She buys 4 more, so 3 + 4 = 7.", "7", id="ann")
        >>> [chain] = MistScorer(lm, layers=[2]).score([ex])
        >>> chain.id, chain.method, chain.scores.shape, chain.necessity_per_layer.shape
        ('ann', 'mist', (12,), (1, 12))
        >>> tokenizer.decode(chain.chain_ids), chain.chain_offsets[:2].tolist()
        ('She buys 4 more, so 3 + 4 = 7.', [[0, 3], [3, 8]])
    """

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
    facts_necessity: np.ndarray | None = None  # [T] necessity of the answer and the facts
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
    """Scores chains in batches. Subclasses implement `_score_batch` over encoded examples
    (an InvalidExample in the place of a chain that fails alone, e.g. NonFiniteScores);
    batching is by token budget over length-sorted examples, and results come back in
    input order. A chain whose scores hold NaN or inf fails as NonFiniteScores, whatever
    the scorer. get_scorer makes one by name.

    Within max_memory a scorer that backpropagates picks its batches and, where a batch
    would not fit otherwise, recomputes each block in the backward instead of storing its
    activations (then also runs the MLP in pieces, then also keeps only every k-th h^(l):
    `Plan`), and keeps the attention outputs of as many blocks as the rest of the cap
    holds. A batch that runs out of memory all the same is split in two and retried; a
    chain that cannot fit alone fails with InvalidExample (reason `too_long_for_memory`).
    On a CPU with glibc, what a stored pass frees stays in the process for the next pass
    (allocator.keep_freed), given back before a recomputed pass, when the process has grown
    more than max_memory beyond the model, or by allocator.release.

    Args:
        lm: the model (load_model, wrap_model).
        template: the prompt template's name (get_template); "auto" by default.
        max_tokens: padded token positions per forward pass; "auto": as many as max_memory
            holds with stored activations (4096 without a cap).
        max_batch: chains per forward pass at most.
        max_memory: the most bytes the scorer's passes may take beyond the loaded model: a
            number, a size such as "6GB", None for no cap, or "auto" (the default): 90% of
            a GPU's free memory once the model is loaded, 60% of the memory a CPU machine
            has available.

    Examples:
        >>> from mist_core import Example, MistScorer, wrap_model
        >>> from mist_core.distill.synthetic import build_tokenizer, tiny_llama, vocabulary_texts
        >>> tokenizer = build_tokenizer(vocabulary_texts())  # word-level, no download
        >>> lm = wrap_model(tiny_llama(tokenizer, layers=2, hidden=32), tokenizer, "tiny")
        >>> ex = Example("Ann has 3 apples. She buys 4 more apples. How many apples does Ann "
        ...              "have?", "She buys 4 more, so 3 + 4 = 7.", "7", id="ann")
        >>> from mist_core import Scorer, get_scorer
        >>> scorer = get_scorer("uniform", lm, seed=0)
        >>> isinstance(scorer, Scorer), scorer.method
        (True, 'uniform')
        >>> [len(chain.scores) for chain in scorer.score([ex, ex])]
        [12, 12]
    """

    method = "base"

    def __init__(self, lm: LM, template: str = "auto", max_tokens: int | str = 4096,
                 max_batch: int = 32, max_memory: int | str | None = "auto"):
        self.lm = lm
        self.template_name = template
        self.max_tokens = max_tokens
        self.max_batch = max_batch
        self.max_memory = memory.auto_cap(lm.device) if max_memory == "auto" else \
            memory.parse_bytes(max_memory)
        # what max_memory is beyond: the process with the model loaded and nothing kept
        allocator.trim(lm.device)
        self._resident = allocator.resident()

    @cached_property
    def template(self):
        # built on first use: a scorer fed pre-encoded inputs needs no tokenizer
        return get_template(self.template_name, self.lm.tokenizer, self.lm.max_length)

    def encode(self, ex: Example) -> Encoded:
        """Tokenise one example in the scorer's template (Template.encode).

        Args:
            ex: the example.

        Returns:
            The Encoded example, for score_encoded.

        Raises:
            InvalidExample: what cannot be scored (`too_long` beyond the model's context,
                `cot_no_tokens`, ...).
        """
        return self.template.encode(ex)

    def score(self, examples: Sequence[Example]) -> list[ScoredChain]:
        """Score examples: one ScoredChain each, in input order.

        Args:
            examples: the examples; batched by length within max_tokens and max_memory.

        Returns:
            A ScoredChain per example; prune() turns one into compressed chains.

        Raises:
            InvalidExample: the first example that cannot be encoded or scored (see
                score_encoded with errors="return" to keep the others).

        Examples:
            >>> from mist_core import Example, MistScorer, wrap_model
            >>> from mist_core.distill.synthetic import (build_tokenizer, tiny_llama,
            ...                                          vocabulary_texts)
            >>> tokenizer = build_tokenizer(vocabulary_texts())  # word-level, no download
            >>> lm = wrap_model(tiny_llama(tokenizer, layers=2, hidden=32), tokenizer, "tiny")
            >>> ex = Example("Ann has 3 apples. She buys 4 more apples. How many apples does Ann "
            ...              "have?", "She buys 4 more, so 3 + 4 = 7.", "7", id="ann")
            >>> chains = MistScorer(lm).score([ex])
            >>> [(c.id, c.method, len(c.scores)) for c in chains]
            [('ann', 'mist', 12)]
        """
        return self.score_encoded([self.encode(ex) for ex in examples])

    def score_encoded(self, encoded: Sequence[Encoded],
                      errors: str = "raise") -> list[ScoredChain | InvalidExample]:
        """Score encoded examples (encode, or a template's encode), in input order.

        Args:
            encoded: the encoded examples.
            errors: "raise" (the default) raises the first chain's failure; "return" puts
                the InvalidExample in the place of a chain that cannot be scored within
                max_memory (`too_long_for_memory`), or whose scores came out NaN or inf
                (NonFiniteScores, `nonfinite_scores`), and scores the others.

        Returns:
            A ScoredChain, or with errors="return" an InvalidExample, per encoded example.

        Raises:
            InvalidExample: with errors="raise", a chain that cannot be scored.

        Examples:
            >>> from mist_core import Example, MistScorer, wrap_model
            >>> from mist_core.distill.synthetic import (build_tokenizer, tiny_llama,
            ...                                          vocabulary_texts)
            >>> tokenizer = build_tokenizer(vocabulary_texts())  # word-level, no download
            >>> lm = wrap_model(tiny_llama(tokenizer, layers=2, hidden=32), tokenizer, "tiny")
            >>> ex = Example("Ann has 3 apples. She buys 4 more apples. How many apples does Ann "
            ...              "have?", "She buys 4 more, so 3 + 4 = 7.", "7", id="ann")
            >>> scorer = MistScorer(lm, max_memory=1000)  # bytes: too little for any chain
            >>> [result] = scorer.score_encoded([scorer.encode(ex)], errors="return")
            >>> result.reason, result.example_id
            ('too_long_for_memory', 'ann')
        """
        out: list = [None] * len(encoded)
        for idx in self.forward_batches(encoded):
            self._score_fitting(idx, encoded, out)
        for i, res in enumerate(out):  # every scorer: garbage never passes as scores
            if isinstance(res, ScoredChain) and not np.isfinite(res.scores).all():
                out[i] = NonFiniteScores(f"{res.method} scores are NaN or inf at "
                                         f"{int((~np.isfinite(res.scores)).sum())} of "
                                         f"{len(res.scores)} chain tokens", res.example.id)
        if errors == "raise":
            for res in out:
                if isinstance(res, InvalidExample):
                    raise res
        return out

    def _score_fitting(self, idx: list[int], encoded: Sequence[Encoded], out: list) -> None:
        batch = [encoded[i] for i in idx]
        plan = self.plan(batch)
        if plan is not None:
            try:
                results = self._score_batch(batch, plan)
            except Exception as e:
                if not memory.is_out_of_memory(e):
                    raise
                allocator.release(self.lm.device)
                if len(idx) == 1:
                    out[idx[0]] = self._too_long(batch[0], "ran out of memory even alone",
                                                 f": {str(e).splitlines()[0]}")
                    return
                plan = None
            else:
                for i, res in zip(idx, results):
                    out[i] = res
                self._resident = allocator.hold_at_most(self.lm.device, self.max_memory,
                                                     self._resident)
                return
        if len(idx) == 1:
            need = memory.gib(self.need(batch, self.plans()[-1]))
            out[idx[0]] = self._too_long(batch[0], f"need about {need} even alone")
            return
        half = len(idx) // 2
        self._score_fitting(idx[:half], encoded, out)
        self._score_fitting(idx[half:], encoded, out)

    def forward_batches(self, encoded: Sequence[Encoded]) -> list[list[int]]:
        """The batches score_encoded runs, as lists of indices into `encoded`: by kind, then
        by length within the token budget (a batch that does not fit is split further)."""
        groups: dict = {}
        for i, e in enumerate(encoded):
            groups.setdefault(self.batch_kind(e), []).append(i)
        out = []
        for members in groups.values():
            lengths = [self.batch_length(encoded[i]) for i in members]
            out += [[members[j] for j in idx]
                    for idx in length_batches(lengths, self.token_budget(), self.max_batch,
                                              batch_overhead(self.lm.device))]
        return out

    def _too_long(self, enc: Encoded, why: str, after: str = "") -> InvalidExample:
        cap = f", over max_memory {memory.gib(self.max_memory)}" if self.max_memory else ""
        return InvalidExample("too_long_for_memory",
                              f"{self.batch_length(enc)} tokens {why}{cap}{after}", enc.example.id)

    def token_budget(self) -> int:
        return 4096 if self.max_tokens == "auto" else int(self.max_tokens)

    def plan(self, batch: list[Encoded]):
        """How to run this batch within max_memory, or None to split it (or, alone, to give
        it up). Scorers without a memory model run every batch as it comes."""
        return True

    def plans(self) -> list:
        """The ways this scorer can run a batch, cheapest first."""
        return [True]

    def need(self, batch: list[Encoded], plan) -> float:
        return 0.0

    def batch_kind(self, enc: Encoded):
        """Examples of different kinds are never batched together."""
        return None

    def batch_length(self, enc: Encoded) -> int:
        """The length batches are formed by: what the scorer's passes actually run over."""
        return len(enc.source_ids)

    def _score_batch(self, batch: list[Encoded], plan) -> list[ScoredChain]:
        raise NotImplementedError


class BackpropScorer(Scorer):
    """A scorer whose passes backpropagate to the residual stream, with the memory model
    that sizes them: `recompute` None picks per batch the cheapest way that fits (stored
    activations; per-block recomputation keeping every h^(l); the same with the MLP in
    pieces; the same keeping every k-th h^(l), k ≈ √L, for one more forward), True or False
    forces recomputation or storing."""

    def __init__(self, lm: LM, recompute: bool | None = None, **kwargs):
        super().__init__(lm, **kwargs)
        self.recompute = recompute

    @cached_property
    def footprint(self) -> memory.Footprint:
        return memory.measure(self.lm)

    def need(self, batch: list[Encoded], plan: Plan) -> float:
        raise NotImplementedError

    def lowest_grad_layer(self) -> int:
        """The lowest h^(l) the backward reaches: a recomputed pass reruns the blocks above it."""
        return 1

    def token_budget(self) -> int:
        if self.max_tokens != "auto" or self.max_memory is None:
            return super().token_budget()
        fp = self.footprint
        return max(1, int(self.max_memory / (fp.OVERHEAD * fp.per_token(Plan()))))

    def plans(self) -> list[Plan]:
        every = max(2, round((self.lm.n_layers + 1) ** 0.5))
        recomputed = [Plan(recompute=True), Plan(recompute=True, mlp_pieces=True),
                      Plan(recompute=True, mlp_pieces=True, keep_every=every)]
        return {None: [Plan()] + recomputed, True: recomputed, False: [Plan()]}[self.recompute]

    def plan(self, batch: list[Encoded]) -> Plan | None:
        """The first of `plans` that fits max_memory; a recomputing one then keeps the
        attention output of as many blocks as the rest of the cap holds (without a cap, of
        all that the backward reruns)."""
        plan = next((p for p in self.plans()
                     if self.max_memory is None or self.need(batch, p) <= self.max_memory), None)
        if plan is None or not plan.recompute or not attention.keepable(self.lm):
            return plan
        most = self.lm.n_layers - self.lowest_grad_layer()
        if self.max_memory is None:
            return replace(plan, attention_kept=most)
        base = self.need(batch, plan)
        per_block = self.need(batch, replace(plan, attention_kept=1)) - base
        room = int((self.max_memory - base) // per_block) if per_block > 0 else most
        return replace(plan, attention_kept=max(0, min(most, room)))


def shared_prefix(enc: Encoded) -> int:
    """Leading tokens both passes can share: the common prefix, ending before the chain and
    before the no-chain final position (which needs its own gradient)."""
    return max(0, min(enc.prefix_len, enc.chain_start, enc.target_final))


def zscore(v: np.ndarray) -> np.ndarray:
    """(v - mean) / sd; a constant chain gives zeros. NaN or inf in v (or an sd that
    overflows) gives NaN, never zeros: a broken axis must not pass as a flat one."""
    if not np.isfinite(v).all():
        return np.full_like(v, np.nan)
    sd = v.std()
    if not np.isfinite(sd):
        return np.full_like(v, np.nan)
    if sd < 1e-12 * max(1.0, float(np.abs(v).max())):
        return np.zeros_like(v)
    return (v - v.mean()) / sd


def nonfinite(enc: Encoded, values: dict) -> NonFiniteScores | None:
    """NonFiniteScores naming the first of `values` (name -> tensor, array or float) that
    holds NaN or inf, or None. Called on a chain whose one cheap check already failed."""
    for name, v in values.items():
        a = v.detach().double().cpu().numpy() if torch.is_tensor(v) else np.asarray(v, float)
        bad = ~np.isfinite(a)
        if bad.any():
            where = f" at {int(bad.sum())} of {bad.size} values" if a.ndim else f" ({float(a)})"
            return NonFiniteScores(f"{name} is NaN or inf{where}", enc.example.id)
    return None


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


# Necessity's baseline state (ABLATIONS): zero (Eq. 4, the paper: h_i erased) or the chain's
# mean state at that layer (h_i replaced by what a typical chain token carries there).


def eq7(per_layer, cbar, layer_weights: str = "signed"):
    """Eq. 7, one axis [T] from its per-layer terms [L, T] and Eq. 6's c̄ [L] (torch or
    numpy): Σ_l w_l·|term_l|, with w = c̄ as it is (signed, the paper) or max(c̄, 0)
    (clipped: a layer whose logit-lens contribution falls counts for nothing instead of
    against a token). Where clipping leaves no signal (every token 0: no layer's c̄ is
    positive, or only the last block's, whose state at a chain position has no path to the
    answer), the axis would rank nothing, so the layers weigh by |c̄|: the signed weights
    would then all be ≤ 0 and rank the tokens that move the answer most last (18 of 200
    testbed chains, docs/results/calibration.md)."""
    mag = per_layer.abs() if isinstance(per_layer, torch.Tensor) else np.abs(per_layer)
    if layer_weights == "clipped":
        clipped = ((cbar * (cbar > 0))[:, None] * mag).sum(0)
        if clipped.any():
            return clipped
        return (abs(cbar)[:, None] * mag).sum(0)
    return (cbar[:, None] * mag).sum(0)


class MistScorer(BackpropScorer):
    """First-order MIST: one no-chain pass and one source pass per batch, each a forward
    and a backward to the residual stream (no parameter gradients). The per-layer terms
    are reduced as the passes produce them, so nothing beyond the passes' own memory is
    held: Eq. 4 as each layer's gradient arrives, Eq. 5 and Eq. 6 as each layer's state
    does (the no-chain pass runs first, so its gradients are at hand).

    Args:
        lm: the model (load_model, wrap_model).
        alpha: Eq. 8's necessity weight, in [0, 1] (the paper's 0.6 by default); with one
            axis it is not used.
        axes: ("necessity", "sufficiency") or one of them (the method is then that axis's
            name).
        layers: block numbers 1..L to aggregate over (default all).
        share_prefix: continue the question prefix's cached keys and values in the source
            pass (None: where the cost model says it pays).
        layer_weights: how Eq. 7 weighs the layers: "clipped" (the default: max(c̄_l, 0), so
            a layer whose logit-lens contribution falls counts for nothing) or "signed" (the
            paper: c̄_l as Eq. 6 gives it, so such a layer counts against a token). Clipped
            is the default because on GSM8K chains it keeps more of Eq. 1 and of the
            intermediate results than the paper's weights (docs/results/units.md).
            `layer_weights` on the result is always Eq. 6's c̄.
        ablation: necessity's baseline, "zero" (Eq. 4, the paper) or "mean" (the chain's
            mean state at the layer: ⟨∇h_i, h_i − h̄⟩), a variant the testbed tries.
        target: what necessity's gradient is of: "answer" (Eq. 1, log p(a | x, c), the
            paper) or "facts" (that plus the log p of each of the chain's own numbers and
            operators given what precedes it: the chain's words that the later steps are
            written from count too, as a model trained on the pruned chain must write them).
            "both" (the default) scores with the answer's axes (Eq. 8) and, from one more
            backward of the same source pass, the facts' necessity (`facts_necessity`), and
            ranks by the mean of the two, each z-scored: the reader's and the writer's
            signal. It is the default because the models trained on its pruned chains
            answer better (docs/results/default/downstream.md). The log-likelihoods on the
            result are Eq. 1's whatever the target.
        recompute: None (the default) picks per batch the cheapest way that fits
            max_memory; True or False forces recomputing the blocks in the backward or
            storing their activations.
        **kwargs: the options every scorer takes (Scorer): template, max_tokens,
            max_batch, max_memory.

    Raises:
        ValueError: an alpha outside [0, 1], an unknown axis, layer weighting or ablation,
            or a layer outside 1..L.

    Examples:
        >>> from mist_core import Example, MistScorer, wrap_model
        >>> from mist_core.distill.synthetic import build_tokenizer, tiny_llama, vocabulary_texts
        >>> tokenizer = build_tokenizer(vocabulary_texts())  # word-level, no download
        >>> lm = wrap_model(tiny_llama(tokenizer, layers=2, hidden=32), tokenizer, "tiny")
        >>> ex = Example("Ann has 3 apples. She buys 4 more apples. How many apples does Ann "
        ...              "have?", "She buys 4 more, so 3 + 4 = 7.", "7", id="ann")
        >>> scorer = MistScorer(lm, alpha=0.5, layer_weights="signed", max_memory="1GB")
        >>> [chain] = scorer.score([ex])
        >>> chain.scores.shape, chain.layers.tolist(), chain.layer_weights.shape
        ((12,), [1, 2], (2,))
        >>> chain.log_likelihood < 0, chain.nochain_log_likelihood < 0
        (True, True)
        >>> MistScorer(lm, axes=("necessity",)).method
        'necessity'
        >>> MistScorer(lm, layers=[3])
        Traceback (most recent call last):
        ...
        ValueError: layers must be block numbers in 1..2, not [3]
    """

    method = "mist"

    def __init__(self, lm: LM, alpha: float = ALPHA, axes: Sequence[str] = AXES,
                 layers: Sequence[int] | None = None, share_prefix: bool | None = None,
                 layer_weights: str = LAYER_WEIGHTS[0], ablation: str = ABLATIONS[0],
                 target: str = TARGETS[0], **kwargs):
        super().__init__(lm, **kwargs)
        if target not in TARGETS:
            raise ValueError(f"target must be one of {TARGETS}, not {target!r}")
        self.target = target
        self.share_prefix = share_prefix
        if ablation not in ABLATIONS:
            raise ValueError(f"ablation must be one of {ABLATIONS}, not {ablation!r}")
        self.ablation = ablation
        if layer_weights not in LAYER_WEIGHTS:
            raise ValueError(f"layer_weights must be one of {LAYER_WEIGHTS}, not {layer_weights!r}")
        self.layer_weights = layer_weights
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

    def lowest_grad_layer(self) -> int:
        return self.layers[0]

    def batch_kind(self, enc: Encoded) -> bool:
        return self.shares_prefix(enc)

    def batch_length(self, enc: Encoded) -> int:
        return len(enc.source_ids) - (shared_prefix(enc) if self.shares_prefix(enc) else 0)

    def shares_prefix(self, enc: Encoded) -> bool:
        if self.share_prefix is not None:
            return self.share_prefix and shared_prefix(enc) > 0
        return self._prefix_pays(enc)

    def _prefix_pays(self, enc: Encoded) -> bool:
        """Whether the source pass continues the question prefix's cached keys and values
        (saving the prefix's backward) or runs the whole input from scratch. Continuing a
        cache needs an explicit mask, and SDPA with a mask computes every query-key pair
        where causal attention computes half: on long chains, where attention dominates and
        the prefix is a small share, the mask costs more than the prefix saves."""
        P = shared_prefix(enc)
        C = len(enc.source_ids) - P
        config = self.lm.model.config
        d = self.lm.unembedding.shape[1]
        block = 4 * d * d + 3 * d * getattr(config, "intermediate_size", 4 * d)  # MACs a token
        attention = 2 * d  # MACs per query-key pair (scores and values)
        shared = 2 * C * block + 3 * C * (P + C) * attention
        scratch = 2 * (P + C) * block + 3 * (P + C) * (P + C) / 2 * attention
        return P > 0 and shared < scratch

    def need(self, batch: list[Encoded], plan: Plan) -> float:
        share = self.shares_prefix(batch[0])
        width = max(self.batch_length(e) for e in batch)
        P = max(shared_prefix(e) for e in batch)
        facts = sum(len(p) for p in self._facts(batch, 0) or ())  # more logit rows
        answers = sum(e.answer_len for e in batch) + facts
        return self.footprint.need(len(batch) * width, plan, prefix_positions=len(batch) * P,
                                   mask_cells=len(batch) * width * (P + width) if share else 0,
                                   logit_rows=answers, vocab=self.lm.unembedding.shape[0],
                                   gradients=2 if self.target == "both" else 1)

    def _facts(self, batch: list[Encoded], k) -> list[np.ndarray] | None:
        """With target "facts" or "both": each row's fact tokens' positions in the source
        pass (its ids from k[b] on, or from 0 with k an int); else None."""
        if self.target == "answer":
            return None
        k = [k] * len(batch) if isinstance(k, int) else k
        return [e.chain_start - n + np.flatnonzero(fact_tokens(e.example.cot, e.chain_offsets))
                for e, n in zip(batch, k)]

    def _target_pass(self, batch: list[Encoded], prefix: Prefix):
        """∇ log p(a|x,∅) and h at the no-chain final position f, for the selected layers:
        [B, Lsel, d] each, and the log-likelihoods. Short (the answer line after the
        cached prefix), so always with stored activations."""
        k = prefix.lengths
        ids, kwargs = prefix.continuation(self.lm, [e.target_ids[n:] for e, n in zip(batch, k)])
        rows = torch.arange(len(batch), device=self.lm.device)
        final = torch.tensor([e.target_final - n for e, n in zip(batch, k)], device=self.lm.device)
        h_f, g_f = {}, {}

        def on_grad(l, g, h):
            g_f[l], h_f[l] = wide(g[rows, final]), wide(h[rows, final])

        lls = residual_pass(self.lm, ids, [(e.target_final + 1 - n, len(e.target_ids) - n)
                                           for e, n in zip(batch, k)],
                            grad_layers=self.layers, on_grad=on_grad, **kwargs)
        return (torch.stack([g_f[l] for l in self.layers], 1),
                torch.stack([h_f[l] for l in self.layers], 1), lls)

    def _score_batch(self, batch: list[Encoded], plan: Plan) -> list[ScoredChain]:
        lm, L = self.lm, self.lm.n_layers
        # The question prefix is the same in both inputs and, under causal attention, nothing
        # after it changes it: its keys and values are computed once, without gradients.
        prefix = Prefix.run(lm, [e.source_ids[:shared_prefix(e)] for e in batch])
        suff, nec = "sufficiency" in self.axes, "necessity" in self.axes
        if suff:
            g_f, h_f, ll_tgt = self._target_pass(batch, prefix)
            gh_f = (g_f * h_f).sum(-1)  # [B, Lsel]
        share = self.shares_prefix(batch[0])
        k = prefix.lengths if share else [0] * len(batch)
        seqs = [e.source_ids[n:] for e, n in zip(batch, k)]
        spans = [(e.answer_start - n, e.answer_stop - n) for e, n in zip(batch, k)]
        if share:
            ids, kwargs = prefix.continuation(lm, seqs)
            kwargs["prefix_kv"] = PrefixKV(prefix.keys, prefix.values)
        else:
            ids, kwargs = pad(seqs, lm.pad_id, lm.device)[0], {}
        sel = {l: i for i, l in enumerate(self.layers)}
        w_u = wide(lm.unembedding[torch.tensor([int(e.source_ids[e.answer_start]) for e in batch],
                                               device=lm.device)])  # [B, d]
        proj, phi, psi = [None] * (L + 1), [None] * len(sel), [None] * len(sel)

        def on_state(l, h):
            h = wide(h)
            proj[l] = torch.einsum("bsd,bd->bs", h, w_u)  # for Eq. 6
            if suff and l in sel:
                i = sel[l]
                psi[i] = torch.einsum("bsd,bd->bs", h, g_f[:, i]) - gh_f[:, i, None]  # Eq. 5

        if self.ablation == "mean":  # each row's chain positions, to average h over
            pos = torch.arange(ids.shape[1], device=lm.device)
            starts = torch.tensor([e.chain_start - n for e, n in zip(batch, k)], device=lm.device)
            chain = (pos >= starts[:, None]) & (pos < starts[:, None] + torch.tensor(
                [e.chain_len for e in batch], device=lm.device)[:, None])
            chain = chain / chain.sum(1, keepdim=True)  # [B, S], rows sum to 1

        def eq4(terms):
            def on_grad(l, g, h):
                g, h = wide(g), wide(h)
                terms[sel[l]] = (g * h).sum(-1)  # Eq. 4
                if self.ablation == "mean":  # ⟨∇h_i, h_i − h̄⟩, h̄ the chain's mean state
                    hbar = torch.einsum("bs,bsd->bd", chain.to(h.dtype), h)
                    terms[sel[l]] = terms[sel[l]] - torch.einsum("bsd,bd->bs", g, hbar)
            return on_grad

        both = nec and self.target == "both"
        phi_facts = [None] * len(sel)
        ll_src = residual_pass(lm, ids, spans, grad_layers=self.layers if nec else (),
                               plan=plan, on_state=on_state, on_grad=eq4(phi),
                               also=self._facts(batch, k) if nec else None,
                               on_also_grad=eq4(phi_facts) if both else None, **kwargs)
        proj_t = torch.stack(proj)  # [L+1, B, S]
        layer_idx = torch.tensor(self.layers, device=lm.device)
        out = []
        for b, enc in enumerate(batch):
            cs = enc.chain_start - k[b]
            ce = cs + enc.chain_len
            p = proj_t[:, b, cs:ce]
            cbar = (p[1:] - p[:-1]).mean(1)[layer_idx - 1]  # Eq. 6, [Lsel]
            fields = {"layer_weights": cbar, "layers": np.asarray(self.layers),
                      "log_likelihood": ll_src[b]}
            if nec:
                per_layer = torch.stack([x[b, cs:ce] for x in phi])
                fields.update(necessity_per_layer=per_layer,
                              necessity=eq7(per_layer, cbar, self.layer_weights))
            if both:
                fields["facts_necessity"] = eq7(torch.stack([x[b, cs:ce] for x in phi_facts]),
                                                cbar, self.layer_weights)
            if suff:
                per_layer = torch.stack([x[b, cs:ce] for x in psi])
                fields.update(sufficiency_per_layer=per_layer,
                              sufficiency=eq7(per_layer, cbar, self.layer_weights),
                              nochain_log_likelihood=ll_tgt[b])
            # NaN or inf in the log-likelihoods or the raw axes (which carry the gradients,
            # the states and the layer weights) fails the chain: normalised, a NaN axis
            # would read as a flat chain. One check per chain, on values at hand.
            lls = {"log p(answer | question, chain)": ll_src[b]}
            if suff:
                lls["log p(answer | question, no chain)"] = ll_tgt[b]
            axes = {a: fields[a] for a in self.axes + (("facts_necessity",) if both else ())}
            if not (np.isfinite(list(lls.values())).all()
                    and bool(torch.isfinite(torch.stack(list(axes.values()))).all())):
                out.append(nonfinite(enc, {**lls, **axes}) or NonFiniteScores(
                    "NaN or inf in the scores", enc.example.id))
                continue
            fields = {k_: v.detach().cpu().double().numpy() if torch.is_tensor(v) else v
                      for k_, v in fields.items()}
            scores = combine(fields.get("necessity"), fields.get("sufficiency"), self.alpha)
            if both:
                scores = 0.5 * zscore(scores) + 0.5 * zscore(
                    combine(fields["facts_necessity"], None, self.alpha))
            out.append(ScoredChain.from_encoded(enc, self.method, scores, **fields))
        return out
