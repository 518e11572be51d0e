"""One error policy for every entry point (compress, eval, saliency, generate, train, solve):
what went wrong is said in one `error:` line on stderr and the exit status says its kind.

  0  done
  2  settings, input or model that cannot run (ConfigError, a missing file or dependency,
     an unsupported model, a model that does not load in an actor)
  3  accounting: the counts of a run do not add up (rows lost or duplicated)
  4  storage unreachable past the retries (every file written is whole; rerun to resume)
  5  more rows failed than --max-error-share allows (no manifest; rerun to redo them)
  130  interrupted (Ctrl-C)

Light on purpose (the standard library; torch, Ray and storage only on the error path):
`mist --help` or `report` must not wait for torch. The errors themselves are errors.py's."""
from __future__ import annotations

import logging
import signal
import sys
from typing import Callable

from .errors import AccountingError, ConfigError, ErrorBudgetExceeded, causes, model_load_message

OK, BAD_INPUT, ACCOUNTING, STORAGE, ERROR_BUDGET = 0, 2, 3, 4, 5
INTERRUPTED = 130  # Ctrl-C, as shells report a process that SIGINT ended (128 + 2)


def classify(e: BaseException) -> tuple[int, str] | None:
    """(exit status, the one line to print) for an error the policy knows; None for a bug,
    which keeps its traceback."""
    from mist_core.errors import MissingDependency, UnsupportedModel

    if isinstance(e, (ConfigError, FileNotFoundError, MissingDependency, UnsupportedModel)):
        return BAD_INPUT, str(e)
    if isinstance(e, AccountingError):
        return ACCOUNTING, str(e)
    if isinstance(e, ErrorBudgetExceeded):
        return ERROR_BUDGET, str(e)
    chain = causes(e)
    failure = next(filter(None, map(model_load_message, chain)), None)
    if failure is not None:  # a bad --model: Ray Data gives up at the first actor death
        return BAD_INPUT, failure
    from . import storage  # pyarrow's filesystems: only on the error path

    refused = next(filter(storage.denied, chain), None)
    if isinstance(refused, PermissionError):
        return BAD_INPUT, f"permission denied: {refused}"
    if refused is not None:
        return BAD_INPUT, (f"storage refused access: {storage.one_line(refused).rstrip('.')}; check the "
                           "credentials (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
                           "AWS_PROFILE or the machine's role; GOOGLE_APPLICATION_CREDENTIALS "
                           "for gs://) and the bucket's permissions")
    cause = next(filter(storage.transient, chain), None)
    if cause is not None:
        return STORAGE, (f"storage unavailable: {storage.one_line(cause)}; the run did not "
                         "finish and wrote no manifest: rerun the same command to resume")
    return None


def run_main(body: Callable[[], int], interrupted: str = "interrupted (Ctrl-C)") -> int:
    """Run an entry point's body under the policy: a known error is one line and its exit
    status; Ray, if this process started it, is shut down first so that its shutdown
    messages do not follow ours. Ctrl-C is the line `interrupted` and exit status 130."""
    handler = None
    try:
        return body()
    except KeyboardInterrupt:
        # A second Ctrl-C while Ray shuts down would print the traceback this line replaces.
        try:
            handler = signal.signal(signal.SIGINT, signal.SIG_IGN)
        except ValueError:  # not the main thread: nothing to guard
            pass
        known = (INTERRUPTED, interrupted)
    except Exception as e:
        known = classify(e)
        if known is None:
            raise
    try:
        ray = sys.modules.get("ray")
        if ray is not None and ray.is_initialized():
            ray.shutdown()
        print(f"error: {known[1]}", file=sys.stderr, flush=True)
    finally:
        # Ctrl-C works again in a process that goes on (a notebook, a test): an ignored
        # SIGINT would also be inherited by every process it starts.
        if handler is not None:
            signal.signal(signal.SIGINT, handler)
    return known[0]


def setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
