"""Every setting of the compression job (JobConfig) and of the evaluation (EvalConfig),
declared once: its type, default, allowed values, help and flag group. pydantic coerces and
checks a value from any source (flags, a YAML file given with --config, Python), and each
command's parser is built from these declarations (build_parser), so the help, the choices
and the defaults cannot drift from what the code accepts. Sources stack: defaults, then the
YAML file (keys are the flag names, `batch_size` or `batch-size`), then flags. A bad value
raises ConfigError (exit status 2) with a sentence that names the setting."""
from __future__ import annotations

import argparse
import reprlib
from typing import Any, Callable

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from mist_core.adapters import ADAPTERS
from mist_core.choices import ALPHA, LAYER_WEIGHTS, OPTIONS
from mist_core.formats import SFT_ALIASES, SFT_FORMATS, SFT_MIXES, sft_format_name
from mist_core.prune import UNITS
from mist_core.templates import TEMPLATES

from .errors import ConfigError

DEFAULT_BUDGETS = [0.5, 0.6, 0.7, 0.8, 0.9]
DTYPES = ("float32", "bfloat16", "float16", "float64")
DEVICES = ("auto", "cpu", "cuda")
FORMATS = ("auto", "jsonl", "parquet")
MIST_FAMILY = tuple(m for m, o in OPTIONS.items() if "layer_weights" in o)  # MIST and its axes


def setting(default: Any = ..., help: str = "", *, group: str, metavar: str | None = None,
            choices: tuple | Callable[[], tuple] | None = None, shown: str | None = None) -> Any:
    """One setting's declaration. `choices`: the allowed values, or a function that gives
    them (for lists that need heavy imports, read only when a value is checked); `shown`:
    how the help writes the default (default: the value itself); help that states its
    default itself sets shown="" ."""
    extra = {"group": group, "metavar": metavar, "choices": choices, "shown": shown}
    return Field(default, description=help, json_schema_extra=extra)


def _extra(info) -> dict:
    return info.json_schema_extra or {}


def _choices(info) -> tuple | None:
    c = _extra(info).get("choices")
    return c() if callable(c) else c


# ---------------------------------------------------------------- value parsers, shared

_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother, _REPR.maxlong = 2, 60, 60, 40
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = 4


def shown(value) -> str:
    """A value as an error message quotes it: shortened, and costing little whatever its
    size (a YAML file's value can be large, or nested far)."""
    try:
        return _REPR.repr(value)
    except ValueError:  # an int past int()'s digit limit has no repr
        return f"<a {type(value).__name__}>"


def _scalar(v) -> bool:
    return isinstance(v, (str, int, float)) and not isinstance(v, bool)


def _items(value) -> list:
    """A comma-separated string's parts, or a YAML list's scalar items."""
    if isinstance(value, str):
        return value.split(",")
    if isinstance(value, (list, tuple)) and all(_scalar(v) for v in value):
        return list(value)
    if _scalar(value):
        return [value]
    raise ValueError("not a list of numbers")


def parse_floats(value) -> list[float]:
    try:
        return [float(v) for v in _items(value) if str(v).strip()]
    except (TypeError, ValueError):
        raise ConfigError(f"budgets must be numbers like 0.5,0.7, not {shown(value)}") from None


def parse_actors(value) -> tuple[int, int]:
    try:
        items = _items(value)
        if any(isinstance(v, float) and not v.is_integer() for v in items):
            raise ValueError("not whole")
        nums = [int(v) for v in items]
    except (TypeError, ValueError, OverflowError):
        raise ConfigError(f"actors must be N or MIN,MAX, not {shown(value)}") from None
    if len(nums) not in (1, 2):
        raise ConfigError(f"actors must be N or MIN,MAX, not {shown(value)}")
    return (nums[0], nums[-1])


def parse_columns(value) -> dict[str, str]:
    if isinstance(value, dict):
        if not all(_scalar(v) for v in value.values()):
            raise ConfigError(f"columns maps fields to column names, not {shown(value)}")
        return {str(k): str(v) for k, v in value.items()}
    if not isinstance(value, str):
        raise ConfigError(f"columns must look like question=q,cot=c,answer=a,id=i, "
                          f"not {shown(value)}")
    out = {}
    for part in value.split(","):
        if part.strip():
            key, sep, col = part.partition("=")
            if not sep:
                raise ConfigError(f"columns must look like question=q,cot=c,answer=a,id=i, "
                                  f"not {shown(value)}")
            out[key.strip()] = col.strip()
    return out


def _auto_or(value, parse):
    if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
        return None
    if not _scalar(value):  # a list or mapping where one value is wanted
        raise ValueError(f"not {shown(value)}")
    return parse(value)


def _message(e: ValidationError) -> str:
    """One sentence for the first problem pydantic found: ours as written, its own with the
    setting's name in front."""
    err = e.errors()[0]
    cause = (err.get("ctx") or {}).get("error")
    if isinstance(cause, ConfigError):
        return str(cause)
    name = ".".join(str(p) for p in err["loc"])
    if err["type"] == "missing":
        return f"{name} is required: give --{name.replace('_', '-')}"
    if err["type"] == "extra_forbidden":
        return f"unknown setting {shown(name)}"
    return one_line(f"{name}: {err['msg']} (got {shown(err.get('input'))})")


def one_line(text: str, limit: int = 400) -> str:
    """A message as one line of bounded length (the error policy prints one line)."""
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit - 1] + "…"


class Settings(BaseModel):
    """The settings every Ray command shares: the corpus, the model, the actors. Frozen: a
    stage receives them whole and cannot change them under another."""
    model_config = ConfigDict(extra="forbid", frozen=True)

    input: list[str] = setting(
        ["demo"], "corpus files or folders: s3://…, gs://…, file://…, a local path, "
        "hf://owner/name[:config][@split], or demo[:N]", group="input", metavar="URI")
    format: str = setting("auto", "file format; auto goes by the file name", group="input",
                          choices=FORMATS)
    adapter: str = setting(
        "generic", "how a row becomes (question, chain, answer): gsm8k splits the solution at "
        "####, math takes the last \\boxed{}; long-CoT corpora (chain = the thinking block): "
        "openr1 (one example per correct generation), openthoughts (also Bespoke-Stratos), "
        "s1k, messages (chat rows); generic reads three columns", group="input",
        choices=ADAPTERS)
    columns: dict[str, str] = setting(
        {}, "generic adapter's columns, e.g. question=prompt,cot=reasoning,answer=final,id=uid",
        group="input", metavar="MAP", shown="question, cot, answer, id")
    model: str = setting("smollm2-135m-instruct",
                         "hub id, local folder, .gguf file or smollm2-135m-instruct",
                         group="scoring", metavar="SPEC")
    template: str = setting(
        "auto", "prompt template; think puts the chain in the chat template's thinking block "
        "(Qwen3, DeepSeek-R1 distills); auto: think where the chat template has a thinking "
        "block, else chat, else plain", group="scoring",
        choices=TEMPLATES)
    dtype: str = setting("float32", "model precision; float32 is the paper's", group="scoring",
                         choices=DTYPES)
    alpha: float = setting(ALPHA, "MIST's necessity weight, in [0, 1]", group="scoring")
    budgets: list[float] = setting(DEFAULT_BUDGETS, "retention budgets γ, comma-separated",
                                   group="scoring", metavar="LIST")
    actors: tuple[int, int] = setting(
        (1, 1), "scoring actors, each with one model replica; MIN,MAX autoscales",
        group="resources", metavar="N|MIN,MAX", shown="1")
    cpus_per_actor: float = setting(1.0, "CPUs per actor, also its torch threads on CPU",
                                    group="resources", metavar="C")
    gpus_per_actor: float | None = setting(
        None, "GPUs per actor; auto: 1 if the cluster has GPUs now, else 0 (CPU actors). "
        "Give 1 on an autoscaling GPU cluster", group="resources", metavar="G", shown="auto")
    address: str | None = setting(
        None, "Ray cluster to join, e.g. auto for one started with `ray start` on this "
        "machine (default: $RAY_ADDRESS, which `ray job submit` sets; else a new local Ray "
        "for this run)", group="resources", metavar="ADDR", shown="")
    verbose: bool = setting(
        False, "also show Ray's and Ray Data's own output: their status blocks, the workers' "
        "model-loading bars and library warnings (otherwise only in Ray's session logs, "
        "/tmp/ray/session_latest/logs)", group="output")

    def __init__(self, **values):
        try:
            super().__init__(**values)
        except ValidationError as e:
            raise ConfigError(_message(e)) from None

    def to_dict(self) -> dict:
        """The settings as JSON values (manifests, run.json)."""
        return self.model_dump(mode="json")

    @field_validator("input", mode="before")
    @classmethod
    def _input(cls, v):
        if isinstance(v, str):
            return [v]
        if isinstance(v, (list, tuple)) and all(_scalar(x) for x in v):
            return [str(x) for x in v]  # a YAML list may read a name like 2024 as a number
        raise ConfigError(f"input must be a URI or a list of URIs, not {shown(v)}")

    @field_validator("columns", mode="before")
    @classmethod
    def _columns(cls, v):
        return parse_columns(v)

    @field_validator("budgets", mode="before")
    @classmethod
    def _budgets(cls, v):
        budgets = parse_floats(v)
        if not budgets or any(not 0.0 < b <= 1.0 for b in budgets):  # NaN fails this too
            raise ConfigError(f"budgets must lie in (0, 1], got {shown(budgets)}")
        return sorted(set(budgets))

    @field_validator("actors", mode="before")
    @classmethod
    def _actors(cls, v):
        lo, hi = parse_actors(v)
        if lo < 1 or hi < lo:
            raise ConfigError(f"actors must be N >= 1 or MIN,MAX with 1 <= MIN <= MAX, "
                              f"got {lo},{hi}")
        return lo, hi

    @field_validator("gpus_per_actor", mode="before")
    @classmethod
    def _gpus(cls, v):
        gpus = _auto_or(v, float)
        if gpus is not None and not gpus >= 0:
            raise ConfigError("gpus_per_actor must be >= 0 or auto")
        return gpus

    @model_validator(mode="after")
    def _check(self):
        for name, info in type(self).model_fields.items():
            allowed = _choices(info)
            value = getattr(self, name)
            if allowed is not None and value not in allowed:
                raise ConfigError(f"{name} must be one of {', '.join(map(str, allowed))}, "
                                  f"not {shown(value)}")
        if not self.input:
            raise ConfigError("give at least one --input")
        if self.columns:
            if self.adapter != "generic":
                raise ConfigError("columns maps the generic adapter's columns; the other "
                                  "adapters read their corpus's own column names")
            bad = set(self.columns) - {"question", "cot", "answer", "id"}
            if bad:
                raise ConfigError(f"columns keys must be question, cot, answer or id, "
                                  f"not {sorted(bad)}")
        if not 0.0 <= self.alpha <= 1.0:
            raise ConfigError("alpha must lie in [0, 1]")
        if not self.cpus_per_actor > 0:
            raise ConfigError("cpus_per_actor must be > 0")
        self._check_more()
        return self

    def _check_more(self) -> None:
        """A command's own cross-setting checks."""


def _positive(*names: str):
    """A validator: these integer settings must be at least 1 where given."""
    def check(cls, v, info):
        if v is not None and v < 1:
            raise ConfigError(f"{info.field_name} must be at least 1")
        return v
    return field_validator(*names)(classmethod(check))


# ---------------------------------------------------------------- the job


class JobConfig(Settings):
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
    sft_mix: str = setting("sample", "sample: one record per example, γ drawn uniformly from "
                           "the budgets and 1.0; all: one record per γ", group="output",
                           choices=SFT_MIXES)
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
    keep_digits: bool = setting(False, "always keep tokens with digits (may exceed the budget)",
                                group="scoring")
    trust_remote_code: bool = setting(
        False, "let transformers run Python code shipped with the model or tokenizer (off by "
        "default: a hub repository's code would run on every worker)", group="scoring")
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

    _positive_ints = _positive("limit", "batch_size", "rows_per_file")

    @field_validator("sft_format", mode="before")
    @classmethod
    def _sft_format(cls, v):
        return sft_format_name(str(v))

    @field_validator("batch_tokens", mode="before")
    @classmethod
    def _batch_tokens(cls, v):
        try:
            tokens = _auto_or(v, int)
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
        from mist_core.memory import parse_bytes

        try:  # parse_bytes reads a size's text or a number of bytes
            size = _auto_or(v, lambda x: parse_bytes(x if isinstance(x, (int, str)) else str(x)))
        except OverflowError:
            raise ConfigError(f"max_memory must be a size like 6GB, not {shown(v)}") from None
        if size is not None and size < 1:
            raise ConfigError(f"max_memory must be a positive size, got {size} bytes")
        return size

    def scoring(self):
        """The mist_core.registry.Scoring these settings name: the one translation of the
        job's settings into a scorer (`cfg.scoring().scorer(lm)`)."""
        from mist_core.registry import Scoring

        taken = OPTIONS.get(self.method, ())
        return Scoring(method=self.method, template=self.template, max_tokens=self.batch_tokens,
                       max_batch=self.batch_size,
                       max_memory="auto" if self.max_memory is None else self.max_memory,
                       **{k: getattr(self, k) for k in ("alpha", "layer_weights") if k in taken})

    def _check_more(self) -> None:
        if (self.layer_weights != type(self).model_fields["layer_weights"].default
                and self.method not in MIST_FAMILY):
            raise ConfigError(f"layer_weights is MIST's ({', '.join(MIST_FAMILY)}), not "
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


# ---------------------------------------------------------------- the evaluation


def _method_names():
    from .results import ALL_METHODS

    return ALL_METHODS


def _default_methods():
    from .results import DEFAULT_METHODS

    return DEFAULT_METHODS


class EvalConfig(Settings):
    """The evaluation harness's settings (`mist eval`)."""

    input: list[str] = setting(..., Settings.model_fields["input"].description, group="input",
                               metavar="URI")
    budgets: list[float] = setting([0.3, 0.5, 0.7, 0.9], "retention budgets γ, comma-separated",
                                   group="scoring", metavar="LIST")
    methods: list[str] = setting(list(_default_methods()), "methods to compare, comma-separated",
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

    _positive_ints = _positive("sample", "batch_size", "batch_tokens", "threads")

    @field_validator("methods", mode="before")
    @classmethod
    def _methods(cls, v):
        try:
            methods = [str(m).strip() for m in _items(v)]
        except ValueError:
            raise ConfigError(f"methods must be names like mist,uniform, not {shown(v)}") from None
        methods = [m for m in methods if m]
        bad = [m for m in methods if m not in _method_names()]
        if bad or not methods:
            raise ConfigError(f"unknown methods {shown(bad)}; choose from "
                              f"{', '.join(_method_names())}")
        return methods

    @field_validator("exact_layers", mode="before")
    @classmethod
    def _exact_layers(cls, v):
        if v is None or (isinstance(v, str) and v.strip().lower() == "auto"):
            return None
        try:
            return [int(i) for i in _items(v) if str(i).strip()]
        except (ValueError, OverflowError):
            raise ConfigError(f"exact_layers must be block numbers like 2,4 or auto, "
                              f"not {shown(v)}") from None

    def _check_more(self) -> None:
        if self.exact_n < 0 or self.extra_new < 0:
            raise ConfigError("exact_n and extra_new must be >= 0")


# ---------------------------------------------------------------- CLI and YAML


GROUPS = ("input", "output", "scoring", "resources")


def _shown(info) -> str:
    shown = _extra(info).get("shown")
    if shown is not None:
        return shown
    d = info.default
    if isinstance(d, (list, tuple)):
        return ",".join(map(str, d))
    return str(d).lower() if isinstance(d, bool) else str(d)


def build_parser(kind: type[Settings], prog: str, description: str, epilog: str = ""
                 ) -> argparse.ArgumentParser:
    """The command line of a settings class: a flag per setting (--batch-size for
    batch_size), in its group, with its help, choices and default; --config FILE for YAML.
    Values stay strings here: the settings class coerces and checks them."""
    p = argparse.ArgumentParser(prog=prog, description=description, epilog=epilog,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                argument_default=argparse.SUPPRESS)
    p.add_argument("--config", metavar="FILE", help="YAML file of settings (flags override it)")
    groups = {g: p.add_argument_group(g) for g in GROUPS}
    for name, info in kind.model_fields.items():
        extra = _extra(info)
        flag = "--" + name.replace("_", "-")
        help = (info.description or "").replace("%", "%%")
        shown = "" if info.is_required() or info.default is False else _shown(info)
        if shown:
            help += f" (default: {shown})"
        elif info.is_required():
            help += " (required)"
        kwargs: dict[str, Any] = {"help": help}
        if info.annotation is bool:
            kwargs["action"] = "store_true"
        elif name == "input":
            kwargs.update(nargs="+", action="extend", metavar=extra.get("metavar"))
        else:
            choices = extra.get("choices")
            if isinstance(choices, tuple):
                kwargs["choices"] = choices
                if name == "sft_format":
                    kwargs["choices"] = choices + tuple(SFT_ALIASES)
            else:
                kwargs["metavar"] = extra.get("metavar")
        groups[extra["group"]].add_argument(flag, **kwargs)
    return p


MAX_CONFIG_BYTES = 1 << 20  # a settings file is a few lines; this bounds what parsing may cost


class _ConfigLoader(yaml.SafeLoader):
    """safe_load's loader, refusing aliases (`*name`, also in `<<: *name`): a few lines of
    nested aliases stand for billions of values (the `billion laughs`), which a message or
    a str() of the value would then expand. A settings file has no need of them."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            mark = self.peek_event().start_mark
            raise yaml.composer.ComposerError(
                None, None, "uses an alias (*name): write the value out instead", mark)
        return super().compose_node(parent, index)


def load_yaml(path: str) -> dict:
    """A settings file's mapping: UTF-8, at most MAX_CONFIG_BYTES, safe YAML without aliases."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(f"config file {path} is larger than {MAX_CONFIG_BYTES >> 20} MiB: "
                          "not a settings file")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {path} is not UTF-8 text (byte {e.start})") from None
    loader = None
    try:
        loader = _ConfigLoader(text)  # its reader already refuses control characters
        values = loader.get_single_data()
    except (yaml.YAMLError, ValueError, RecursionError) as e:  # ValueError: an integer past
        # int()'s digit limit; RecursionError: nesting deeper than the composer recurses
        raise ConfigError(one_line(f"config file {path} is not valid YAML: {e}")) from None
    finally:
        if loader is not None:
            loader.dispose()
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise ConfigError(f"config file {path} must hold a mapping of settings")
    return values


def from_mapping(values: dict, base: Settings | None = None, kind: type[Settings] | None = None
                 ) -> Settings:
    """Settings from a mapping of setting -> value (YAML or flags), over `base`'s."""
    kind = kind or (type(base) if base is not None else JobConfig)
    names = set(kind.model_fields)
    merged = base.model_dump() if base is not None else {}
    for key, value in values.items():
        name = key.replace("-", "_") if isinstance(key, str) else None  # YAML: 1:, ~:
        if name not in names:
            raise ConfigError(f"unknown setting {shown(key)}; known: {', '.join(sorted(names))}")
        merged[name] = value
    return kind(**merged)


def parse(kind: type[Settings], argv: list[str] | None, prog: str, description: str,
          epilog: str = "") -> Settings:
    """Defaults, then --config's YAML, then the flags given."""
    args = vars(build_parser(kind, prog, description, epilog).parse_args(argv))
    values = load_yaml(args.pop("config")) if "config" in args else {}
    values = {k.replace("-", "_") if isinstance(k, str) else k: v for k, v in values.items()}
    return from_mapping({**values, **args}, kind=kind)


def validate(cfg: Settings) -> Settings:
    """The same settings, checked again (constructing them already checks them)."""
    return type(cfg)(**cfg.model_dump())
