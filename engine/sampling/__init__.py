"""Sampling: turning logits rows into tokens under each request's options, exactly and the same
whatever shares the step, with counter-based randomness and a plain reference to test against."""
