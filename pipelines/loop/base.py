"""What the distillation loop's commands share (`mist generate`, `mist train`, `mist solve`):
reading a question set with the compression job's readers and adapters, the model actors'
pool and resources (runtime.py), writing their small outputs, their flags, and the entry
points' one exit-code policy (errors.py: 2 bad settings, input or model; 4 storage)."""
from __future__ import annotations

import io
import json
import logging
from collections import Counter
from dataclasses import dataclass

import pyarrow as pa
import ray

from mist_core.data.examples import stable_id
from mist_core.data.fields import row_id
from mist_core.errors import InvalidExample

from ..common import exits, runtime, storage
from ..common.rows import parse_examples, remote_code_refused
from ..common.settings import Corpus, RemoteCode, Replicas, one_line, positive, setting
from ..common.errors import ConfigError, ModelLoadError
from ..common.sources import check_submitted_paths, read_raw, resolve_inputs

log = logging.getLogger("pipelines.loop.base")

QUESTION_SCHEMA = pa.schema([
    ("input", pa.int64()), ("source", pa.string()), ("row", pa.int64()),
    ("id", pa.string()), ("question", pa.string()), ("answer", pa.string()),
    ("reason", pa.string()),  # set when the row gives no question
])


# ---------------------------------------------------------------- questions

def _generic_question(obj: dict, columns: dict) -> tuple[str, str, str]:
    """(id, question, gold answer) of a generic row: the chain column is not needed (a
    question set has none); an answer stored as a number is taken as its text."""
    q_col, a_col = columns.get("question", "question"), columns.get("answer", "answer")
    question, answer = obj.get(q_col), obj.get(a_col)
    if question is None or answer is None:
        raise InvalidExample("missing_column", f"needs {q_col!r} and {a_col!r}, row has {sorted(obj)}")
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        answer = f"{answer:g}" if isinstance(answer, float) else str(answer)
    if not isinstance(question, str) or not question.strip():
        raise InvalidExample("empty_question" if isinstance(question, str) else "question_not_string")
    if not isinstance(answer, str) or not answer.strip():
        raise InvalidExample("empty_answer" if isinstance(answer, str) else "answer_not_string")
    rid = row_id(obj, columns.get("id", "id"))
    return rid or stable_id(question, "", answer), question, answer.strip()


def question_batch(batch: pa.Table, *, adapter: str, columns: dict) -> pa.Table:
    """Raw rows -> (id, question, gold answer), or the reason a row gives none. Adapters
    other than generic go through the compression job's own parsing (GSM8K's answer after
    `####`, MATH's last \\boxed{}); a row that fans out (openr1) gives its first example."""
    out = []
    for rec in batch.to_pylist():
        row = {"input": rec["input"], "source": rec["source"], "row": rec["row"],
               "id": None, "question": None, "answer": None, "reason": None}
        try:
            if rec.get("error") is not None:
                raise InvalidExample("unreadable_file", rec["error"])
            if adapter == "generic":
                obj = json.loads(rec["raw"].decode("utf-8"))
                if not isinstance(obj, dict):
                    raise InvalidExample("not_an_object")
                row["id"], row["question"], row["answer"] = _generic_question(obj, columns)
            else:
                examples, _ = parse_examples(rec["raw"], adapter, columns)
                ex = examples[0]
                row["id"], row["question"], row["answer"] = ex.key, ex.question, ex.answer
        except InvalidExample as e:
            row["reason"] = e.reason
        except (UnicodeDecodeError, json.JSONDecodeError):
            row["reason"] = "invalid_json"
        out.append(row)
    return pa.Table.from_pylist(out, schema=QUESTION_SCHEMA)


def read_questions(uris: list[str], *, fmt: str, adapter: str, columns: dict,
                   limit: int | None) -> tuple[list[dict], dict]:
    """The question set, in input order (inputs as given, files by name, rows by number):
    the first `limit` usable rows, repeated ids dropped. Returns the rows (id, question,
    answer) and counts: rows read, used, and skipped by reason."""
    try:
        inputs = resolve_inputs(uris, fmt)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    ds = read_raw(inputs).map_batches(question_batch, batch_format="pyarrow",
                                      fn_kwargs={"adapter": adapter, "columns": columns})
    tables = list(ds.iter_batches(batch_format="pyarrow", batch_size=None))
    table = pa.concat_tables(tables) if tables else QUESTION_SCHEMA.empty_table()
    table = table.sort_by([("input", "ascending"), ("source", "ascending"), ("row", "ascending")])
    rows, seen, skipped = [], set(), Counter()
    for r in table.to_pylist():
        if r["reason"] is not None:
            skipped[r["reason"]] += 1
        elif r["id"] in seen:
            skipped["duplicate_id"] += 1
        elif limit is None or len(rows) < limit:
            seen.add(r["id"])
            rows.append({"id": r["id"], "question": r["question"], "answer": r["answer"]})
    counts = {"rows_read": table.num_rows, "questions": len(rows),
              "skipped_by_reason": dict(sorted(skipped.items()))}
    if not rows:
        raise ConfigError(f"no usable question in {', '.join(map(storage.redact, uris))} "
                          f"with --adapter {adapter} (skipped: {counts['skipped_by_reason']})")
    return rows, counts


# ---------------------------------------------------------------- Ray and the model actors

def cluster_gpus() -> float:
    return ray.cluster_resources().get("GPU", 0)


def actor_pool(actors: tuple[int, int], cpus: float, gpus: float | None) -> tuple[object, dict]:
    """(compute strategy, resources) for model actors: one replica each, a GPU each where
    the cluster has GPUs (gpus None: auto)."""
    return runtime.actor_pool(actors), runtime.actor_resources(cpus, runtime.gpus_per_actor(gpus))


def load_lm(model: str, dtype: str, device: str, threads: int | None,
            trust_remote_code: bool = False):
    """A model replica for an actor; a failure becomes one line for the driver (exit 2)."""
    import torch

    from mist_core import load_model

    if device == "cpu" and threads:
        torch.set_num_threads(threads)
    try:
        return load_model(model, dtype=dtype, device=device, trust_remote_code=trust_remote_code)
    except Exception as e:
        raise ModelLoadError(f"an actor could not load --model {model}: "
                                    f"{type(e).__name__}: {e}") from e


def check_model(model: str, trust_remote_code: bool = False) -> str:
    """The model's display name, its config and tokenizer loaded here first: a wrong
    --model fails before Ray or any actor starts, with a plain message (the config too: a
    tokenizer may load where the model's own code is refused). trust_remote_code is passed
    as False, never left unset: unset, transformers asks on stdin whether to run a model
    folder's code, and a `y` there (or `yes |`) would run it."""
    from transformers import AutoConfig, AutoTokenizer

    from mist_core.models import check_reachable, resolve

    try:
        check_reachable(model)
        source, name = resolve(model)
        AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code)
        AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise (remote_code_refused(model, e) or ConfigError(one_line(
            f"cannot load the tokenizer of --model {model}: {e}"))) from None
    return name


# ---------------------------------------------------------------- outputs

def write_rows(uri: str, rows: list[dict], fmt: str = "jsonl") -> None:
    """A whole JSONL or parquet file at `uri` (local, s3://, gs://), written atomically."""
    fs, path, _ = storage.filesystem(uri)
    if fmt == "parquet":
        storage.write_atomic(fs, path, pa.Table.from_pylist(rows))
    else:
        buf = io.StringIO()
        for r in rows:
            buf.write(json.dumps(r, ensure_ascii=False) + "\n")
        storage.write_atomic(fs, path, buf.getvalue().encode("utf-8"))


def write_json(uri: str, obj: dict) -> None:
    fs, path, _ = storage.filesystem(uri)
    storage.write_atomic(fs, path, (json.dumps(obj, indent=2, ensure_ascii=False) + "\n").encode())


# ---------------------------------------------------------------- command lines

class Questions(Replicas, Corpus, RemoteCode):
    """The settings `mist generate` and `mist solve` share with the compression job (the
    corpus, the model and its actors), and the question set's own."""

    input: list[str] = setting(
        ..., "question set: files or folders (local, s3://, gs://), hf://name[@split] or "
        "demo[:N], read as the compression job reads them", group="input", metavar="URI",
        many=True)
    limit: int | None = setting(None, "the first N questions only", group="input",
                                metavar="N", shown="")
    style: str = setting("auto", "how answers are compared (default: the adapter's; generic: "
                         "gsm8k)", group="input", choices=("auto", "gsm8k", "math"), shown="")
    output: str = setting(..., "folder (local, s3://, gs://) for what the command writes",
                          group="output", metavar="URI")
    max_new_tokens: int = setting(512, "tokens generated per answer at most", group="scoring",
                                  metavar="N")
    batch_size: int = setting(8, "questions per actor call and sequences per forward pass",
                              group="resources", metavar="N")

    _positive_ints = positive("limit", "max_new_tokens", "batch_size")


def style_of(style: str, adapter: str) -> str:
    from mist_core.measures.answers import style_for

    return style_for(adapter) if style == "auto" else style


@dataclass
class Start:
    """What generate and solve know once their settings are checked and Ray is up."""

    name: str  # the model's display name
    style: str  # how answers are compared
    questions: list[dict]
    counts: dict  # the question set's read/valid/rejected counts
    pool: object  # the actors' compute strategy
    resources: dict  # each actor's CPUs and GPUs
    device: str


def start(args: Questions) -> Start:
    """The shared start of a question-set command: paths that ray job submit can reach, the
    model's tokenizer, Ray, the questions, the actors' pool and device."""
    try:
        check_submitted_paths(args.input, args.output)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    name = check_model(args.model, args.trust_remote_code)
    style = style_of(args.style, args.adapter)
    runtime.init_ray(args.address, args.actors, args.cpus_per_actor, args.verbose)
    questions, counts = read_questions(args.input, fmt=args.format, adapter=args.adapter,
                                       columns=args.columns, limit=args.limit)
    pool, resources = actor_pool(args.actors, args.cpus_per_actor, args.gpus_per_actor)
    return Start(name, style, questions, counts, pool, resources,
                 "cuda" if resources.get("num_gpus") else "cpu")


def run_main(run, argv, parse, prog: str) -> int:
    """Parse and run under the entry points' one error policy (errors.run_main): exit 2
    for settings, input or a model that cannot load, 4 for storage that stayed
    unavailable, a one-line `error:` each."""
    exits.setup_logging()
    def body() -> int:
        args = parse(argv, prog)
        with runtime.console(getattr(args, "verbose", False)):
            return run(args)

    return exits.run_main(body)
