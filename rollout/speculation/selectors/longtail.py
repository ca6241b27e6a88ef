"""Deprecated name of this selector's module (selectors/_renamed.py says the new one)."""
from rlspec.rollout.speculation.selectors._renamed import old_name


def __getattr__(attr: str):
    return old_name("longtail", attr)
