"""Typed errors: every failure a caller is expected to handle has a class and a reason."""


class MistError(Exception):
    """Base class of the library's own errors."""


class InvalidExample(MistError):
    """An example that cannot be scored. `reason` is a short machine-friendly code, one of
    mist_core.reasons.REASONS."""

    def __init__(self, reason: str, detail: str = "", example_id=None):
        from .reasons import check

        self.reason = check(reason)
        self.detail = detail
        self.example_id = example_id
        msg = reason if not detail else f"{reason}: {detail}"
        if example_id is not None:
            msg = f"[{example_id}] {msg}"
        super().__init__(msg)


class NonFiniteScores(InvalidExample):
    """A chain whose log-likelihoods, gradients or raw axis values came out NaN or inf (a
    model with broken weights, an overflow in low precision): its scores would be garbage,
    and the per-chain normalisation would hide it as all-zero scores, so the chain fails
    instead. Reason `nonfinite_scores`; `detail` says which quantity."""

    REASON = "nonfinite_scores"  # declared in reasons.FAILURES

    def __init__(self, detail: str = "", example_id=None):
        super().__init__(self.REASON, detail, example_id)

    def __reduce__(self):  # picklable with its one-argument signature (Ray ships it)
        return (type(self), (self.detail, self.example_id))


class UnsupportedModel(MistError):
    """A model whose decoder blocks, embeddings or unembedding cannot be located."""


class MissingDependency(MistError):
    """An optional package or model file that a feature needs is not available."""
