"""The settings kit: a command's settings are a Settings class (the job's JobConfig in
job/config.py, the evaluation's EvalConfig in evaluation/config.py), each setting declared
once: its type, default, allowed values, help and flag group. pydantic coerces and
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

from mist_core.data.adapters import ADAPTERS
from mist_core.data.formats import SFT_ALIASES
from mist_core.data.templates import TEMPLATES
from mist_core.scoring.choices import ALPHA

from .errors import ConfigError

DEFAULT_BUDGETS = [0.5, 0.6, 0.7, 0.8, 0.9]
DTYPES = ("float32", "bfloat16", "float16", "float64")
DEVICES = ("auto", "cpu", "cuda")
FORMATS = ("auto", "jsonl", "parquet")


def setting(default: Any = ..., help: str = "", *, group: str, metavar: str | None = None,
            choices: tuple | Callable[[], tuple] | None = None, shown: str | None = None,
            positional: bool = False, many: bool | str = False, flag: str | None = None) -> Any:
    """One setting's declaration. `choices`: the allowed values, or a function that gives
    them (for lists that need heavy imports, read only when a value is checked); `shown`:
    how the help writes the default (default: the value itself); help that states its
    default itself sets shown="" . `positional`: given without a flag (`mist show OUT`);
    `many`: several values, space-separated, the flag repeatable (`--input a b --input c`);
    many="repeat": one value a flag, the flag repeated for more (`--id a --id b`), so that
    a positional after it is not taken for one. `flag`: the flag's name where the setting's
    own would clash with a Python name (`--json` for json_path)."""
    extra = {"group": group, "metavar": metavar, "choices": choices, "shown": shown,
             "positional": positional, "many": many, "flag": flag}
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


def listed(value) -> list:
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
        return [float(v) for v in listed(value) if str(v).strip()]
    except (TypeError, ValueError):
        raise ConfigError(f"budgets must be numbers like 0.5,0.7, not {shown(value)}") from None


def parse_actors(value) -> tuple[int, int]:
    try:
        items = listed(value)
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


def auto_or(value, parse):
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


class Kit(BaseModel):
    """A command's settings, each declared once with setting(): coerced and checked by
    pydantic from flags, a YAML file or Python; a bad value is a ConfigError naming the
    setting. Frozen: a stage receives them whole and cannot change them under another.
    A subclass adds its cross-setting checks in _check_more (or _check, calling super())."""
    model_config = ConfigDict(extra="forbid", frozen=True)

    def __init__(self, **values):
        try:
            super().__init__(**values)
        except ValidationError as e:
            raise ConfigError(_message(e)) from None

    def to_dict(self) -> dict:
        """The settings as JSON values (manifests, run.json)."""
        return self.model_dump(mode="json")

    @model_validator(mode="after")
    def _validate(self):
        for name, info in type(self).model_fields.items():
            allowed = _choices(info)
            value = getattr(self, name)
            if allowed is not None and value not in allowed:
                raise ConfigError(f"{name} must be one of {', '.join(map(str, allowed))}, "
                                  f"not {shown(value)}")
        self._check()
        self._check_more()
        return self

    def _check(self) -> None:
        """The checks of the settings a mixin declares (each calls super()._check())."""

    def _check_more(self) -> None:
        """A command's own cross-setting checks."""


class Corpus(Kit):
    """Where the rows come from and how a row becomes an example (the job, the evaluation,
    the loop's question sets, the saliency page)."""

    input: list[str] = setting(
        ["demo"], "corpus files or folders: s3://…, gs://…, file://…, a local path, "
        "hf://owner/name[:config][@split], or demo[:N]", group="input", metavar="URI", many=True)
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

    def _check(self) -> None:
        super()._check()
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


class Model(Kit):
    """The model every command that loads one takes."""

    model: str = setting("smollm2-135m-instruct",
                         "hub id, local folder, .gguf file or smollm2-135m-instruct",
                         group="scoring", metavar="SPEC")
    dtype: str = setting("float32", "model precision; float32 is the paper's", group="scoring",
                         choices=DTYPES)


class RemoteCode(Kit):
    """Whether transformers may run a model's own Python code (the job, the loop)."""

    trust_remote_code: bool = setting(
        False, "let transformers run Python code shipped with the model or tokenizer (off by "
        "default: a hub repository's code would run on every worker)", group="scoring")


class Ray(Kit):
    """The Ray cluster a command joins, and how much of Ray's own output it shows."""

    address: str | None = setting(
        None, "Ray cluster to join, e.g. auto for one started with `ray start` on this "
        "machine (default: $RAY_ADDRESS, which `ray job submit` sets; else a new local Ray "
        "for this run)", group="resources", metavar="ADDR", shown="")
    verbose: bool = setting(
        False, "also show Ray's and Ray Data's own output: their status blocks, the workers' "
        "model-loading bars and library warnings (otherwise only in Ray's session logs, "
        "/tmp/ray/session_latest/logs)", group="output")


class Replicas(Model, Ray):
    """The model's replicas: Ray actors, each with one copy (the job, the evaluation, the
    loop's generate and solve)."""

    actors: tuple[int, int] = setting(
        (1, 1), "scoring actors, each with one model replica; MIN,MAX autoscales",
        group="resources", metavar="N|MIN,MAX", shown="1")
    cpus_per_actor: float = setting(1.0, "CPUs per actor, also its torch threads on CPU",
                                    group="resources", metavar="C")
    gpus_per_actor: float | None = setting(
        None, "GPUs per actor; auto: 1 if the cluster has GPUs now, else 0 (CPU actors). "
        "Give 1 on an autoscaling GPU cluster", group="resources", metavar="G", shown="auto")

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
        gpus = auto_or(v, float)
        if gpus is not None and not gpus >= 0:
            raise ConfigError("gpus_per_actor must be >= 0 or auto")
        return gpus

    def _check(self) -> None:
        super()._check()
        if not self.cpus_per_actor > 0:
            raise ConfigError("cpus_per_actor must be > 0")


class Chains(Kit):
    """How chains are scored and pruned: the prompt template, MIST's α, the budgets."""

    template: str = setting(
        "auto", "prompt template; think puts the chain in the chat template's thinking block "
        "(Qwen3, DeepSeek-R1 distills); auto: think where the chat template has a thinking "
        "block, else chat, else plain", group="scoring",
        choices=TEMPLATES)
    alpha: float = setting(ALPHA, "MIST's necessity weight, in [0, 1]", group="scoring")
    budgets: list[float] = setting(DEFAULT_BUDGETS, "retention budgets γ, comma-separated",
                                   group="scoring", metavar="LIST")

    @field_validator("budgets", mode="before")
    @classmethod
    def _budgets(cls, v):
        return check_budgets(v)

    def _check(self) -> None:
        super()._check()
        if not 0.0 <= self.alpha <= 1.0:
            raise ConfigError("alpha must lie in [0, 1]")


class Settings(Chains, Replicas, Corpus):
    """The settings the compression job and the evaluation share: the corpus, the model,
    the actors, and how chains are scored and pruned."""


def check_budgets(v) -> list[float]:
    """Budgets as a sorted list without repeats, each in (0, 1]."""
    budgets = parse_floats(v)
    if not budgets or any(not 0.0 < b <= 1.0 for b in budgets):  # NaN fails this too
        raise ConfigError(f"budgets must lie in (0, 1], got {shown(budgets)}")
    return sorted(set(budgets))


def positive(*names: str):
    """A validator: these integer settings must be at least 1 where given."""
    def check(cls, v, info):
        if v is not None and v < 1:
            raise ConfigError(f"{info.field_name} must be at least 1")
        return v
    return field_validator(*names)(classmethod(check))


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


def build_parser(kind: type[Kit], prog: str, description: str, epilog: str = ""
                 ) -> argparse.ArgumentParser:
    """The command line of a settings class: a flag per setting (--batch-size for
    batch_size), in its group, with its help, choices and default; --config FILE for YAML.
    Values stay strings here: the settings class coerces and checks them."""
    p = argparse.ArgumentParser(prog=prog, description=description, epilog=epilog,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                argument_default=argparse.SUPPRESS)
    p.add_argument("--config", metavar="FILE", help="YAML file of settings (flags override it)")
    groups = {g: p.add_argument_group(g) for g in GROUPS}  # argparse leaves empty ones out
    for name, info in kind.model_fields.items():
        extra = _extra(info)
        help = (info.description or "").replace("%", "%%")
        shown = "" if info.is_required() or info.default is False else _shown(info)
        if shown:
            help += f" (default: {shown})"
        elif info.is_required() and not extra.get("positional"):
            help += " (required)"
        kwargs: dict[str, Any] = {"help": help}
        choices = extra.get("choices")
        if info.annotation is bool:  # one on by default is turned off by --no-<flag>
            kwargs["action"] = argparse.BooleanOptionalAction if info.default else "store_true"
        elif isinstance(choices, tuple):
            kwargs["choices"] = tuple(c for c in choices if c is not None) + (
                tuple(SFT_ALIASES) if name == "sft_format" else ())  # None: the flag not given
        else:
            kwargs["metavar"] = extra.get("metavar")
        if extra.get("many") == "repeat":
            kwargs["action"] = "append"
        elif extra.get("many"):
            kwargs["nargs"] = "+"
            if not extra.get("positional"):
                kwargs["action"] = "extend"
        group = extra["group"]
        if group not in groups:
            groups[group] = p.add_argument_group(group)
        if extra.get("positional"):
            kwargs["metavar"] = kwargs.get("metavar") or name.upper()
            groups[group].add_argument(name, **kwargs)
        else:
            flag = extra.get("flag") or name.replace("_", "-")
            groups[group].add_argument("--" + flag, dest=name, **kwargs)
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


def from_mapping(values: dict, base: Kit | None = None, kind: type[Kit] | None = None) -> Kit:
    """Settings from a mapping of setting -> value (YAML or flags), over `base`'s."""
    if kind is None and base is None:
        raise TypeError("from_mapping needs a settings class (kind) or settings to start from")
    kind = kind or type(base)
    names = set(kind.model_fields)
    merged = base.model_dump() if base is not None else {}
    for key, value in values.items():
        name = key.replace("-", "_") if isinstance(key, str) else None  # YAML: 1:, ~:
        if name not in names:
            raise ConfigError(f"unknown setting {shown(key)}; known: {', '.join(sorted(names))}")
        merged[name] = value
    return kind(**merged)


def parse(kind: type[Kit], argv: list[str] | None, prog: str, description: str,
          epilog: str = "") -> Kit:
    """Defaults, then --config's YAML, then the flags given."""
    args = vars(build_parser(kind, prog, description, epilog).parse_args(argv))
    values = load_yaml(args.pop("config")) if "config" in args else {}
    values = {k.replace("-", "_") if isinstance(k, str) else k: v for k, v in values.items()}
    return from_mapping({**values, **args}, kind=kind)


def validate(cfg: Kit) -> Kit:
    """The same settings, checked again (constructing them already checks them)."""
    return type(cfg)(**cfg.model_dump())
