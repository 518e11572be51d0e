"""How much memory a scoring pass takes, measured once per model, and what to do when a
batch runs out of it.

The footprint of a pass is proportional to the token positions it computes. It is measured
on a short probe pass by adding up the tensors autograd saves for the backward (parameters
excluded), so it holds for any architecture, dtype and attention kernel without a table of
models."""
from __future__ import annotations

import gc
from dataclasses import dataclass

import torch

from .models import LM

_GIB = 2**30


@dataclass(frozen=True)
class Footprint:
    """Bytes per token position of a pass with gradients to the residual stream."""

    stored: float  # what autograd keeps for the backward of a whole pass
    block: float  # the same for one block: what a recomputed backward holds at a time
    state: float  # h^(0..L) of one position: what a recomputed backward keeps throughout
    transient: float  # a block's temporaries in its forward (q, k, v, the MLP's halves, …)
    kv: float  # one position's keys and values over all layers (a prefix cache)

    # What the process holds beyond the tensors counted: the allocator's free pieces, which
    # the next pass may not fit into. Measured against peak RSS on SmolLM2-135M-Instruct, CPU,
    # 1k-8k tokens (docs/results/performance.md).
    OVERHEAD = 1.25

    def per_token(self, recompute: bool) -> float:
        """Bytes per token position: the states (recomputed) or the whole graph (stored),
        plus one block's saved activations and gradients and its temporaries."""
        return (self.state if recompute else self.stored) + 2 * self.block + self.transient

    def need(self, positions: int, recompute: bool, prefix_positions: int = 0,
             mask_cells: int = 0, logit_rows: int = 0, vocab: int = 0) -> float:
        """Bytes a pass over `positions` (padded) token positions takes beyond the model."""
        fixed = prefix_positions * self.kv + mask_cells + 3 * 4 * logit_rows * vocab
        return self.OVERHEAD * (positions * self.per_token(recompute) + fixed)


def measure(lm: LM, tokens: int = 64) -> Footprint:
    """Run a stored pass over `tokens` and 2·`tokens` random tokens and take the per-token
    slope of the bytes autograd saves (so fixed costs such as rotary tables cancel)."""
    from .passes import residual_pass

    params = {p.untyped_storage().data_ptr() for p in lm.model.parameters()}
    params |= {b.untyped_storage().data_ptr() for b in lm.model.buffers()}

    def saved_bytes(n: int) -> int:
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor):
            try:
                s = t.untyped_storage()
            except (RuntimeError, NotImplementedError):  # sparse or meta: not memory here
                return t
            if s.data_ptr() not in params:
                seen[s.data_ptr()] = max(seen.get(s.data_ptr(), 0), s.nbytes())
            return t

        vocab = lm.unembedding.shape[0]
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, vocab, (1, n), generator=gen).to(lm.device)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            residual_pass(lm, ids, [(n - 2, n)], grad_layers=[1])
        return sum(seen.values())

    stored = max(saved_bytes(2 * tokens) - saved_bytes(tokens), 0) / tokens
    gc.collect()
    config = lm.model.config
    elt = torch.finfo(lm.dtype).bits // 8
    d = lm.unembedding.shape[1]
    heads = getattr(config, "num_attention_heads", 1)
    head_dim = getattr(config, "head_dim", None) or d // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    L = lm.n_layers
    inter = getattr(config, "intermediate_size", 4 * d)
    qkv = (heads + 2 * kv_heads) * head_dim
    return Footprint(stored=stored, block=stored / L, state=(L + 1) * d * elt,
                     transient=elt * (4 * inter + 4 * d + 3 * qkv),
                     kv=2 * L * kv_heads * head_dim * elt)


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
    """After an out-of-memory error: drop what the failed attempt left cached."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


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
