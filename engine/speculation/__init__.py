"""Speculative decoding: proposers (drafts), verification (rejection sampling), configuration."""

from engine.speculation import builtin  # noqa: F401  (registers the built-in proposers)
