"""The errors the commands raise on purpose, and the chain of causes an error came with
(Ray Data wraps an actor's error in its own). What each becomes at the exit, one `error:`
line and an exit status, is exits.py's policy.

Light on purpose (the standard library only): the settings and storage modules import this
one, and `mist --help` or `report` must not wait for torch."""
from __future__ import annotations

import re


class ConfigError(ValueError):
    """Settings that cannot run: the message says which and why."""


class OutputBusy(ConfigError):
    """Another run holds the output's lease (job/lease.py): this one refuses before work."""


class AccountingError(RuntimeError):
    """The counts of a run do not add up: rows were lost or duplicated."""


class ErrorBudgetExceeded(RuntimeError):
    """More rows failed (reasons.FAILURE_REASONS) than --max-error-share allows: the run
    fails without a manifest (exit status 5), and a rerun redoes the failed rows."""


class ModelLoadError(RuntimeError):
    """The model's weights could not be loaded in an actor (its tokenizer could)."""


def causes(e: BaseException) -> list[BaseException]:
    """`e` and what caused it, outermost first (Ray Data wraps an actor's error in its own)."""
    out = []
    while e is not None and all(e is not seen for seen in out):
        out.append(e)
        inner = getattr(e, "cause", None)
        e = inner if isinstance(inner, BaseException) else (e.__cause__ or e.__context__)
    return out


def model_load_message(e: BaseException) -> str | None:
    """The message if `e` is a ModelLoadError, or reports one: Ray reports an actor whose
    constructor raised as ActorDiedError, with the original error only as text."""
    if isinstance(e, ModelLoadError):
        return str(e)
    found = re.search(r"ModelLoadError: (.+)", str(e))
    return found.group(1).strip() if found else None
