"""GPT-2's byte-level BPE alphabet: the printable character that stands for each byte.

Byte-level tokenizers (GPT-2, Llama 3, Qwen, SmolLM2, ...) spell every token with these 256
characters, so a token's output bytes are its characters mapped back through this table. The
table is fixed by the scheme itself; it is written out here because transformers 5 no longer
exports its copy from the GPT-2 tokenizer module.
"""

from __future__ import annotations

from functools import lru_cache

#: Bytes that stand for themselves: printable ASCII and printable Latin-1 (no soft hyphen).
_PRINTABLE = (*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
              *range(ord("®"), ord("ÿ") + 1))


@lru_cache(maxsize=1)
def _table() -> tuple[tuple[str, int], ...]:
    kept = set(_PRINTABLE)
    pairs = [(chr(b), b) for b in _PRINTABLE]
    others = [b for b in range(256) if b not in kept]
    # the other bytes take the characters from U+0100 on, in byte order
    pairs += [(chr(256 + k), b) for k, b in enumerate(others)]
    return tuple(pairs)


def byte_level_alphabet() -> dict[str, int]:
    """char -> byte for all 256 bytes (a fresh dict the caller may keep)."""
    return dict(_table())
