"""Scorers by name: MIST, its one-axis ablations and the paper's baselines."""
from __future__ import annotations

from .models import LM
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


def scorer_names() -> list[str]:
    return list(_factories())


def get_scorer(name: str, lm: LM, **kwargs) -> Scorer:
    """A scorer by name; keyword arguments go to its constructor (template, max_tokens, …)."""
    factories = _factories()
    if name not in factories:
        raise ValueError(f"unknown method {name!r}; choose from {', '.join(factories)}")
    return factories[name](lm, **kwargs)
