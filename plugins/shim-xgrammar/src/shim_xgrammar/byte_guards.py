"""Token-byte guards: the tokens XGrammar 0.2.9 allows where the text it makes is not valid.

The conformance suite found two such holes, and the plugin closes both:

- **raw control characters inside JSON-schema strings** (after ``{"name":"`` XGrammar allows
  ``\\x00``, ``\\t``, ...), which RFC 8259 forbids unescaped, so a "guaranteed" output may
  not parse;
- **UTF-16 surrogates**: after a lone ``\\xed`` lead byte it allows continuation bytes
  ``\\xa0``-``\\xbf``, which encode U+D800-U+DFFF, never valid UTF-8 (RFC 3629). This is the
  only second-byte range it gets wrong: ``\\xe0``, ``\\xf0`` and ``\\xf4`` are right.

Each guard is a small automaton over the output's bytes, a few states, stepped once per
accepted token. Per state it holds the tokens to refuse, as packed bitmask words to clear.
Only tokens whose bytes can change the state or be refused are stored, so the tables hold a
few thousand tokens even for 150k vocabularies. Everything else is still XGrammar's to decide.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from shim_adapters.mask.bitmask import pack_mask

#: A token the guard refuses in that state.
REFUSED = -1

# the JSON string lexer's states
OUTSIDE, IN_STRING, ESCAPED = 0, 1, 2
_QUOTE, _BACKSLASH = 0x22, 0x5C
# the surrogate guard's states
PLAIN, AFTER_ED = 0, 1


def scan_json(data: bytes, lex: int) -> int:
    """The JSON string lexer's state after ``data`` from ``lex``, or REFUSED (a raw control
    byte inside a string)."""
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


def scan_surrogate(data: bytes, state: int) -> int:
    """AFTER_ED if ``data`` ends in a lone ``\\xed`` lead byte, REFUSED if it starts with
    ``\\xa0``-``\\xbf`` right after one, else PLAIN."""
    if state == AFTER_ED and 0xA0 <= data[0] <= 0xBF:
        return REFUSED
    return AFTER_ED if data[-1] == 0xED else PLAIN


class ByteGuard:
    """One guard's tables: per state, where each token leads (only where it is not the
    state's default) and the bitmask words that refuse its tokens."""

    def __init__(self, name: str, why: str, n_states: int, default: Sequence[int],
                 next_states: Sequence[dict[int, int]], words: int):
        self.name, self.why = name, why
        self.start = 0
        self.default = tuple(default)
        self.next = tuple(next_states)
        refused = [[t for t, s in table.items() if s == REFUSED] for table in self.next]
        #: state -> (word indices, words to AND them with)
        self.clear = tuple(_clear_words(ids, words) for ids in refused)
        #: state -> the refused token ids (a set for membership, sorted ids for indexing)
        self.refused = tuple(frozenset(ids) for ids in refused)
        self.refused_ids = tuple(np.array(sorted(ids), dtype=np.int64) for ids in refused)
        assert len(self.next) == len(self.default) == n_states

    def step(self, state: int, token_id: int) -> int:
        """The state after ``token_id``; REFUSED if the guard refuses it there."""
        return self.next[state].get(token_id, self.default[state])


def json_string_guard(token_bytes: Sequence[bytes], words: int,
                      skip: Sequence[int] = ()) -> ByteGuard:
    """Raw control bytes inside JSON strings (XGrammar's JSON-schema grammars)."""
    skip = set(skip)
    tables: list[dict[int, int]] = [{}, {}, {}]
    # A plain token keeps OUTSIDE and IN_STRING, and ends an escape (ESCAPED -> IN_STRING).
    default = (OUTSIDE, IN_STRING, IN_STRING)
    for token_id, data in enumerate(token_bytes):
        if token_id in skip or not data:
            continue
        if _QUOTE not in data and _BACKSLASH not in data and min(data) >= 0x20:
            continue  # plain text: every state goes to its default, nothing refused
        for lex in (OUTSIDE, IN_STRING, ESCAPED):
            after = scan_json(data, lex)
            if after != default[lex]:
                tables[lex][token_id] = after
    return ByteGuard("json-string-controls",
                     "put a raw control character inside a JSON string, which JSON forbids",
                     3, default, tables, words)


def surrogate_guard(token_bytes: Sequence[bytes], words: int,
                    skip: Sequence[int] = ()) -> ByteGuard:
    """UTF-8 surrogate continuations after a lone ``\\xed`` (every grammar)."""
    skip = set(skip)
    plain: dict[int, int] = {}
    after: dict[int, int] = {}
    for token_id, data in enumerate(token_bytes):
        if token_id in skip or not data:
            continue
        if data[-1] == 0xED:
            plain[token_id] = AFTER_ED
        state = scan_surrogate(data, AFTER_ED)
        if state != PLAIN:
            after[token_id] = state
    return ByteGuard("utf8-surrogates",
                     "complete a UTF-16 surrogate (\\xed\\xa0-\\xbf), which UTF-8 forbids",
                     2, (PLAIN, PLAIN), (plain, after), words)


def _clear_words(ids: list[int], words: int) -> tuple[np.ndarray, np.ndarray]:
    """(indices of the bitmask words holding ``ids``, those words with the ids' bits off)."""
    bits = np.zeros(words * 32, dtype=bool)
    bits[np.asarray(ids, dtype=np.int64)] = True
    packed = pack_mask(bits)
    index = np.flatnonzero(packed)
    return index, ~packed[index]
