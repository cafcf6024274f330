"""The detokenizer's direct Rust decode (engine/text/detokenizer.py `backend_decoder`): the
same text, token for token, as through transformers' decode on the tokenizer families
test_detokenizer.py builds, and a tokenizer with a decode of its own is decoded through it."""

from __future__ import annotations

import random

import pytest
from transformers import PreTrainedTokenizerFast

from engine.sampling_params import SamplingParams
from engine.text.detokenizer import IncrementalDetokenizer, backend_decoder
from tests.unit.test_detokenizer import _byte_level, _encode, _llama_byte_fallback, _metaspace

MAKERS = {"byte_level": _byte_level, "metaspace": _metaspace, "llama": _llama_byte_fallback}


@pytest.fixture(scope="module", params=list(MAKERS))
def any_tokenizer(request: pytest.FixtureRequest) -> PreTrainedTokenizerFast:
    return MAKERS[request.param]()


@pytest.fixture(scope="module")
def byte_level() -> PreTrainedTokenizerFast:
    return _byte_level()


class _OwnDecode(PreTrainedTokenizerFast):
    """A fast tokenizer whose decode is its own (as some model-specific classes have)."""

    num_calls = 0

    def _decode(self, token_ids, skip_special_tokens=False, **kwargs):
        type(self).num_calls += 1
        return super()._decode(token_ids, skip_special_tokens, **kwargs)


@pytest.mark.parametrize("seed", range(3))
def test_the_direct_backend_decode_emits_what_the_tokenizers_decode_does(any_tokenizer, seed):
    """The detokenizer decodes through the Rust tokenizer directly where transformers' decode
    is exactly that call: the emitted text is the same, token for token, as through decode."""
    assert backend_decoder(any_tokenizer) is not None
    rng = random.Random(seed)
    vocab = len(any_tokenizer)
    prompt_ids = [rng.randrange(vocab) for _ in range(rng.randrange(0, 8))]
    output_ids = [rng.randrange(vocab) for _ in range(150)]
    for skip in (True, False):
        params = SamplingParams(skip_special_tokens=skip, stop=["e ", "th"])
        direct = IncrementalDetokenizer(any_tokenizer, prompt_ids, params)
        wrapped = IncrementalDetokenizer(any_tokenizer, prompt_ids, params)
        wrapped._backend_decode = None  # through transformers' decode
        for token_id in output_ids:
            a, b = direct.append([token_id]), wrapped.append([token_id])
            assert a == b
            if a.stop_string is not None:
                break
        else:
            assert direct.flush() == wrapped.flush()


def test_a_tokenizer_with_its_own_decode_is_decoded_through_it(byte_level):
    own = _OwnDecode(tokenizer_object=byte_level.backend_tokenizer)
    assert backend_decoder(own) is None
    detok = IncrementalDetokenizer(own, [], SamplingParams())
    before = _OwnDecode.num_calls
    ids = _encode(byte_level, "the quick fox")
    text = "".join(detok.append([t]).text for t in ids) + detok.flush()
    assert text == "the quick fox" and _OwnDecode.num_calls > before
