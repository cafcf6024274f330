"""What the EAGLE-3 trainer's tests share: prompts over a small domain of ids, the tiny target
they train on and the engine settings the trainer runs it with, and one torch thread for a
module's tests. The test modules wrap build_target and single_thread in their `target` and
`one_thread` fixtures."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import build_tiny_model
from tests.token_distribution import edit_lm_head

POOL = 32


def _prompts(seed: int, count: int) -> list[list[int]]:
    """Prompts over a small "domain" of POOL ids, training and held-out alike: the target's
    continuations then visit states that training has seen, as a real head's domain does."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(4, 11, (count,), generator=g).tolist()
    return [[1, *(3 + torch.randint(0, POOL, (n - 1,), generator=g)).tolist()] for n in lengths]


def single_thread() -> Iterator[None]:
    """Tensors this small cost more in OpenMP's hand-offs than they gain from a second thread
    (and on a busy machine a second thread waits for its core: ~40x slower here)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def build_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny target whose continuations a one-layer head can learn from 25 prompts and meet
    again in held-out ones: a sharpened LM head (a few likely next tokens) and weak attention
    (the next token depends mostly on the current one, little on the rest of the context)."""
    path = build_tiny_model(
        tmp_path_factory.mktemp("train-target"), "llama", seed=11, num_hidden_layers=4
    )
    edit_lm_head(path, scale=8.0)
    file = path / "model.safetensors"
    tensors = load_file(file)
    for name in tensors:
        if name.endswith("self_attn.o_proj.weight"):
            tensors[name] = tensors[name] * 0.03
    save_file(tensors, file, metadata={"format": "pt"})
    return path


def _engine(target: Path) -> dict:
    # 16-token steps: features of 40-token sequences come in several chunks.
    return dict(
        model=str(target), dtype="float32", block_size=4, num_kv_blocks=64,
        max_num_batched_tokens=16,
    )  # fmt: skip
