"""MIST: model-internal token saliency for chain-of-thought compression."""
from .errors import (InvalidExample, MissingDependency, MistError, NonFiniteScores,
                     UnsupportedModel)
from .examples import Example, get_adapter
from .models import LM, load_model, model_path, wrap_model
from .prune import Compressed, prune
from .registry import get_scorer, scorer_names
from .scorer import MistScorer, ScoredChain, Scorer
from .templates import get_template

__all__ = ["Compressed", "Example", "InvalidExample", "LM", "MissingDependency", "MistError",
           "MistScorer", "NonFiniteScores", "ScoredChain", "Scorer", "UnsupportedModel", "get_adapter",
           "get_scorer", "get_template", "load_model", "model_path", "prune", "scorer_names", "wrap_model"]
