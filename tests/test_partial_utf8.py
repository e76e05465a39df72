"""Byte tokens that split a character: allowed exactly where some continuation is valid text.

GPT-2's tokenizer (50k tokens, byte-level BPE, built offline) has a token for every byte and
spells most CJK characters and emoji with several tokens, some ending mid-character. Inside a
JSON string any character is valid, so a token ending inside a character must be allowed when
its bytes can still be completed, and refused when no continuation is UTF-8 (a stray
continuation byte, 0xF5, ASCII after a lead byte). Checked for the SynCode plugin and both
outlines engines (outlines_core for a JSON schema / regex, llguidance for Lark).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shim_adapters.backends.registry import get_backend
from shim_adapters.errors import ForbiddenTokenError
from shim_adapters.grammars.grammar import Grammar
from shim_adapters.mask.utf8 import incomplete_tail, utf8_prefix_ok

torch.set_num_threads(1)

#: A JSON string inside brackets (Lark): small, so SynCode compiles it at 50k tokens in ~25 s.
STRING_LARK = Grammar(format="lark", name="json-string", text=r'''start: "[" STRING "]"
STRING: /"([^"\\\x00-\x1f]|\\["\\\/bfnrt])*"/
''')
STRING_SCHEMA = Grammar(format="json_schema", name="name-schema",
                        text='{"type": "object", "properties": {"name": {"type": "string"}}, '
                             '"required": ["name"], "additionalProperties": false}')
TEXT = "中文😀é👍🏽"


@pytest.fixture(scope="module")
def gpt2():
    from shim_adapters.mask.tokenizers_offline import load_offline_tokenizer

    tok = load_offline_tokenizer("gpt2")
    assert len(tok) >= 50_000
    return tok


@pytest.fixture(scope="module")
def token_bytes(gpt2):
    from shim_adapters.mask.vocab import Vocabulary

    return Vocabulary(gpt2, len(gpt2)).token_bytes


@pytest.fixture(scope="module")
def maskers(gpt2):
    return {
        "syncode": get_backend("syncode").compile(STRING_LARK, gpt2),
        "outlines-llguidance": get_backend("outlines").compile(STRING_LARK, gpt2),
        "outlines-core": get_backend("outlines").compile(STRING_SCHEMA, gpt2),
    }


def _prefix(name: str) -> str:
    return '{"name":"' if name == "outlines-core" else '["'


def _suffix(name: str) -> str:
    return '"}' if name == "outlines-core" else '"]'


def _byte_ids(token_bytes) -> dict[int, int]:
    out: dict[int, int] = {}
    for i, b in enumerate(token_bytes):
        if b is not None and len(b) == 1:
            out.setdefault(b[0], i)
    return out


def _force(state, ids) -> None:
    for step, token_id in enumerate(ids):
        assert state.allowed_mask()[token_id], (step, token_id)
        state.advance(token_id)


@pytest.mark.parametrize("name", ["syncode", "outlines-llguidance", "outlines-core"])
def test_multibyte_text_is_generatable_byte_by_byte(maskers, gpt2, token_bytes, name):
    """One single-byte token per UTF-8 byte: every lead and continuation byte is allowed."""
    masker = maskers[name]
    byte_ids = _byte_ids(token_bytes)
    state = masker.new_state()
    _force(state, gpt2.encode(_prefix(name)))
    for byte in TEXT.encode():
        assert not state.eos_allowed()
        _force(state, [byte_ids[byte]])
    _force(state, gpt2.encode(_suffix(name)))
    assert state.eos_allowed()
    assert masker.decode(state.token_ids) == _prefix(name) + TEXT + _suffix(name)


@pytest.mark.parametrize("name", ["syncode", "outlines-llguidance", "outlines-core"])
def test_canonical_tokens_ending_mid_character_are_allowed(maskers, gpt2, token_bytes, name):
    masker = maskers[name]
    ids = gpt2.encode(_prefix(name) + TEXT + _suffix(name))
    assert any(not utf8_prefix_ok(token_bytes[i]) or incomplete_tail(token_bytes[i])
               for i in ids)  # the tokenisation really splits characters
    state = masker.new_state()
    _force(state, ids)
    assert state.eos_allowed()


@pytest.mark.parametrize("name", ["syncode", "outlines-llguidance", "outlines-core"])
@pytest.mark.parametrize("pending", [b"", b"\xe4", b"\xe4\xb8", b"\xf0\x9f", b"\xf0\x9f\x98"])
def test_high_byte_tokens_allowed_exactly_when_completable(maskers, gpt2, token_bytes, name,
                                                          pending):
    """Every token made only of bytes >= 0x80 (complete characters, lead bytes, continuation
    bytes, 0xF5-0xFF...) is allowed iff the pending bytes plus the token can still become
    UTF-8; after an unfinished character no token starting with ASCII is allowed."""
    masker = maskers[name]
    byte_ids = _byte_ids(token_bytes)
    state = masker.new_state()
    _force(state, gpt2.encode(_prefix(name)) + [byte_ids[b] for b in pending])
    mask = state.allowed_mask()
    high = [i for i, b in enumerate(token_bytes) if b and min(b) >= 0x80]
    assert len(high) > 500
    expected = np.array([utf8_prefix_ok(pending + token_bytes[i]) for i in high])
    got = mask[high]
    wrong = [(high[k], token_bytes[high[k]]) for k in np.flatnonzero(got != expected)[:5]]
    assert not wrong, f"{name} after {pending!r}: allowed != completable for {wrong}"
    assert expected.any() and not expected.all()
    if pending:
        ascii_start = [i for i, b in enumerate(token_bytes) if b and b[0] < 0x80]
        assert not mask[ascii_start].any()
        assert not state.eos_allowed()


@pytest.mark.parametrize("name", ["syncode", "outlines-llguidance", "outlines-core"])
def test_token_that_breaks_utf8_for_ever_is_refused_by_advance(maskers, gpt2, token_bytes,
                                                              name):
    masker = maskers[name]
    byte_ids = _byte_ids(token_bytes)
    state = masker.new_state()
    _force(state, gpt2.encode(_prefix(name)) + [byte_ids[0xE4]])
    for bad in (byte_ids[0xF5], byte_ids[ord("a")], byte_ids[ord('"')], byte_ids[0xE4]):
        assert not state.allowed_mask()[bad]
        with pytest.raises(ForbiddenTokenError):
            state.advance(bad)
    # the state is still usable: the character can be finished and the string closed
    _force(state, [byte_ids[0xB8], byte_ids[0xAD]] + gpt2.encode(_suffix(name)))
    assert state.eos_allowed()
    assert masker.decode(state.token_ids).endswith("中" + _suffix(name))
