"""Verification: the step's logits into each request's tokens, plain sampling or speculative
rejection sampling of its drafts, with a plain reference of the rejection rule."""
