"""Old selector module and class names, still importable with a DeprecationWarning naming the new ones."""
from __future__ import annotations

import importlib
import warnings

# old module -> (new module, {old class name: new class name})
RENAMED = {
    "longtail": ("fixed", {"LongTailSelector": "FixedSelector"}),
    "bandit": ("adaptive", {}),
    "forced": ("always", {"ForcedSelector": "AlwaysSelector"}),
}


def old_name(module: str, attr: str):
    """`attr` of the renamed selector module `module` (selectors.<module>), resolved in its new module."""
    new_module, classes = RENAMED[module]
    new_attr = classes.get(attr, attr)
    target = importlib.import_module(f"rlspec.rollout.speculation.selectors.{new_module}")
    if not hasattr(target, new_attr):
        raise AttributeError(f"module 'rlspec.rollout.speculation.selectors.{module}' has no attribute {attr!r}")
    warnings.warn(f"rlspec.rollout.speculation.selectors.{module}.{attr} is now "
                  f"rlspec.rollout.speculation.selectors.{new_module}.{new_attr}", DeprecationWarning, stacklevel=3)
    return getattr(target, new_attr)
