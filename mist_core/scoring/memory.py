"""How much memory a scoring pass takes, measured once per model, the cap "auto" means, and
how an out-of-memory error is told apart (mist_core.scoring.allocator keeps or gives back what the
passes free).

The footprint of a pass is proportional to the token positions it computes. It is measured
on a short probe pass by adding up the tensors autograd saves for the backward (parameters
excluded), so it holds for any architecture, dtype and attention kernel without a table of
models."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..models import LM

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
        is used: the block's share of the measured peak is well under twice what it saves;
        docs/results/performance.md, "A measured footprint"). With `mlp_pieces` the
        MLP's part is counted once per pass, for one piece (in `need`), not per position."""
        if not plan.recompute:
            return self.stored + 2 * self.block + self.transient + self.mlp_transient
        per = (self.state * self.states_kept(plan.keep_every)
               + self.attention * min(plan.attention_kept, self.layers))
        if plan.mlp_pieces:
            return per + (self.block - self.mlp) + self.transient
        return per + self.block + self.transient + self.mlp_transient

    def need(self, positions: int, plan: "Plan", prefix_positions: int = 0,
             mask_cells: int = 0, logit_rows: int = 0, vocab: int = 0,
             gradients: int = 1) -> float:
        """Bytes a pass over `positions` (padded) token positions takes beyond the model.
        `gradients`: the objectives backpropagated through it (passes.residual_pass's
        on_also_grad): each more holds a gradient state at a time."""
        from .passes import MLP_POSITIONS

        fixed = (prefix_positions * self.kv + mask_cells + 3 * 4 * logit_rows * vocab
                 + (gradients - 1) * positions * self.state)
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
