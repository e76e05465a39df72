"""Raw control characters inside JSON strings: the tokens XGrammar 0.2.9 wrongly allows there.

XGrammar's JSON-schema grammars let string content take U+0000-U+001F unescaped (found by the
conformance suite: after ``{"name":"`` it allows ``\\x00``, ``\\t``, ...), which RFC 8259
forbids, so a "guaranteed" output may not parse. This guard removes exactly those tokens.

It follows the output through a three-state lexer on the tokens' bytes, outside a string,
inside one, and right after a backslash inside one. Per state it keeps the tokens that would
put a raw control byte inside a string, before or after a quote within the token, as packed
bitmask words to clear. Everything else, escapes included, is still XGrammar's to decide.
Only tokens that hold a quote, a backslash or a control byte can change the lexer state or be
refused, so the tables hold a few thousand tokens even for 150k vocabularies.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

OUTSIDE, IN_STRING, ESCAPED = 0, 1, 2
#: A token that puts a raw control byte inside a string.
REFUSED = -1
_QUOTE, _BACKSLASH = 0x22, 0x5C


def scan(data: bytes, lex: int) -> int:
    """The lexer state after ``data`` from ``lex``, or REFUSED."""
    for b in data:
        if lex == OUTSIDE:
            if b == _QUOTE:
                lex = IN_STRING
        elif lex == IN_STRING:
            if b == _QUOTE:
                lex = OUTSIDE
            elif b == _BACKSLASH:
                lex = ESCAPED
            elif b < 0x20:
                return REFUSED
        else:  # the escaped character (its validity is XGrammar's)
            if b < 0x20:
                return REFUSED
            lex = IN_STRING
    return lex


class JsonStringGuard:
    """Per lexer state: where each token leads, and the bitmask words that refuse the
    tokens putting a raw control byte inside a string."""

    def __init__(self, token_bytes: Sequence[bytes], words: int, skip: Sequence[int] = ()):
        skip = set(skip)
        #: lexer state -> {token id: next state or REFUSED}, for the tokens that matter
        self.next: tuple[dict[int, int], ...] = ({}, {}, {})
        refused: list[list[int]] = [[], [], []]
        for token_id, data in enumerate(token_bytes):
            if token_id in skip or not data:
                continue
            if _QUOTE not in data and _BACKSLASH not in data and min(data) >= 0x20:
                continue  # plain text: the state stays, nothing refused
            for lex in (OUTSIDE, IN_STRING, ESCAPED):
                after = scan(data, lex)
                if after != lex:
                    self.next[lex][token_id] = after
                if after == REFUSED:
                    refused[lex].append(token_id)
        #: lexer state -> (word indices, words to AND them with)
        self.clear: tuple[tuple[np.ndarray, np.ndarray], ...] = tuple(
            _clear_words(ids, words) for ids in refused)
        #: lexer state -> the refused token ids (for messages)
        self.refused: tuple[frozenset[int], ...] = tuple(frozenset(ids) for ids in refused)

    def step(self, lex: int, token_id: int) -> int:
        """The state after ``token_id``; REFUSED if it breaks the string rule."""
        return self.next[lex].get(token_id, lex)


def _clear_words(ids: list[int], words: int) -> tuple[np.ndarray, np.ndarray]:
    bits = np.zeros(words * 32, dtype=bool)
    bits[np.asarray(ids, dtype=np.int64)] = True
    packed = np.packbits(bits, bitorder="little").view(np.int32)
    index = np.flatnonzero(packed)
    return index, ~packed[index]
