"""MIST: model-internal token saliency for chain-of-thought compression.

The library in four layers, each importing only those below it (tests/test_layout.py):
data (examples, adapters, templates, the job's formats) < scoring (the scorers, their passes
and memory, pruning) < measures (evaluation, retention, statistics) < distill (generation,
fine-tuning, the synthetic task); errors, reasons and models sit under all four.

The names that need torch (models, scorers) are imported on first use (PEP 562), so that
the light modules (data/, reasons, scoring.choices, scoring.prune, measures.answers,
measures.retention, measures.taxonomy, measures.stats) load without it: `mist report` and
`mist --help` need no model."""
from importlib import import_module

from .data.adapters import get_adapter
from .data.examples import Example
from .data.templates import get_template
from .errors import InvalidExample, MissingDependency, MistError, NonFiniteScores, UnsupportedModel
from .scoring.prune import Compressed, prune

_LAZY = {"LM": "models", "load_model": "models", "model_path": "models", "wrap_model": "models",
         "get_scorer": "scoring.registry", "scorer_names": "scoring.registry",
         "MistScorer": "scoring.scorer", "ScoredChain": "scoring.scorer",
         "Scorer": "scoring.scorer"}
__all__ = sorted(["Compressed", "Example", "InvalidExample", "MissingDependency", "MistError",
                  "NonFiniteScores", "UnsupportedModel", "get_adapter", "get_template", "prune",
                  *_LAZY])


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'mist_core' has no attribute {name!r}")
    value = getattr(import_module(f".{_LAZY[name]}", __name__), name)
    globals()[name] = value
    return value
