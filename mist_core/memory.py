"""How much memory a scoring pass takes, measured once per model, and what to do when a
batch runs out of it.

The footprint of a pass is proportional to the token positions it computes. It is measured
on a short probe pass by adding up the tensors autograd saves for the backward (parameters
excluded), so it holds for any architecture, dtype and attention kernel without a table of
models."""
from __future__ import annotations

import functools
import gc
import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping

import torch

from .models import LM

if TYPE_CHECKING:
    from .passes import Plan

_GIB = 2**30


@dataclass(frozen=True)
class Footprint:
    """Bytes per token position of a pass with gradients to the residual stream."""

    stored: float  # what autograd keeps for the backward of a whole pass
    block: float  # the same for one block: what a recomputed backward holds at a time
    mlp: float  # the part of `block` that is the MLP's (a recomputed pass holds it per piece)
    state: float  # one h^(l) of one position
    layers: int  # L
    transient: float  # a block's temporaries in its forward, besides the MLP's
    mlp_transient: float  # the MLP's temporaries (its intermediate activations)
    kv: float  # one position's keys and values over all layers (a prefix cache)
    attention: float = 0.0  # one block's kept attention output and log-sum-exp

    # What the process holds beyond the tensors counted: the allocator's free pieces, which
    # the next pass may not fit into. Measured against peak RSS on SmolLM2-135M-Instruct, CPU,
    # 1k-8k tokens (docs/results/performance.md).
    OVERHEAD = 1.25

    def states_kept(self, keep_every: int) -> int:
        """How many h^(l) a recomputed backward holds at most: every one, or with
        `keep_every` k the kept ones (0, k, 2k, …, L) and one segment's k - 1 between them."""
        L = self.layers
        if keep_every <= 1:
            return L + 1
        return -(-L // keep_every) + 1 + keep_every - 1

    def per_token(self, plan: "Plan") -> float:
        """Bytes per token position. Stored: the whole graph, plus one block's saved
        activations and gradients and its temporaries. Recomputed: the states and the kept
        attention outputs, plus one block's saved activations and its temporaries, which
        bound the gradients in flight (a block's backward frees each saved tensor once it
        is used: on SmolLM2 at 4k tokens the block's share of the measured peak was 37 KB
        a token against 29 KB saved, before mist_core.swiglu). With `mlp_pieces` the
        MLP's part is counted once per pass, for one piece (in `need`), not per position."""
        if not plan.recompute:
            return self.stored + 2 * self.block + self.transient + self.mlp_transient
        per = (self.state * self.states_kept(plan.keep_every)
               + self.attention * min(plan.attention_kept, self.layers))
        if plan.mlp_pieces:
            return per + (self.block - self.mlp) + self.transient
        return per + self.block + self.transient + self.mlp_transient

    def need(self, positions: int, plan: "Plan", prefix_positions: int = 0,
             mask_cells: int = 0, logit_rows: int = 0, vocab: int = 0) -> float:
        """Bytes a pass over `positions` (padded) token positions takes beyond the model."""
        from .passes import MLP_POSITIONS

        fixed = prefix_positions * self.kv + mask_cells + 3 * 4 * logit_rows * vocab
        if plan.recompute and plan.mlp_pieces:  # one MLP piece: activations and temporaries
            fixed += min(positions, MLP_POSITIONS) * (self.mlp + self.mlp_transient)
        return self.OVERHEAD * (positions * self.per_token(plan) + fixed)


def saved_bytes(run, exclude: set[int]) -> int:
    """Bytes of the distinct storages autograd saves for the backward while `run()` builds
    its graph, leaving out those whose data pointer is in `exclude` (the parameters)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        try:
            s = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse or meta: not memory here
            return t
        if s.data_ptr() not in exclude:
            seen[s.data_ptr()] = max(seen.get(s.data_ptr(), 0), s.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(seen.values())


def measure(lm: LM, tokens: int = 64) -> Footprint:
    """Run a stored pass over `tokens` and 2·`tokens` random tokens and take the per-token
    slope of the bytes autograd saves (so fixed costs such as rotary tables cancel)."""
    from .passes import residual_pass
    from .swiglu import fused_swiglu

    params = {p.untyped_storage().data_ptr() for p in lm.model.parameters()}
    params |= {b.untyped_storage().data_ptr() for b in lm.model.buffers()}

    vocab = lm.unembedding.shape[0]
    d = lm.unembedding.shape[1]
    gen = torch.Generator().manual_seed(0)

    def whole(n: int):
        ids = torch.randint(0, vocab, (1, n), generator=gen).to(lm.device)
        return lambda: residual_pass(lm, ids, [(n - 2, n)], grad_layers=[1])

    def mlp(n: int):
        x = torch.randn(1, n, d, generator=gen).to(lm.device, lm.dtype).requires_grad_(True)
        module = getattr(lm.blocks[0], "mlp", None)

        def run():
            if isinstance(module, torch.nn.Module):
                with fused_swiglu(lm):  # as the passes run it
                    module(x).sum()
        return run

    def slope(probe) -> float:
        return max(saved_bytes(probe(2 * tokens), params)
                   - saved_bytes(probe(tokens), params), 0) / tokens

    stored, mlp_saved = slope(whole), slope(mlp)
    gc.collect()
    config = lm.model.config
    elt = torch.finfo(lm.dtype).bits // 8
    heads = getattr(config, "num_attention_heads", 1)
    head_dim = getattr(config, "head_dim", None) or d // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    L = lm.n_layers
    inter = getattr(config, "intermediate_size", 4 * d)
    qkv = (heads + 2 * kv_heads) * head_dim
    block = stored / L
    return Footprint(stored=stored, block=block, mlp=min(mlp_saved, block), state=d * elt,
                     layers=L, transient=elt * (4 * d + 3 * qkv), mlp_transient=elt * 4 * inter,
                     kv=2 * L * kv_heads * head_dim * elt,
                     attention=heads * (head_dim * elt + 4))  # output, fp32 log-sum-exp


# glibc's mallopt parameters, and the values its own defaults and adjustment reach
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_MMAP_MAX = -1, -3, -4
_MMAP_MAX_DEFAULT, _MMAP_THRESHOLD_MAX = 65536, 32 * 2**20

# The environment of a process that scores on a CPU, set before it starts (torch reads it
# once, at its first allocation): each CPU allocation of 2 MB or more is advised to take
# transparent huge pages (PyTorch's THP_MEM_ALLOC_ENABLE). A recomputed pass maps each
# of its large tensors anew (freed_to_the_system); with 4 KB pages that mapping is most of
# its system time, with huge pages about a sixth of the page faults, for the same peak
# (figures in docs/results/performance.md). The Ray jobs start their CPU model actors with
# it; a library user sets it in the shell.
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
    one does not fit into: on SmolLM2 at 7.7k tokens the peak RSS beyond the model came out
    anywhere from 0.78 to 1.43 GiB from run to run, and 0.33 GiB with this (for ~14 % more
    time with 4 KB pages, the pages being mapped anew; nothing measurable with huge pages,
    CPU_SCORING_ENV). Afterwards the threshold is 32 MiB, the most
    glibc's own adjustment reaches."""
    libc = _cpu_glibc(device)
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
    mapped its saved activations anew: at 4k tokens on SmolLM2 45-190k page faults and
    5-7 CPU seconds of system time a scoring, against next to none with this (the next
    pass reuses the pages, huge pages included), and 0.91-0.95 of the wall time in one
    process (figures in docs/results/performance.md). The process then holds what its largest pass took:
    stored passes are planned within max_memory, and a recomputed one gives everything
    back before it starts (freed_to_the_system), since its peak is what a cap bounds."""
    libc = _cpu_glibc(device)
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
    libc = _cpu_glibc(device)
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


def _cpu_glibc(device: torch.device):
    """glibc, where the tensors of `device` are its allocations: None off a CPU or glibc."""
    return _glibc() if device.type == "cpu" else None


@functools.cache
def _glibc():
    import ctypes
    import platform

    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def auto_cap(device: torch.device) -> int:
    """The cap `max_memory="auto"` means: 90% of the GPU's free memory once the model is
    loaded; on CPU 60% of the memory the machine has available now (the process shares the
    machine, and there the operating system, not an exception, answers an allocation that
    does not fit)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(0.9 * free)
    import psutil

    return int(0.6 * psutil.virtual_memory().available)


def is_out_of_memory(e: BaseException) -> bool:
    if isinstance(e, torch.OutOfMemoryError):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and ("out of memory" in text
                                            or "can't allocate memory" in text)


def release(device: torch.device) -> None:
    """Give back what is cached: after an out-of-memory error, what the failed attempt
    left; on a CPU, also what stored passes kept for the next one (keep_freed), until a
    stored pass keeps it again."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    libc = _cpu_glibc(device)
    if libc is not None:
        _glibc_defaults(libc)


def gib(n: float) -> str:
    return f"{n / _GIB:.2f} GiB"


def parse_bytes(text: str | int | None) -> int | None:
    """'6GB', '512MiB', '1.5G', '1000000' → bytes (binary units: a GB here is 2**30)."""
    if text is None or isinstance(text, int):
        return text
    t = text.strip().upper().replace("IB", "").replace("B", "")
    units = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    try:
        if t and t[-1] in units:
            return int(float(t[:-1]) * units[t[-1]])
        return int(float(t))
    except ValueError:
        raise ValueError(f"not a memory size: {text!r} (use e.g. 6GB, 512MB or bytes)") from None
