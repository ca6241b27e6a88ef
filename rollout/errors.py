"""Errors the engine raises for bad input; each message says what is wrong and how to fix it."""


class PromptTooLongError(ValueError):
    """A prompt (plus at least one new token) does not fit in the engine's context."""


class ModelNotFoundError(FileNotFoundError):
    """A model name resolved to nothing: not a local directory, not the embedded alias, not on a hub."""


class TokenizerMismatchError(ValueError):
    """A drafter's tokenizer does not match the target's, so its token ids would be meaningless."""


class NonFiniteLogitsError(FloatingPointError):
    """The target produced NaN/inf logits: sampling from them would return garbage silently.

    step: the decode step of the call (0 = the prefill); rows: the batch rows whose logits were not
    finite; first_bad: the first parameter or layer found non-finite, when it was cheap to find."""

    def __init__(self, message: str, step: int = 0, rows: list[int] | None = None, first_bad: str | None = None):
        super().__init__(message)
        self.step, self.rows, self.first_bad = step, list(rows or []), first_bad
