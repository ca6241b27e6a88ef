"""Selectors: per decode step, choose an arm (no speculation, or drafter x depth x width x stop rule)."""
