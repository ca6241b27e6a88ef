"""What values each run-config field allows: the rules of rlspec.rollout.rules (one set for the Python API and the
CLI config), plus what only the run config needs.

A section declares a field's rule next to its default and help string (`_f(..., rule=AT_LEAST_1)` in
sections.py); `check_fields` runs them from the section's `__post_init__`, and the loader runs the one rule of an
overridden key so the error names the override. Plain Python only (no torch): rlspec.config stays light.
"""
from __future__ import annotations

from rlspec.rollout.rules import (  # noqa: F401  (re-exported: the config's sections and loader read them here)
    AT_LEAST_0, AT_LEAST_1, DEVICE, DIRECTORY, FINITE, FRACTION, NON_EMPTY, NON_NEGATIVE, POSITIVE, SEED, SEED_MAX,
    STEPS, UNIT, Rule, at_least, check_fields, closed, field_rule, names_list, registered, subset_of)

# the embedded_math dataset's operators (trainers/data.py's _TEMPLATES, which imports `datasets`; a test keeps
# the two equal)
MATH_OPS = ("+", "-", "*")
