"""Every reason a row or chain is rejected for, declared once with its words: the library's
InvalidExample refuses an undeclared one, the job's rejects/ use these codes, and the table of
reasons in docs/guide/guarantees.md is generated from this module (a test checks it is current)."""
from __future__ import annotations

_TEXT_FIELDS = ("question", "cot", "answer", "solution")

# Where each reason is decided: the guide's table names the file, so that a reader finds
# in one step where a row is rejected (a test checks that each file names its reasons).
ROWS = "pipelines/common/rows.py"  # a raw corpus row read (the job, the evaluation, the loop)
STAGES = "pipelines/job/stages.py"  # the job's stages: duplicates, score, prune
FIELDS = "mist_core/data/fields.py"  # a row's fields, as the adapters read them
ADAPTERS = "mist_core/data/examples.py"  # the adapters: an example's texts
LONGCOT = "mist_core/data/longcot.py"  # the long-CoT adapters
TEMPLATES = "mist_core/data/templates.py"  # tokenizing in the model's prompt template
SCORER = "mist_core/scoring/scorer.py"
WHERE: dict[str, str] = {}


def _declare(where: str, reasons: dict[str, str]) -> dict[str, str]:
    WHERE.update(dict.fromkeys(reasons, where))
    return reasons


# code -> what it means, in the words a rejects/ row's `detail` falls back to
INPUT = {
    # reading a file
    **_declare(ROWS, {
        "unreadable_file": "the file could not be read or parsed (the rows before the damage "
                           "are kept)",
        "invalid_utf8": "the line is not valid UTF-8",
        "invalid_json": "the line is not valid JSON, or is nested too deeply",
        "not_an_object": "the line is JSON but not an object",
        "lone_surrogate": "a text holds a lone UTF-16 surrogate, which Arrow cannot write",
        "column_collision": "two extra columns would pass through under one name (budget is "
                            "written as input_budget, and the row has that column too)"}),
    # a row's fields, as the adapter reads them
    **_declare(FIELDS, {
        "missing_column": "none of the columns the adapter reads for a field is in the row",
        "empty_id": "the id column is empty"}),
    **_declare(ADAPTERS, {
        **{f"{f}_not_string": f"{f} is not a string" for f in _TEXT_FIELDS},
        **{f"empty_{f}": f"{f} is empty or only whitespace" for f in _TEXT_FIELDS},
        **{f"null_byte_in_{f}": f"{f} contains a NUL character (U+0000)" for f in _TEXT_FIELDS},
        "id_not_string": "the id column is neither a string nor an integer"}),
    **_declare(STAGES, {"duplicate_id": "the id repeats an earlier row's in this input"}),
    **_declare(ADAPTERS, {
        "no_final_answer": "the solution has no final answer (GSM8K's '####' line, a "
                           "\\boxed{…})"}),
    # long-CoT corpora
    **_declare(LONGCOT, {
        "no_thinking_block": "no </think> or <|end_of_thought|> closes a thinking block",
        "no_correct_generation": "none of the row's generations is marked correct",
        "malformed_generations": "generations or their per-generation flags have the wrong "
                                 "shape",
        "malformed_conversations": "conversations is not one (system,) user, assistant exchange",
        "malformed_messages": "messages is not one (system,) user, assistant exchange"}),
    # tokenizing for the model
    **_declare(TEMPLATES, {
        "cot_no_tokens": "the chain tokenizes to nothing",
        "answer_no_tokens": "the answer tokenizes to nothing",
        "span_overlap": "the chain and the answer share a token",
        "too_long": "the chain, question and answer exceed the model's context"}),
    # scoring
    **_declare(SCORER, {
        "too_long_for_memory": "the chain cannot be scored within --max-memory even alone"}),
}
# The job's or the model's failures on a row that was fine as far as anyone can tell: they
# count against --max-error-share, and a later run redoes them.
FAILURES = _declare(STAGES, {
    "score_error": "the scorer raised",
    "nonfinite_scores": "the model gave NaN or inf (log-likelihoods, gradients or raw axes)",
    "prune_error": "pruning raised",
    "unexpected_error": "validating or tokenizing raised (a bug, not a reason)",
})
REASONS = {**INPUT, **FAILURES}
FAILURE_REASONS = frozenset(FAILURES)


def check(reason: str) -> str:
    if reason not in REASONS:
        raise ValueError(f"undeclared reject reason {reason!r}: declare it in mist_core/reasons.py")
    return reason


def words(reason: str) -> str:
    """The sentence for a reason whose error came without a detail."""
    return REASONS.get(reason, reason.replace("_", " "))


def markdown_table() -> str:
    """The table of reasons in docs/guide/guarantees.md."""
    rows = ["| reason | meaning | decided in | counts against `--max-error-share` |",
            "|---|---|---|---|"]
    rows += [f"| `{r}` | {m.replace('<', '&lt;').replace('|', chr(92) + '|')} | "
             f"`{WHERE[r]}` | {'yes' if r in FAILURES else 'no'} |" for r, m in REASONS.items()]
    return "\n".join(rows) + "\n"
