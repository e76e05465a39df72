"""Token bytes and backend vocabularies built from a Hugging Face tokenizer, cached by content.

Constrained decoding works on the exact bytes a token adds to the output. Byte-level BPE
tokenizers (GPT-2, Qwen, Llama-3) spell bytes as printable characters (``Ġ`` is a space) and a
token may hold half of a UTF-8 character; turning tokens into strings (what outlines does)
replaces such halves with U+FFFD and makes valid multi-token characters impossible. Here every
token maps to its raw bytes, and special tokens map to None (never text; EOS is handled apart).

Every cache is keyed on the tokenizer's content hash (:mod:`shim_adapters.tokenizer_identity`),
never on its class or size.
"""

from __future__ import annotations

import json
from typing import Iterable

from shim_adapters.errors import VocabMismatchError
from shim_adapters.tokenizer_identity import TokenizerIdentity

from .caching import LRUCache

_TOKEN_BYTES: LRUCache[tuple] = LRUCache(maxsize=8)
_OC_VOCABULARIES: LRUCache[object] = LRUCache(maxsize=8)
_LLG_TOKENIZERS: LRUCache[object] = LRUCache(maxsize=8)


def _decoder_types(tokenizer) -> set[str]:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return set()
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    found = {decoder.get("type")}
    for sub in decoder.get("decoders", []) or []:
        found.add(sub.get("type"))
    return {t for t in found if t}


def special_token_ids(tokenizer) -> frozenset[int]:
    """Ids that are never text: the special tokens and added tokens marked special."""
    ids = set(tokenizer.all_special_ids)
    for token_id, added in getattr(tokenizer, "added_tokens_decoder", {}).items():
        if getattr(added, "special", False):
            ids.add(int(token_id))
    return frozenset(ids)


def _build_token_bytes(tokenizer) -> tuple[bytes | None, ...]:
    decoders = _decoder_types(tokenizer)
    specials = special_token_ids(tokenizer)
    table: list[bytes | None] = [None] * len(tokenizer)
    vocab = tokenizer.get_vocab()
    if "ByteLevel" in decoders:
        from transformers.models.gpt2.tokenization_gpt2 import bytes_to_unicode

        char_to_byte = {c: b for b, c in bytes_to_unicode().items()}

        def to_bytes(piece: str) -> bytes:
            try:
                return bytes(char_to_byte[c] for c in piece)
            except KeyError:  # an added (non-byte-level) token: its text as is
                return piece.encode("utf-8")
    elif "ByteFallback" in decoders or "Metaspace" in decoders or "Replace" in decoders:
        def to_bytes(piece: str) -> bytes:
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                return bytes([int(piece[3:5], 16)])
            return piece.replace("\u2581", " ").encode("utf-8")
    else:
        def to_bytes(piece: str) -> bytes:
            text = tokenizer.convert_tokens_to_string([piece])
            if "\ufffd" in text:
                raise VocabMismatchError(
                    f"cannot tell the bytes of token {piece!r} for a tokenizer with decoders "
                    f"{sorted(decoders) or 'none'}; only byte-level and SentencePiece "
                    "(byte-fallback) tokenizers are supported")
            return text.encode("utf-8")
    for piece, token_id in vocab.items():
        if token_id >= len(table):
            raise VocabMismatchError(f"token {piece!r} has id {token_id} >= len(tokenizer) "
                                     f"{len(table)}")
        if token_id in specials:
            continue
        table[token_id] = to_bytes(piece)
    return tuple(table)


def token_bytes_table(tokenizer) -> tuple[bytes | None, ...]:
    """Per token id, the bytes it adds to the output; None for special tokens."""
    key = TokenizerIdentity.of(tokenizer).sha256
    return _TOKEN_BYTES.get_or_build(key, lambda: _build_token_bytes(tokenizer))


def outlines_core_vocabulary(tokenizer, eos_token_id: int):
    """An ``outlines_core.Vocabulary`` over raw token bytes (specials and empty tokens left out)."""
    import outlines_core

    key = (TokenizerIdentity.of(tokenizer).sha256, eos_token_id, outlines_core_version())

    def build():
        mapping: dict[bytes, list[int]] = {}
        for token_id, data in enumerate(token_bytes_table(tokenizer)):
            if data and token_id != eos_token_id:
                mapping.setdefault(data, []).append(token_id)
        return outlines_core.Vocabulary(eos_token_id, mapping)

    return _OC_VOCABULARIES.get_or_build(key, build)


def llguidance_tokenizer(tokenizer, eos_token_ids: Iterable[int]):
    """An ``llguidance.LLTokenizer`` for a fast HF tokenizer (about a second to build: cached)."""
    import llguidance
    import llguidance.hf

    eos = sorted(eos_token_ids)
    key = (TokenizerIdentity.of(tokenizer).sha256, tuple(eos), llguidance.__version__)
    return _LLG_TOKENIZERS.get_or_build(
        key, lambda: llguidance.hf.from_tokenizer(tokenizer, eos_token=eos))


def outlines_core_version() -> str:
    from importlib.metadata import version

    return version("outlines_core")
