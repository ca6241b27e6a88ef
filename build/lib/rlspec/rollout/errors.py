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


class UnsupportedModelError(ValueError):
    """The checkpoint uses a feature rlspec's runtime does not compute (a sliding window longer rollouts would
    cross, a position-dependent RoPE, an attention kind, an lm_head that contradicts the config): generating
    anyway would sample from a different model than the one trained."""


class WeightSyncError(ValueError):
    """A weight load or policy sync did not write every runtime tensor exactly once: a tensor never written, one
    written twice, a name the runtime does not know, or a shape that does not fit. The engine's weights are then
    not the policy's."""


class UnknownWeightError(WeightSyncError, KeyError):
    """A tensor name with no place in the runtime (also a KeyError, as a missing key)."""

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0]) if self.args else ""


RESUME_HINT = ("the run's last checkpoint can be resumed with resume=auto once the cluster is back "
               "(docs/distributed.md#ray-faults)")


class RolloutWorkerError(RuntimeError):
    """A rollout could not be completed by a backend's workers (the Ray pool: a task failed on too many
    workers, results of the wrong policy version, ...)."""


class RolloutBackendLost(RolloutWorkerError):
    """The backend cannot go on: every worker, the drafter trainer or the Ray cluster is gone. Nothing in this
    process can bring it back: the trainers save a checkpoint of the last finished step and stop."""

    def __init__(self, what: str):
        super().__init__(f"{what}\nThe rollout backend is lost; {RESUME_HINT}.")
