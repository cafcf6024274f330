"""Speculative decoding: proposers (drafts), verification (rejection sampling), configuration."""
