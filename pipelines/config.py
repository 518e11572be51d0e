"""The job's settings: one dataclass, filled from defaults, then a YAML file (--config), then
command-line flags, each later source overriding the earlier. YAML keys are the flag names
(`batch_size` or `batch-size`)."""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field

import yaml

from .errors import ConfigError

DEFAULT_BUDGETS = [0.5, 0.6, 0.7, 0.8, 0.9]
DTYPES = ("float32", "bfloat16", "float16", "float64")
DEVICES = ("auto", "cpu", "cuda")


@dataclass
class JobConfig:
    input: list[str] = field(default_factory=lambda: ["demo"])
    format: str = "auto"
    adapter: str = "generic"
    columns: dict[str, str] = field(default_factory=dict)
    output: str = "outputs/demo"
    mode: str = "refresh"
    limit: int | None = None
    model: str = "smollm2-135m-instruct"
    method: str = "mist"
    alpha: float = 0.6
    budgets: list[float] = field(default_factory=lambda: list(DEFAULT_BUDGETS))
    unit: str = "word"
    keep_digits: bool = False
    template: str = "auto"
    dtype: str = "float32"
    trust_remote_code: bool = False
    batch_size: int = 32
    batch_tokens: int | str = "auto"  # auto: from max_memory where there is one, else 4096
    max_memory: int | None = None  # bytes per scoring actor beyond the model; None: auto
    actors: tuple[int, int] = (1, 1)
    gpus_per_actor: float | None = None  # None: 1 when the cluster has GPUs, else 0
    # Where the scoring actors run the model. auto: cuda where Ray gives an actor a GPU
    # (gpus_per_actor > 0), else cpu; cpu also on GPU-placed actors; cuda or exit status 2.
    device: str = "auto"
    cpus_per_actor: float = 1.0
    scores: bool = False
    rows_per_file: int = 512
    sft_format: str = "prompt-completion"
    sft_mix: str = "sample"
    seed: int = 0
    # The share of the rows read that may fail (mist_core/reasons.py FAILURES: the scorer or
    # the model failed, not the input) before the run fails with exit status 5.
    max_error_share: float = 0.0
    # Seconds between the driver's progress lines while scoring (placement.Progress); 0: none.
    progress_interval: float = 10.0
    address: str | None = None

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["actors"] = list(self.actors)
        return d


def parse_floats(value) -> list[float]:
    items = value.split(",") if isinstance(value, str) else list(value)
    try:
        return [float(v) for v in items if str(v).strip()]
    except ValueError:
        raise ConfigError(f"budgets must be numbers like 0.5,0.7, not {value!r}") from None


def parse_actors(value) -> tuple[int, int]:
    if isinstance(value, int):
        items = [value]
    elif isinstance(value, str):
        items = value.split(",")
    else:
        items = list(value)
    try:
        nums = [int(v) for v in items]
    except ValueError:
        raise ConfigError(f"actors must be N or MIN,MAX, not {value!r}") from None
    if len(nums) not in (1, 2):
        raise ConfigError(f"actors must be N or MIN,MAX, not {value!r}")
    return (nums[0], nums[-1])


def parse_columns(value) -> dict[str, str]:
    if isinstance(value, dict):
        return {str(k): str(v) for k, v in value.items()}
    out = {}
    for part in str(value).split(","):
        if part.strip():
            key, sep, col = part.partition("=")
            if not sep:
                raise ConfigError(f"columns must look like question=q,cot=c,answer=a,id=i, "
                                  f"not {value!r}")
            out[key.strip()] = col.strip()
    return out


def _inputs(value) -> list[str]:
    return [value] if isinstance(value, str) else [str(v) for v in value]


def _gpus(value) -> float | None:
    return None if value in (None, "auto") else float(value)


def _bool(value) -> bool:
    if isinstance(value, str):
        return value.lower() in ("1", "true", "yes", "on")
    return bool(value)


def _tokens(value) -> int | str:
    return "auto" if str(value).strip().lower() == "auto" else int(value)


def _memory(value) -> int | None:
    from mist_core.memory import parse_bytes

    return parse_bytes(value)


def _opt_int(value) -> int | None:
    return None if value is None else int(value)


_PARSE = {"input": _inputs, "budgets": parse_floats, "actors": parse_actors,
          "columns": parse_columns, "gpus_per_actor": _gpus, "keep_digits": _bool,
          "scores": _bool, "trust_remote_code": _bool, "limit": _opt_int, "alpha": float,
          "batch_size": int, "rows_per_file": int, "batch_tokens": _tokens,
          "max_memory": _memory,
          "cpus_per_actor": float, "seed": int, "max_error_share": float,
          "progress_interval": float}


def _coerce(key: str, value):
    try:
        return _PARSE.get(key, lambda v: v if v is None else str(v))(value)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{key}: {e}") from None


def from_mapping(values: dict, base: JobConfig | None = None) -> JobConfig:
    """A config from a mapping of setting -> value (YAML or flags), over `base`."""
    names = {f.name for f in dataclasses.fields(JobConfig)}
    cfg = dataclasses.replace(base) if base else JobConfig()
    for key, value in values.items():
        name = key.replace("-", "_")
        if name not in names:
            raise ConfigError(f"unknown setting {key!r}; known: {', '.join(sorted(names))}")
        setattr(cfg, name, _coerce(name, value))
    return cfg


def load_yaml(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            values = yaml.safe_load(f) or {}
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
    if not isinstance(values, dict):
        raise ConfigError(f"config file {path} must hold a mapping of settings")
    return values


def validate(cfg: JobConfig) -> JobConfig:
    from mist_core import scorer_names
    from mist_core.examples import ADAPTERS
    from mist_core.formats import SFT_FORMATS, SFT_MIXES, sft_format_name
    from mist_core.templates import TEMPLATES

    def one_of(name, allowed):
        if getattr(cfg, name) not in allowed:
            raise ConfigError(f"{name} must be one of {', '.join(allowed)}, "
                              f"not {getattr(cfg, name)!r}")

    one_of("format", ("auto", "jsonl", "parquet"))
    one_of("adapter", ADAPTERS)
    one_of("mode", ("refresh", "overwrite"))
    one_of("unit", ("word", "token"))
    one_of("template", TEMPLATES)
    one_of("dtype", DTYPES)
    one_of("device", DEVICES)
    cfg.sft_format = sft_format_name(cfg.sft_format)  # `chat`, the earlier name of messages
    one_of("sft_format", SFT_FORMATS)
    one_of("sft_mix", SFT_MIXES)
    one_of("method", tuple(scorer_names()))
    if not cfg.input:
        raise ConfigError("give at least one --input")
    if not cfg.budgets or any(not 0.0 < b <= 1.0 for b in cfg.budgets):
        raise ConfigError(f"budgets must lie in (0, 1], got {cfg.budgets}")
    cfg.budgets = sorted(set(cfg.budgets))
    if cfg.columns:
        if cfg.adapter != "generic":
            raise ConfigError("columns maps the generic adapter's columns; the other "
                              "adapters read their corpus's own column names")
        bad = set(cfg.columns) - {"question", "cot", "answer", "id"}
        if bad:
            raise ConfigError(f"columns keys must be question, cot, answer or id, not {sorted(bad)}")
    lo, hi = cfg.actors
    if lo < 1 or hi < lo:
        raise ConfigError(f"actors must be N >= 1 or MIN,MAX with 1 <= MIN <= MAX, got {lo},{hi}")
    for name in ("batch_size", "rows_per_file"):
        if getattr(cfg, name) < 1:
            raise ConfigError(f"{name} must be at least 1")
    if cfg.batch_tokens != "auto" and cfg.batch_tokens < 1:
        raise ConfigError("batch_tokens must be at least 1 or auto")
    if cfg.max_memory is not None and cfg.max_memory < 1:
        raise ConfigError(f"max_memory must be a positive size, got {cfg.max_memory} bytes")
    if cfg.limit is not None and cfg.limit < 1:
        raise ConfigError("limit must be at least 1")
    if cfg.gpus_per_actor is not None and cfg.gpus_per_actor < 0:
        raise ConfigError("gpus_per_actor must be >= 0 or auto")
    if cfg.device == "cuda" and cfg.gpus_per_actor == 0:
        raise ConfigError("device cuda needs a GPU for each scoring actor: give "
                          "--gpus-per-actor 1 (or auto on a cluster with GPUs), or --device cpu")
    if cfg.cpus_per_actor <= 0:
        raise ConfigError("cpus_per_actor must be > 0")
    if not 0.0 <= cfg.alpha <= 1.0:
        raise ConfigError("alpha must lie in [0, 1]")
    if not 0.0 <= cfg.max_error_share <= 1.0:  # NaN fails this too
        raise ConfigError(f"max_error_share must lie in [0, 1], not {cfg.max_error_share}")
    if not 0.0 <= cfg.progress_interval < float("inf"):  # NaN fails this too
        raise ConfigError(f"progress_interval must be 0 (off) or a number of seconds, "
                          f"not {cfg.progress_interval}")
    return cfg


DESCRIPTION = """\
Compress reasoning chains with MIST, as a Ray Data job.

Reads corpora (JSONL or parquet, local or in object storage, or a Hugging Face split),
scores every chain with a model (one replica per actor; one GPU each on a GPU cluster),
prunes each chain to every budget, and writes under --output:
  data/     parquet, one row per (example, budget): the compressed chain and its counts
  sft/      JSONL training data mixing the budgets and the full chain
  scores/   per-token scores (with --scores)
  rejects/  every input row that could not be used, with its reason
  _manifest.json   written last: settings, versions, counts, timings

With no arguments it runs the built-in demo on this machine: 48 generated arithmetic
problems, SmolLM2-135M-Instruct, output in ./outputs/demo.
Running again onto the same --output (mode refresh) scores only rows not yet there."""

EPILOG = """\
examples:
  python -m pipelines.compress                       # the demo, end to end
  python -m pipelines.compress --input ../shared/data/gsm8k/test.jsonl --adapter gsm8k \\
      --output outputs/gsm8k --limit 100
  python -m pipelines.compress --input s3://bucket/corpora/math/ --adapter math \\
      --output s3://bucket/mist/math --model Qwen/Qwen2.5-1.5B-Instruct \\
      --actors 1,4 --gpus-per-actor 1 --scores
  python -m pipelines.compress --config refresh.yaml   # keys as below, e.g. batch_size: 32

exit status: 0 done, 2 bad settings, input or model, 3 counts did not reconcile, 4 storage
unavailable (retried for MIST_STORAGE_RETRY_S seconds, default 60; rerun to resume),
5 more rows failed than --max-error-share allows (no manifest; rerun after the fix redoes
them), 1 other failure."""


def build_parser(prog: str = "python -m pipelines.compress") -> argparse.ArgumentParser:
    from mist_core.examples import ADAPTERS
    from mist_core.templates import TEMPLATES

    d = JobConfig()
    p = argparse.ArgumentParser(prog=prog, description=DESCRIPTION, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                argument_default=argparse.SUPPRESS)
    p.add_argument("--config", metavar="FILE", help="YAML file of settings (flags override it)")

    g = p.add_argument_group("input")
    g.add_argument("--input", nargs="+", action="extend", metavar="URI",
                   help="corpus files or folders: s3://…, gs://…, file://…, a local path, "
                        "hf://owner/name[:config][@split], or demo[:N] (default: demo)")
    g.add_argument("--format", choices=("auto", "jsonl", "parquet"),
                   help="file format; auto goes by the file name (default: auto)")
    g.add_argument("--adapter", choices=ADAPTERS,
                   help="how a row becomes (question, chain, answer): gsm8k splits the "
                        "solution at ####, math takes the last \\boxed{}; long-CoT corpora "
                        "(chain = the thinking block): openr1 (one example per correct "
                        "generation), openthoughts (also Bespoke-Stratos), s1k, messages "
                        "(chat rows); generic reads three "
                        "columns (default: generic)")
    g.add_argument("--columns", metavar="MAP",
                   help="generic adapter's columns, e.g. question=prompt,cot=reasoning,"
                        "answer=final,id=uid (default: question, cot, answer, id)")
    g.add_argument("--limit", type=int, metavar="N", help="read only the first N rows")

    g = p.add_argument_group("output")
    g.add_argument("--output", metavar="URI", help=f"output folder (default: {d.output})")
    g.add_argument("--mode", choices=("refresh", "overwrite"),
                   help="refresh: add only rows not yet in the output; overwrite: delete the "
                        "job's earlier output first (default: refresh)")
    g.add_argument("--scores", action="store_true", help="also write per-token scores to scores/")
    g.add_argument("--rows-per-file", type=int, metavar="N",
                   help="input rows per group of output files; a group is the unit a crashed "
                        f"run keeps (default: {d.rows_per_file})")
    g.add_argument("--sft-format", choices=("prompt-completion", "messages", "alpaca",
                                            "tokenskip", "chat"),
                   help="prompt-completion: TRL's conversational {prompt, completion} (the "
                        "loss on the completion only); messages: {messages: [user, "
                        "assistant]} (chat: its earlier name); alpaca: LLaMA-Factory "
                        "{instruction, input, output}; tokenskip: TokenSkip's alpaca records "
                        "with {question}<|eot_id|>{γ}<|eot_id|>. Below γ = 1 the user turn "
                        "asks to reduce (1-γ)%% of the tokens; messages, alpaca and tokenskip "
                        "also write LLaMA-Factory's dataset_info.json (default: "
                        "prompt-completion)")
    g.add_argument("--sft-mix", choices=("sample", "all"),
                   help="sample: one record per example, γ drawn uniformly from the budgets "
                        "and 1.0; all: one record per γ (default: sample)")
    g.add_argument("--max-error-share", type=float, metavar="F",
                   help="the share of the rows read (0 to 1) that may fail for the job's or "
                        "the model's fault (score_error, nonfinite_scores, prune_error, "
                        "unexpected_error; bad input never counts) before the run fails "
                        "with exit status 5 and no manifest, stopping early where it can; "
                        "a rerun redoes the failed rows (default: 0)")

    g = p.add_argument_group("scoring")
    g.add_argument("--model", metavar="SPEC",
                   help=f"hub id, local folder, .gguf file or {d.model} (default)")
    g.add_argument("--method", metavar="NAME",
                   help="mist (default) or a baseline: uniform, perplexity, attention_rollout, "
                        "h2o, gogi_l1, necessity, sufficiency")
    g.add_argument("--alpha", type=float, help="MIST's necessity weight (default: 0.6)")
    g.add_argument("--budgets", metavar="LIST",
                   help="retention budgets γ, comma-separated (default: 0.5,0.6,0.7,0.8,0.9)")
    g.add_argument("--unit", choices=("word", "token"),
                   help="prune whole words or single tokens (default: word)")
    g.add_argument("--keep-digits", action="store_true",
                   help="always keep tokens with digits (may exceed the budget)")
    g.add_argument("--template", choices=TEMPLATES,
                   help="prompt template; think puts the chain in the chat template's "
                        "thinking block (Qwen3, DeepSeek-R1 distills) (default: auto: think "
                        "where the chat template has a thinking block, else chat, else plain)")
    g.add_argument("--dtype", choices=DTYPES, help="model precision (default: float32, as the paper)")
    g.add_argument("--trust-remote-code", action="store_true",
                   help="let transformers run Python code shipped with the model or tokenizer "
                        "(off by default: a hub repository's code would run on every worker)")

    g = p.add_argument_group("resources")
    g.add_argument("--batch-size", type=int, metavar="N",
                   help="chains per forward pass; a scoring actor takes 8 times as many rows "
                        f"per call and packs them by length (default: {d.batch_size})")
    g.add_argument("--batch-tokens", metavar="N|auto",
                   help="padded tokens per forward pass; each call's rows are grouped by "
                        "length to fill it. auto: as many as --max-memory holds, else 4096 "
                        f"(default: {d.batch_tokens})")
    g.add_argument("--max-memory", metavar="SIZE",
                   help="memory each scoring actor's passes may take beyond the model, e.g. "
                        "6GB; the scorer picks batch sizes and recomputation within it and "
                        "rejects a chain that cannot fit alone (too_long_for_memory). "
                        "Default: 90%% of the GPU's free memory once the model is loaded; "
                        "on CPU 60%% of the memory available when the actor starts")
    g.add_argument("--actors", metavar="N|MIN,MAX",
                   help="scoring actors, each with one model replica; MIN,MAX autoscales "
                        "(default: 1)")
    g.add_argument("--gpus-per-actor", metavar="G",
                   help="GPUs per actor; auto: 1 if the cluster has GPUs now, else 0 (CPU "
                        "actors). Give 1 on an autoscaling GPU cluster. (default: auto)")
    g.add_argument("--device", choices=("auto", "cpu", "cuda"),
                   help="where the scoring actors run the model: auto: cuda where Ray gives "
                        "an actor a GPU (--gpus-per-actor above 0), else cpu; cpu: on the CPU "
                        "even on GPU-placed actors (GPU placement tested without GPUs); cuda: "
                        "on the actor's GPU, an error where it has none (default: auto)")
    g.add_argument("--cpus-per-actor", type=float, metavar="C",
                   help="CPUs per actor, also its torch threads on CPU (default: 1)")
    g.add_argument("--seed", type=int, help="seed of the SFT budget draw (default: 0)")
    g.add_argument("--progress-interval", type=float, metavar="SECONDS",
                   help="print a progress line every SECONDS while scoring: chains scored "
                        "of those planned, chains/s, ETA, rejects so far; 0: none "
                        f"(default: {d.progress_interval:g})")
    g.add_argument("--address", metavar="ADDR",
                   help="Ray cluster to join, e.g. auto for one started with `ray start` "
                        "on this machine (default: $RAY_ADDRESS, which `ray job submit` sets; "
                        "else a new local Ray for this run)")
    return p


def parse_args(argv: list[str] | None = None, prog: str = "python -m pipelines.compress") -> JobConfig:
    args = vars(build_parser(prog).parse_args(argv))
    cfg = JobConfig()
    if "config" in args:
        cfg = from_mapping(load_yaml(args.pop("config")), cfg)
    return validate(from_mapping(args, cfg))
