"""The process's memory on a CPU: glibc's allocator told to keep what a scoring pass frees
for the next one (as PyTorch's CUDA allocator does on a GPU) or to give it back, transparent
huge pages for the CPU scoring processes, and the resident size these decisions are
measured by. Off a CPU or off glibc each call does nothing (release still collects and
empties the CUDA cache)."""
from __future__ import annotations

import functools
import gc
import os
from contextlib import contextmanager
from typing import Mapping

import torch

# glibc's mallopt parameters, and the values its own defaults and adjustment reach
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_MMAP_MAX = -1, -3, -4
_MMAP_MAX_DEFAULT, _MMAP_THRESHOLD_MAX = 65536, 32 * 2**20

# The environment of a process that scores on a CPU, set before it starts (torch reads it
# once, at its first allocation): each CPU allocation of 2 MB or more is advised to take
# transparent huge pages (PyTorch's THP_MEM_ALLOC_ENABLE). A recomputed pass maps each
# of its large tensors anew (freed_to_the_system); with 4 KB pages that mapping is most of
# its system time, with huge pages far fewer page faults, for the same peak (measured in
# docs/results/performance.md). The Ray jobs start their CPU model actors with it; a library
# user sets it in the shell.
CPU_SCORING_ENV = {"THP_MEM_ALLOC_ENABLE": "1"}


def cpu_scoring_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """CPU_SCORING_ENV where `environ` (this process's environment by default) does not set
    a variable itself: THP_MEM_ALLOC_ENABLE=0 in the shell measures without huge pages."""
    environ = os.environ if environ is None else environ
    return {k: environ.get(k, v) for k, v in CPU_SCORING_ENV.items()}


@contextmanager
def freed_to_the_system(device: torch.device, threshold: int = 2**20):
    """Within the block, on a CPU with glibc, each allocation over `threshold` bytes gets
    pages of its own, and they go back to the system when the tensor is freed. By default
    glibc serves allocations of up to 32 MiB from its heaps, where a recomputed pass's
    many same-sized tensors, freed and made again block after block, leave pieces the next
    one does not fit into: the peak RSS beyond the model then varies widely from run to run,
    and with this it is steady and far lower, for some more time with 4 KB pages (the pages
    are mapped anew) and none measurable with huge pages (CPU_SCORING_ENV); measured in
    docs/results/performance.md. Afterwards the threshold is 32 MiB, the most glibc's own
    adjustment reaches."""
    libc = _glibc_of(device)
    if libc is None:
        yield
        return
    _glibc_defaults(libc)  # what stored passes kept (keep_freed) goes back first
    libc.mallopt(_M_MMAP_THRESHOLD, threshold)
    try:
        yield
    finally:
        libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)


def keep_freed(device: torch.device) -> None:
    """From now on, on a CPU with glibc, what a tensor frees stays in this process for the
    next allocation instead of going back to the system, as PyTorch's CUDA allocator keeps
    freed memory on a GPU; `release` gives it back. glibc gives every allocation over
    32 MiB, and anything freed at the top of its heap, back at once, so each stored pass
    mapped its saved activations anew: a long chain's scoring took page faults by the
    hundred thousand and seconds of system time, against next to none with this (the next
    pass reuses the pages, huge pages included), and less wall time (measured in
    docs/results/performance.md). The process then holds what its largest pass took:
    stored passes are planned within max_memory, and a recomputed one gives everything
    back before it starts (freed_to_the_system), since its peak is what a cap bounds."""
    libc = _glibc_of(device)
    if libc is not None:
        libc.mallopt(_M_MMAP_MAX, 0)  # every allocation from the heap, which is kept
        libc.mallopt(_M_TRIM_THRESHOLD, -1)  # mallopt(3): -1 never trims


def resident() -> int:
    """This process's resident memory (RSS) now, in bytes: 0 where /proc has none."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def hold_at_most(device: torch.device, limit: int | None, base: int) -> int:
    """Give back what keep_freed kept if this process's RSS is more than `limit` bytes
    beyond `base` (the RSS with the model loaded and nothing kept): pieces left between
    passes can grow a heap past what its largest pass took, and a scorer's cap bounds what
    it holds. Returns the base from here on: the RSS once it is given back (which also
    counts weights first touched after `base` was taken)."""
    libc = _glibc_of(device)
    if libc is None or limit is None or resident() - base <= limit:
        return base
    libc.malloc_trim(0)
    return resident()


def _glibc_defaults(libc) -> None:
    """Free memory back to the system, and glibc's thresholds as its own adjustment leaves
    them (trimming at twice the largest mmap threshold)."""
    libc.malloc_trim(0)
    libc.mallopt(_M_MMAP_MAX, _MMAP_MAX_DEFAULT)
    libc.mallopt(_M_TRIM_THRESHOLD, 2 * _MMAP_THRESHOLD_MAX)


def _glibc_of(device: torch.device):
    """glibc, where the tensors of `device` are its allocations: None off a CPU or glibc."""
    return glibc() if device.type == "cpu" else None


@functools.cache
def glibc():
    import ctypes
    import platform

    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def release(device: torch.device) -> None:
    """Give back what is cached: after an out-of-memory error, what the failed attempt
    left (a garbage collection first: a traceback's frames can hold its tensors in a
    cycle); on a CPU, also what stored passes kept for the next one (keep_freed), until a
    stored pass keeps it again."""
    gc.collect()
    trim(device)


def trim(device: torch.device) -> None:
    """release without the garbage collection: a full one visits every object of a process
    with torch and transformers loaded, and after scoring it finds nothing to free (the
    passes leave no cycles). What a new scorer calls to take its memory base."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
    libc = _glibc_of(device)
    if libc is not None:
        _glibc_defaults(libc)
