"""rlspec: lossless speculative rollouts for RL training of reasoning LLMs.

The public API, re-exported lazily: `import rlspec` imports no torch (the CLI parses its config
before any heavy import); each name loads its module on first access.

    from rlspec import RolloutEngine, SamplingParams, SpecConfig, RolloutResult, fetch_model
    from rlspec import SpecGRPOTrainer, SpecRLOOTrainer, PPOTrainer, export_drafter
"""
import importlib

__version__ = "0.1.0"

# public name -> module that defines it (imports point one way: rlspec -> trainers -> rollout)
_EXPORTS = {
    "RolloutEngine": "rlspec.rollout.engine",
    "SamplingParams": "rlspec.rollout.types",
    "SpecConfig": "rlspec.rollout.types",
    "RolloutResult": "rlspec.rollout.types",
    "fetch_model": "rlspec.rollout.runtime.model.fetch",
    "SpecGRPOTrainer": "rlspec.trainers.grpo",
    "SpecRLOOTrainer": "rlspec.trainers.rloo",
    "PPOTrainer": "rlspec.trainers.ppo.trainer",
    "export_drafter": "rlspec.export",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    """Import the defining module on first access and cache the name in this module's globals."""
    module_name = _EXPORTS.get(name)
    if module_name is None:
        raise AttributeError(f"module 'rlspec' has no attribute {name!r}; public names: {', '.join(__all__)}")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise  # a real missing dependency inside the module: surface it unchanged
        raise ImportError(f"rlspec.{name} lives in {module_name}, which is not available in this "
                          f"version of rlspec (module not found)") from exc
    value = getattr(module, name)
    globals()[name] = value  # later accesses skip __getattr__
    return value


def __dir__() -> list[str]:
    return [*__all__, "__version__"]
