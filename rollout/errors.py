"""Errors the engine raises for bad input; each message says what is wrong and how to fix it."""


class PromptTooLongError(ValueError):
    """A prompt (plus at least one new token) does not fit in the engine's context."""


class ModelNotFoundError(FileNotFoundError):
    """A model name resolved to nothing: not a local directory, not the embedded alias, not on a hub."""


class TokenizerMismatchError(ValueError):
    """A drafter's tokenizer does not match the target's, so its token ids would be meaningless."""
