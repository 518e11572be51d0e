"""Fault injection for the reliability tests. Inert unless one of these variables is set in
the job's environment (the driver forwards them to its Ray workers):

  MIST_FAULT_EXIT_BATCH=N   a scoring actor kills its own process (os._exit) at its N-th
                            batch, after scoring it and before returning it: the batch's
                            work is lost mid-flight, as when a preemptible node goes away
  MIST_FAULT_ONCE=PATH      ... only the first actor to get there (it creates PATH), so
                            that the replacement actor goes on
  MIST_FAULT_SLEEP_S=S      every scoring batch takes S seconds longer (a slow job, to
                            kill its driver part-way)
  MIST_FAULT_SCORE_ERROR=RE a scoring call raises RuntimeError when the id of one of its
                            chains matches the regular expression RE in full (`.*`: every
                            call); the actor's one-by-one retry then fails exactly those
                            rows, as score_error (a scorer bug, a bad GPU)"""
from __future__ import annotations

import os
import re
import time

VARIABLES = ("MIST_FAULT_EXIT_BATCH", "MIST_FAULT_ONCE", "MIST_FAULT_SLEEP_S",
             "MIST_FAULT_SCORE_ERROR")


def forwarded() -> dict[str, str]:
    """The fault variables set here, for the workers' runtime environment."""
    return {k: os.environ[k] for k in VARIABLES if os.environ.get(k)}


def _first(marker: str | None) -> bool:
    if not marker:
        return True
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False


def after_score_batch(n: int) -> None:
    """Called by a scoring actor after scoring its n-th batch (1-based)."""
    delay = os.environ.get("MIST_FAULT_SLEEP_S")
    if delay:
        time.sleep(float(delay))
    exit_at = os.environ.get("MIST_FAULT_EXIT_BATCH")
    if exit_at and n == int(exit_at) and _first(os.environ.get("MIST_FAULT_ONCE")):
        print(f"[fault] scoring actor {os.getpid()} exits at batch {n}", flush=True)
        os._exit(17)


def before_score(ids: list) -> None:
    """Called by a scoring actor before each scoring call, with the ids of its chains."""
    pattern = os.environ.get("MIST_FAULT_SCORE_ERROR")
    if pattern:
        hit = next((i for i in ids if re.fullmatch(pattern, str(i))), None)
        if hit is not None:
            raise RuntimeError(f"injected scoring failure (MIST_FAULT_SCORE_ERROR) on {hit}")
