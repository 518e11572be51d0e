"""Scorers by name (MIST, its one-axis ablations and the paper's baselines), and Scoring: the
one place a method and its options become a scorer, for every command and actor."""
from __future__ import annotations

from dataclasses import asdict, dataclass

from ..models import LM
from .choices import ABLATIONS, ALPHA, LAYER_WEIGHTS, OPTIONS, TARGETS
from .scorer import MistScorer, Scorer


def _factories():
    from . import baselines

    return {
        "mist": MistScorer,
        "necessity": lambda lm, **kw: MistScorer(lm, axes=("necessity",), **kw),
        "sufficiency": lambda lm, **kw: MistScorer(lm, axes=("sufficiency",), **kw),
        "uniform": baselines.UniformScorer,
        "perplexity": baselines.PerplexityScorer,
        "attention_rollout": baselines.AttentionRolloutScorer,
        "h2o": baselines.H2OScorer,
        "crisp": baselines.CrispScorer,
        "gogi_l1": baselines.GoGIScorer,
        "llmlingua2": baselines.LLMLingua2Scorer,
    }


COMMON = ("template", "max_tokens", "max_batch", "max_memory")


def scorer_names() -> list[str]:
    """The methods get_scorer knows: MIST, its one-axis ablations and the baselines.

    Returns:
        The names, MIST's first.

    Examples:
        >>> from mist_core import scorer_names
        >>> scorer_names()[:4]
        ['mist', 'necessity', 'sufficiency', 'uniform']
        >>> "h2o" in scorer_names()
        True
    """
    return list(_factories())


def get_scorer(name: str, lm: LM, **kwargs) -> Scorer:
    """A scorer by name. Scoring checks a method's options before it makes one; this takes
    them as they come.

    Args:
        name: one of scorer_names().
        lm: the model (load_model, wrap_model).
        **kwargs: the scorer's constructor's options: template, max_tokens, max_batch and
            max_memory for every one (Scorer), and the method's own (MistScorer's alpha,
            layer_weights, ablation; the uniform baseline's seed).

    Returns:
        The Scorer.

    Raises:
        ValueError: an unknown name, or an option value the scorer refuses.

    Examples:
        >>> from mist_core import wrap_model
        >>> from mist_core.distill.synthetic import build_tokenizer, tiny_llama, vocabulary_texts
        >>> tokenizer = build_tokenizer(vocabulary_texts())  # word-level, no download
        >>> lm = wrap_model(tiny_llama(tokenizer, layers=2, hidden=32), tokenizer, "tiny")
        >>> from mist_core import get_scorer
        >>> scorer = get_scorer("necessity", lm, max_tokens=2048)
        >>> type(scorer).__name__, scorer.method, scorer.max_tokens
        ('MistScorer', 'necessity', 2048)
        >>> get_scorer("tfidf", lm)
        Traceback (most recent call last):
        ...
        ValueError: unknown method 'tfidf'; choose from mist, necessity, sufficiency, ...
    """
    factories = _factories()
    if name not in factories:
        raise ValueError(f"unknown method {name!r}; choose from {', '.join(factories)}")
    return factories[name](lm, **kwargs)


@dataclass(frozen=True)
class Scoring:
    """How chains are scored: a method and its options. Each option a method does not take
    (OPTIONS) must keep its default, so that a setting never passes unused.

    Args:
        method: a name of scorer_names().
        alpha: MIST's necessity weight in Eq. 8, in [0, 1] (mist only).
        layer_weights: Eq. 7's layer weights, one of LAYER_WEIGHTS (the MIST family).
        ablation: necessity's baseline state, one of ABLATIONS (mist, necessity).
        target: what necessity's gradient is of, one of TARGETS (mist, necessity).
        seed: the uniform baseline's random seed.
        template: the prompt template's name (templates.get_template).
        max_tokens: padded tokens per forward pass, or "auto".
        max_batch: chains per forward pass at most.
        max_memory: the scorer's memory cap in bytes, "auto" (90% of the free GPU memory,
            60% of the available CPU memory) or None (no cap).

    Raises:
        ValueError: an unknown method, or an option the method does not take set away
            from its default.

    Examples:
        >>> from mist_core.scoring.registry import Scoring
        >>> Scoring("uniform", seed=1).options()
        {'template': 'auto', 'max_tokens': 4096, 'max_batch': 32, 'max_memory': 'auto', 'seed': 1}
        >>> Scoring("h2o", alpha=0.3)
        Traceback (most recent call last):
        ...
        ValueError: alpha is not an option of h2o
        >>> from mist_core import wrap_model
        >>> from mist_core.distill.synthetic import build_tokenizer, tiny_llama, vocabulary_texts
        >>> tokenizer = build_tokenizer(vocabulary_texts())  # word-level, no download
        >>> lm = wrap_model(tiny_llama(tokenizer, layers=2, hidden=32), tokenizer, "tiny")
        >>> scorer = Scoring(layer_weights="signed", max_memory="2GB").scorer(lm)
        >>> type(scorer).__name__, scorer.layer_weights, scorer.max_memory
        ('MistScorer', 'signed', 2147483648)
    """
    method: str = "mist"
    alpha: float = ALPHA
    layer_weights: str = LAYER_WEIGHTS[0]
    ablation: str = ABLATIONS[0]
    target: str = TARGETS[0]
    seed: int = 0
    template: str = "auto"
    max_tokens: int | str = 4096
    max_batch: int = 32
    max_memory: int | str | None = "auto"

    def __post_init__(self):
        names = scorer_names()
        if self.method not in names:
            raise ValueError(f"unknown method {self.method!r}; choose from {', '.join(names)}")
        default = Scoring.__dataclass_fields__
        unused = [k for k in dict.fromkeys(o for opts in OPTIONS.values() for o in opts)
                  if k not in OPTIONS.get(self.method, ()) and getattr(self, k) != default[k].default]
        if unused:
            raise ValueError(f"{', '.join(unused)} {'is' if len(unused) == 1 else 'are'} not "
                             f"an option of {self.method}")

    def options(self) -> dict:
        """The keyword arguments the method's constructor takes.

        Returns:
            The options every scorer takes, then the method's own, by name.
        """
        values = asdict(self)
        return {k: values[k] for k in COMMON + OPTIONS.get(self.method, ())}

    def scorer(self, lm: LM) -> Scorer:
        """The scorer these settings name, on `lm`.

        Args:
            lm: the model (load_model, wrap_model).

        Returns:
            The Scorer (get_scorer with the method's options).
        """
        return get_scorer(self.method, lm, **self.options())
