"""The bundled SmolLM2-135M-Instruct installed into an empty cache: serving its GGUF blocks needs
no dense checkpoint and `specserve install-model --convert` writes none; the first dense start
(quantization none) writes it, and what each path serves is what it served when the conversion
always wrote it (the dense model greedy-equal to transformers on that checkpoint; the blocks'
model the same, parameter for parameter, with the checkpoint beside it as without)."""

from __future__ import annotations

from pathlib import Path

import torch

from engine import LLM, SamplingParams, kernels
from engine.models import bundled, packages
from server.cli import main
from tests.smollm2 import ON_SMOLLM2_WITH_KERNELS

pytestmark = ON_SMOLLM2_WITH_KERNELS

MODEL = "smollm2-135m-instruct"
PROMPTS = ["The three primary colors are", "def fibonacci(n):"]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def _has_dense(path: Path) -> bool:
    return any(path.glob("*.safetensors"))


def _serve(path: Path, quantization: str) -> tuple[dict[str, torch.Tensor], list[list[int]]]:
    llm = LLM(str(path), dtype="float32", quantization=quantization, num_kv_blocks=64)
    assert llm.engine.quantization.startswith("gguf" if quantization == "gguf" else "none")
    model = llm.engine.runner.model
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    return weights, [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


def test_gguf_path_writes_no_dense_checkpoint_and_a_dense_start_writes_it(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kernels.cpu_kernels()  # built under the usual cache root, before that moves to tmp_path
    monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(packages, "install_packages", lambda model: None)  # installed already
    assert main(["install-model", MODEL, "--convert"]) == 0
    path = tmp_path / "models" / MODEL
    assert bundled.resolve_model(MODEL) == path
    names = {p.name for p in path.iterdir()}
    assert {"config.json", "generation_config.json", "tokenizer.json", "model.gguf"} <= names
    assert not _has_dense(path)

    from_file, tokens = _serve(path, "gguf")
    assert not _has_dense(path)  # serving the blocks needed none

    _, dense_tokens = _serve(path, "none")
    assert _has_dense(path)  # the dense start wrote it
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    for prompt, got in zip(PROMPTS, dense_tokens, strict=True):
        ids = torch.tensor([tokenizer.encode(prompt)])
        with torch.no_grad():
            ref = reference.generate(ids, max_new_tokens=16, do_sample=False, pad_token_id=0)
        assert got == ref[0, ids.shape[1] :].tolist()

    beside_dense, tokens_beside_dense = _serve(path, "gguf")  # the old layout: norms from it
    assert tokens_beside_dense == tokens
    assert beside_dense.keys() == from_file.keys()
    for name, value in from_file.items():
        assert torch.equal(value, beside_dense[name]), name
