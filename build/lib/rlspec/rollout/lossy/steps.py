"""Where reasoning steps end: the step delimiter ("\\n\\n" by default) found at the token level.

A token closes a step when its text holds the delimiter, or when the delimiter straddles it and
the token before (e.g. "...\\n" then "\\n..."). The text of every vocabulary entry is decoded once;
afterwards each check is a set lookup or two short string slices, with no decode in the loop.
"""
from __future__ import annotations


class StepBoundary:
    def __init__(self, texts: list[str], delimiter: str):
        if not delimiter:
            raise ValueError("the step delimiter must be a non-empty string")
        self.texts, self.delimiter = texts, delimiter
        self._closing = {i for i, t in enumerate(texts) if delimiter in t}
        self._span = len(delimiter) - 1  # characters of the delimiter that can sit in the previous token

    @classmethod
    def from_tokenizer(cls, tokenizer, vocab_size: int, delimiter: str) -> "StepBoundary":
        if tokenizer is None:
            raise ValueError("step_routing needs the engine's tokenizer to find the step delimiter in token ids; "
                             "build the engine with one (RolloutEngine.from_pretrained / from_hf_model(tokenizer=...))")
        n = min(vocab_size, len(tokenizer))
        texts = tokenizer.batch_decode([[i] for i in range(n)])
        return cls(list(texts) + [""] * (vocab_size - n), delimiter)

    def closes(self, prev: int | None, tok: int) -> bool:
        """Does `tok`, following `prev` (None at the start), end a step?"""
        if tok in self._closing:
            return True
        if prev is None or self._span == 0 or tok >= len(self.texts) or prev >= len(self.texts):
            return False
        return self.delimiter in self.texts[prev][-self._span:] + self.texts[tok][:self._span]

    def cut(self, prev: int | None, tokens: list[int]) -> int:
        """Length of the first step in `tokens` (through its closing token), or len(tokens) if none closes."""
        for i, tok in enumerate(tokens):
            if self.closes(prev if i == 0 else tokens[i - 1], tok):
                return i + 1
        return len(tokens)
