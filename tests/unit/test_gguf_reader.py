"""Our GGUF header reader (engine.models.gguf_reader.open_gguf) against the gguf package's reader, on
files the gguf package's writer made: every tensor's name, type, shape and bytes, every metadata
scalar and string (arrays by their length), a custom alignment, and clear errors for what is not
a GGUF file. It reads the header without materialising the arrays, where the package's reader
spent half a minute on a 150k-token vocabulary at every load."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter

from engine.models.gguf_reader import open_gguf
from tests.gguf_models import random_blocks


def _write(path, alignment: int | None = None):
    rng = np.random.default_rng(0)
    writer = GGUFWriter(str(path), "llama")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    writer.add_name("tiny")
    writer.add_context_length(4096)
    writer.add_rope_freq_base(10000.0)
    writer.add_bool("test.flag", True)
    writer.add_int64("test.negative", -7)
    writer.add_float64("test.double", 0.125)
    writer.add_chat_template("{{ messages }} ünïcode")
    writer.add_token_list([f"tok{i}" for i in range(300)] + ["é", ""])
    writer.add_token_scores([float(i) for i in range(302)])
    writer.add_token_types([1] * 302)
    writer.add_eos_token_id(2)
    writer.add_array("test.nested", [[1, 2], [3]])
    writer.add_tensor("token_embd.weight", rng.standard_normal((302, 32)).astype(np.float16))
    writer.add_tensor("output_norm.weight", rng.standard_normal(32).astype(np.float32))
    for name, qtype, rows in (("blk.0.attn_q.weight", GGMLQuantizationType.Q4_K, 4),
                              ("blk.0.ffn_down.weight", GGMLQuantizationType.Q6_K, 3),
                              ("blk.0.attn_v.weight", GGMLQuantizationType.Q8_0, 5)):  # fmt: skip
        blocks = random_blocks(rng, qtype, rows, 256)
        writer.add_tensor(name, np.ascontiguousarray(blocks), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("alignment", [None, 64])
def test_it_reads_what_the_gguf_package_reads(tmp_path, alignment):
    path = _write(tmp_path / "m.gguf", alignment)
    ours, theirs = open_gguf(path), GGUFReader(str(path))
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert a.tensor_type == int(b.tensor_type)
        assert a.shape == tuple(int(d) for d in b.shape)
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape
        assert np.array_equal(a.data, b.data), a.name
    fields = {k: f for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert set(ours.metadata) == set(fields)
    metadata = dict(ours.metadata)
    # An array of arrays: the outer length (the package's reader flattens it); what follows it
    # being read right shows it was walked right.
    assert metadata.pop("test.nested") == 2
    del fields["test.nested"]
    for key, field in fields.items():
        if field.types and field.types[0].name == "ARRAY":
            assert metadata[key] == len(field.data), key
        else:
            assert metadata[key] == field.contents(), key
    assert ours.metadata["tokenizer.chat_template"] == "{{ messages }} ünïcode"
    assert ours.metadata["tokenizer.ggml.tokens"] == 302
    assert ours.metadata["test.negative"] == -7 and ours.metadata["test.flag"] is True


def test_what_is_not_a_gguf_file_is_named(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"PK\x03\x04" + bytes(60))
    with pytest.raises(ValueError, match="is not a GGUF file"):
        open_gguf(bad)
    old = tmp_path / "v1.gguf"
    old.write_bytes(b"GGUF" + (1).to_bytes(4, "little") + bytes(60))
    with pytest.raises(ValueError, match="GGUF version 1 is not read"):
        open_gguf(old)
    swapped = tmp_path / "be.gguf"
    swapped.write_bytes(b"GGUF" + (3).to_bytes(4, "big") + bytes(60))
    with pytest.raises(ValueError, match="big-endian GGUF file"):
        open_gguf(swapped)
