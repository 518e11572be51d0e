"""The algorithm: MIST's scorer and the paper's baselines behind one interface (registry),
the passes to the residual stream and what makes them fit in memory (the footprint model,
glibc's allocator, fused attention, norms and gated MLPs), the exact interventions that
validate the first-order scores, and pruning, which turns scores into compressed chains.
Torch is imported by the modules that need it, not here: choices and prune load without it."""
