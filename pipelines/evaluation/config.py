"""The evaluation's settings (`mist eval`), declared once with the settings kit
(common/settings.py)."""
from __future__ import annotations

from pydantic import field_validator

from mist_core.scoring.prune import UNITS

from ..common.errors import ConfigError
from ..common.settings import Settings, listed, positive, setting, shown
from .results import ALL_METHODS, DEFAULT_METHODS


class EvalConfig(Settings):
    """The evaluation harness's settings (`mist eval`)."""

    input: list[str] = setting(..., Settings.model_fields["input"].description, group="input",
                               metavar="URI", many=True)
    budgets: list[float] = setting([0.3, 0.5, 0.7, 0.9], "retention budgets γ, comma-separated",
                                   group="scoring", metavar="LIST")
    methods: list[str] = setting(list(DEFAULT_METHODS), "methods to compare, comma-separated",
                                 group="scoring", metavar="LIST",
                                 shown="all but greedy_ll (a forward pass per kept token per step)")
    unit: str = setting("token", "prune single tokens (the paper's ⌈γT⌉), whole words or "
                        "equations kept whole; a number is never cut in any unit",
                        group="scoring", choices=UNITS)
    style: str = setting("auto", "answer normalisation and intermediate results; auto: the "
                         "adapter's", group="scoring", choices=("auto", "gsm8k", "math"))
    sample: int = setting(200, "chains to evaluate", group="input", metavar="N")
    seed: int = setting(0, "sample and uniform-baseline seed", group="input")
    exact_n: int = setting(8, "chains (from the shortest quarter) for exact interventions",
                           group="scoring", metavar="N")
    exact_layers: list[int] | None = setting(
        None, "blocks for exact interventions, comma-separated; auto: 1/4, 1/2, 3/4 of the "
        "depth", group="scoring", metavar="LIST", shown="auto")
    extra_new: int = setting(8, "greedy decoding stops after len(gold answer) + this many "
                             "tokens", group="scoring", metavar="N")
    output: str = setting("outputs/eval", "results folder", group="output", metavar="DIR")
    mode: str = setting("resume", "resume: keep the chains already in results.jsonl (same "
                        "settings only); overwrite: start again", group="output",
                        choices=("resume", "overwrite"))
    batch_size: int = setting(4, "chains per actor call", group="resources", metavar="N")
    batch_tokens: int = setting(8192, "padded tokens per forward pass", group="resources",
                                metavar="N")
    threads: int | None = setting(None, "torch threads per CPU actor (default: "
                                  "--cpus-per-actor)", group="resources", metavar="N", shown="")

    _positive_ints = positive("sample", "batch_size", "batch_tokens", "threads")

    @field_validator("methods", mode="before")
    @classmethod
    def _methods(cls, v):
        try:
            methods = [str(m).strip() for m in listed(v)]
        except ValueError:
            raise ConfigError(f"methods must be names like mist,uniform, not {shown(v)}") from None
        methods = [m for m in methods if m]
        bad = [m for m in methods if m not in ALL_METHODS]
        if bad or not methods:
            raise ConfigError(f"unknown methods {shown(bad)}; choose from "
                              f"{', '.join(ALL_METHODS)}")
        return methods

    @field_validator("exact_layers", mode="before")
    @classmethod
    def _exact_layers(cls, v):
        if v is None or (isinstance(v, str) and v.strip().lower() == "auto"):
            return None
        try:
            return [int(i) for i in listed(v) if str(i).strip()]
        except (ValueError, OverflowError):
            raise ConfigError(f"exact_layers must be block numbers like 2,4 or auto, "
                              f"not {shown(v)}") from None

    def _check_more(self) -> None:
        if self.exact_n < 0 or self.extra_new < 0:
            raise ConfigError("exact_n and extra_new must be >= 0")
