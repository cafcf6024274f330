"""Fixtures the speculation integration tests share: the tiny target, a random draft model that
disagrees with it often, and the target's greedy outputs from transformers."""

from __future__ import annotations

import pytest

from tests.conftest import build_tiny_model
from tests.integration.test_greedy_parity import _reference


@pytest.fixture(scope="module")
def target(tiny_llama):
    return tiny_llama


@pytest.fixture(scope="module")
def random_draft(tmp_path_factory):
    # Same vocabulary, different weights and depth: it disagrees often (forced rejections).
    return build_tiny_model(tmp_path_factory.mktemp("draft"), "llama", seed=5, num_hidden_layers=1)


@pytest.fixture(scope="module")
def expected(target):
    """transformers' greedy output of every prompt of test_greedy_parity (PROMPTS, MAX_TOKENS)."""
    return _reference(target)
