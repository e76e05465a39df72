"""Token bytes and backend vocabularies built from a Hugging Face tokenizer, cached by content.

Constrained decoding works on the exact bytes a token adds to the output. Byte-level BPE
tokenizers (GPT-2, Qwen, Llama-3) spell bytes as printable characters (``Ġ`` is a space) and a
token may hold half of a UTF-8 character; turning tokens into strings (what outlines does)
replaces such halves with U+FFFD and makes valid multi-token characters impossible. Here every
token maps to its raw bytes, and special tokens map to None (never text; EOS is handled apart).

Every cache is keyed on the tokenizer's content hash (:mod:`shim_adapters.mask.tokenizer_identity`),
never on its class or size.
"""

from __future__ import annotations

import json
from typing import Iterable

from shim_adapters.errors import VocabMismatchError
from shim_adapters.mask.byte_level import byte_level_alphabet
from shim_adapters.mask.tokenizer_identity import TokenizerIdentity

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
        char_to_byte = byte_level_alphabet()

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


def llguidance_byte_mismatches(ll_tokenizer, tokenizer, limit: int = 5
                               ) -> list[tuple[int, bytes, bytes]]:
    """Tokens whose bytes in ``ll_tokenizer`` differ from :func:`token_bytes_table`: up to
    ``limit`` (id, ours, llguidance's), special tokens left out, and tokens starting with the
    byte 0xFF (llguidance's special-token marker: it cannot spell them; 0xFF never occurs in
    UTF-8 text, so no grammar over text needs them).

    ``llguidance.hf.from_tokenizer`` guesses byte-level vs SentencePiece from the tokenizer's
    decoder. A tokenizer that transformers converted from GGUF (SmolLM2's here) carries the
    decoder chain ``ByteFallback, Fuse, Replace, ByteLevel``; llguidance 1.9 reads it as
    SentencePiece and keeps ``Ġ`` as the two bytes C4 A0 instead of a space, so its masks are
    for other text (after ``SELECT`` only the token ``T`` is allowed, and then refused)."""
    table = token_bytes_table(tokenizer)
    found: list[tuple[int, bytes, bytes]] = []
    for token_id, ours in enumerate(table):
        if ours is None or ours[:1] == b"\xff" or token_id >= ll_tokenizer.vocab_size:
            continue
        theirs = ll_tokenizer.decode_bytes([token_id])
        if theirs != ours:
            found.append((token_id, ours, theirs))
            if len(found) >= limit:
                break
    return found


class _ByteTableTokenizer:
    """What ``llguidance.TokenizerWrapper`` reads: the raw token bytes of
    :func:`token_bytes_table` (special tokens as 0xFF + their text, llguidance's convention)
    and the HF tokenizer's own encoding for canonical tokenisation of forced text."""

    def __init__(self, tokenizer, eos_token_ids: list[int]):
        specials = special_token_ids(tokenizer)
        table = token_bytes_table(tokenizer)
        self._tokenizer = tokenizer
        self.eos_token_id = eos_token_ids[0] if eos_token_ids else tokenizer.eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        self.special_token_ids = sorted(specials)
        # special tokens and ids without a token (holes) are never text
        self.tokens = [b"\xff" + (tokenizer.convert_ids_to_tokens(i) or f"<id {i}>").encode()
                       if data is None else data for i, data in enumerate(table)]

    def __call__(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False)


def llguidance_tokenizer(tokenizer, eos_token_ids: Iterable[int]):
    """An ``llguidance.LLTokenizer`` for a fast HF tokenizer (about a second to build: cached).

    Built by ``llguidance.hf.from_tokenizer`` and checked token by token against
    :func:`token_bytes_table`; where llguidance read other bytes (see
    :func:`llguidance_byte_mismatches`) it is rebuilt from the byte table instead."""
    import llguidance
    import llguidance.hf

    eos = sorted(eos_token_ids)
    key = (TokenizerIdentity.of(tokenizer).sha256, tuple(eos), llguidance.__version__)

    def build():
        ll = llguidance.hf.from_tokenizer(tokenizer, eos_token=eos)
        if not llguidance_byte_mismatches(ll, tokenizer, limit=1):
            return ll
        wrapped = llguidance.TokenizerWrapper(_ByteTableTokenizer(tokenizer, eos))
        ll = llguidance.LLTokenizer(wrapped, n_vocab=len(tokenizer), eos_token=eos)
        wrong = llguidance_byte_mismatches(ll, tokenizer, limit=1)
        if wrong:
            token_id, ours, theirs = wrong[0]
            raise VocabMismatchError(f"llguidance keeps reading token {token_id} as {theirs!r}, "
                                     f"not its bytes {ours!r}, even when given the byte table")
        return ll

    return _LLG_TOKENIZERS.get_or_build(key, build)


def outlines_core_version() -> str:
    from importlib.metadata import version

    return version("outlines_core")
