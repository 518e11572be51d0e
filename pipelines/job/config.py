"""The compression job's settings (`mist compress`, `python -m pipelines.compress`),
declared once with the settings kit (common/settings.py): flags, --config YAML and Python
(JobConfig(...)) are built from these declarations."""
from __future__ import annotations

from pydantic import field_validator

from mist_core.data.formats import SFT_FORMATS, SFT_MIXES, sft_format_name
from mist_core.scoring.choices import LAYER_WEIGHTS, OPTIONS, TARGETS
from mist_core.scoring.prune import SENTENCE_KEEPS, UNITS

from ..common.errors import ConfigError
from ..common.settings import DEVICES, RemoteCode, Settings, auto_or, positive, setting, shown


class JobConfig(Settings, RemoteCode):
    """The compression job's settings (`mist compress`)."""

    limit: int | None = setting(None, "read only the first N rows", group="input",
                                metavar="N", shown="")
    output: str = setting("outputs/demo", "output folder", group="output", metavar="URI")
    mode: str = setting("refresh", "refresh: add only rows not yet in the output; overwrite: "
                        "delete the job's earlier output first", group="output",
                        choices=("refresh", "overwrite"))
    scores: bool = setting(False, "also write per-token scores to scores/", group="output")
    rows_per_file: int = setting(512, "input rows per group of output files; a group is the "
                                 "unit a crashed run keeps", group="output", metavar="N")
    sft_format: str = setting(
        "prompt-completion", "prompt-completion: TRL's conversational {prompt, completion} "
        "(the loss on the completion only); messages: {messages: [user, assistant]} (chat: "
        "its earlier name); alpaca: LLaMA-Factory {instruction, input, output}; tokenskip: "
        "TokenSkip's alpaca records with {question}<|eot_id|>{γ}<|eot_id|>. Below γ = 1 the "
        "user turn asks to reduce (1-γ)% of the tokens; messages, alpaca and tokenskip also "
        "write LLaMA-Factory's dataset_info.json", group="output",
        choices=SFT_FORMATS)
    sft_mix: str = setting("all", "all: one record per example and γ, the budgets and 1.0 "
                           "(the model sees each chain whole and at every budget); sample: one "
                           "per example, γ drawn uniformly", group="output", choices=SFT_MIXES)
    max_error_share: float = setting(
        0.0, "the share of the rows read (0 to 1) that may fail for the job's or the model's "
        "fault (score_error, nonfinite_scores, prune_error, unexpected_error; bad input never "
        "counts) before the run fails with exit status 5 and no manifest, stopping early "
        "where it can; a rerun redoes the failed rows", group="output", metavar="F")
    method: str = setting(
        "mist", "mist or a baseline: uniform, perplexity, attention_rollout, h2o, gogi_l1, "
        "necessity, sufficiency", group="scoring", metavar="NAME",
        choices=lambda: tuple(__import__("mist_core", fromlist=["scorer_names"]).scorer_names()))
    unit: str = setting("word", "prune whole words, single tokens or equations kept whole; "
                        "a number is never cut in any unit", group="scoring",
                        choices=UNITS)
    layer_weights: str = setting(
        "clipped", "how MIST's Eq. 7 weighs the layers (mist, necessity, sufficiency): "
        "clipped, max(c̄_l, 0), so a layer whose logit-lens contribution falls counts for "
        "nothing (the default: it keeps more of the answer's likelihood and of the "
        "intermediate results on GSM8K, docs/results/units.md); signed, the paper's c̄_l",
        group="scoring", choices=LAYER_WEIGHTS)
    target: str = setting(
        TARGETS[0], "what MIST's necessity is the gradient of (mist, necessity): both (the "
        "default), MIST of the answer and the facts' necessity, each z-scored and averaged "
        "(one more backward pass; the models trained on its chains answer better, "
        "docs/results/default/downstream.md); answer, log p(answer) (the paper); facts, that "
        "plus the log p of the chain's own numbers and operators (what a model trained on "
        "the pruned chain must write)", group="scoring", choices=TARGETS)
    keep_digits: bool = setting(False, "always keep tokens with digits (may exceed the budget)",
                                group="scoring")
    facts_first: bool = setting(True, "keep the numbers and arithmetic operators before any "
                                "other word, within the budget; the scores pick the words "
                                "around them (on by default: the models trained on such chains "
                                "answer better, docs/results/downstream.md)", group="scoring")
    sentences_first: str = setting(
        "equations", "drop whole sentences before cutting into any (while the budget's tokens "
        "are left, lowest mean score first): those without an equation, an `=` (equations, "
        "the default: the models trained on such chains answer better, "
        "docs/results/sentences/downstream.md), those without a number or an operator "
        "(facts), or none", group="scoring", choices=SENTENCE_KEEPS + ("none",), shown="")
    batch_size: int = setting(32, "chains per forward pass; a scoring actor takes 8 times as "
                              "many rows per call and packs them by length",
                              group="resources", metavar="N")
    batch_tokens: int | str = setting(
        "auto", "padded tokens per forward pass; each call's rows are grouped by length to "
        "fill it. auto: as many as --max-memory holds, else 4096", group="resources",
        metavar="N|auto")
    max_memory: int | None = setting(
        None, "memory each scoring actor's passes may take beyond the model, e.g. 6GB; the "
        "scorer picks batch sizes and recomputation within it and rejects a chain that cannot "
        "fit alone (too_long_for_memory). Default: 90% of the GPU's free memory once the "
        "model is loaded; on CPU 60% of the memory available when the actor starts",
        group="resources", metavar="SIZE", shown="")
    device: str = setting(
        "auto", "where the scoring actors run the model: auto: cuda where Ray gives an actor "
        "a GPU (--gpus-per-actor above 0), else cpu; cpu: on the CPU even on GPU-placed "
        "actors (GPU placement tested without GPUs); cuda: on the actor's GPU, an error where "
        "it has none", group="resources", choices=DEVICES)
    seed: int = setting(0, "seed of the SFT budget draw", group="resources")
    progress_interval: float = setting(
        10.0, "print a progress line every SECONDS while scoring: chains scored of those "
        "planned, chains/s, ETA, rejects so far; 0: none", group="resources", metavar="SECONDS")

    _positive_ints = positive("limit", "batch_size", "rows_per_file")

    @field_validator("sft_format", mode="before")
    @classmethod
    def _sft_format(cls, v):
        return sft_format_name(str(v))

    @field_validator("batch_tokens", mode="before")
    @classmethod
    def _batch_tokens(cls, v):
        try:
            tokens = auto_or(v, int)
        except (ValueError, OverflowError):  # int() of a word, NaN or inf
            raise ConfigError(f"batch_tokens must be a number or auto, not {shown(v)}") from None
        if tokens is None:
            return "auto"
        if tokens < 1:
            raise ConfigError("batch_tokens must be at least 1 or auto")
        return tokens

    @field_validator("max_memory", mode="before")
    @classmethod
    def _max_memory(cls, v):
        from mist_core.scoring.memory import parse_bytes

        try:  # parse_bytes reads a size's text or a number of bytes
            size = auto_or(v, lambda x: parse_bytes(x if isinstance(x, (int, str)) else str(x)))
        except OverflowError:
            raise ConfigError(f"max_memory must be a size like 6GB, not {shown(v)}") from None
        if size is not None and size < 1:
            raise ConfigError(f"max_memory must be a positive size, got {size} bytes")
        return size

    def scoring(self):
        """The mist_core.scoring.registry.Scoring these settings name: the one translation of the
        job's settings into a scorer (`cfg.scoring().scorer(lm)`)."""
        from mist_core.scoring.registry import Scoring

        taken = OPTIONS.get(self.method, ())
        return Scoring(method=self.method, template=self.template, max_tokens=self.batch_tokens,
                       max_batch=self.batch_size,
                       max_memory="auto" if self.max_memory is None else self.max_memory,
                       **{k: getattr(self, k) for k in ("alpha", "layer_weights", "target")
                          if k in taken})

    @property
    def sentence_rule(self) -> str | None:
        """sentences_first as mist_core.scoring.prune takes it: None for none."""
        return None if self.sentences_first == "none" else self.sentences_first

    def _check_more(self) -> None:
        for key in ("layer_weights", "target"):
            family = [m for m, o in OPTIONS.items() if key in o]
            if (getattr(self, key) != type(self).model_fields[key].default
                    and self.method not in family):
                raise ConfigError(f"{key} is MIST's ({', '.join(family)}), not "
                                  f"{self.method}'s")
        if self.device == "cuda" and self.gpus_per_actor == 0:
            raise ConfigError("device cuda needs a GPU for each scoring actor: give "
                              "--gpus-per-actor 1 (or auto on a cluster with GPUs), or "
                              "--device cpu")
        if not 0.0 <= self.max_error_share <= 1.0:  # NaN fails this too
            raise ConfigError(f"max_error_share must lie in [0, 1], not {self.max_error_share}")
        if not 0.0 <= self.progress_interval < float("inf"):  # NaN fails this too
            raise ConfigError(f"progress_interval must be 0 (off) or a number of seconds, "
                              f"not {self.progress_interval}")
