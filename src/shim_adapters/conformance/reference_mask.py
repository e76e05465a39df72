"""The reference's verdict for *every* token of a vocabulary after one prefix, fast.

Each token's own output bytes (from the tokenizer definition, never ``encode()`` of text a
normaliser may rewrite) are appended to the prefix bytes and judged by the prefix reference
(:mod:`.prefix`). Tokens are visited in sorted byte order, which walks the vocabulary's
byte-prefix trie implicitly: the reference state after each shared prefix is computed once
and extended one character at a time (Lark lexing configurations and LALR stacks are
memoised in the checker), and a prefix that is already dead settles every token starting with
it at once. A deadline stops the walk; unvisited tokens are *skipped* and counted, never
guessed.

A token ending inside a UTF-8 character is viable when some completion of that character is
(a few witnesses are tried); when none of the witnesses is, the verdict is *undecided*, not
"dead": no false alarm.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass

import numpy as np

from shim_adapters.conformance.prefix import LarkPrefixChecker, PrefixUndecided, RegexPrefixChecker
from shim_adapters.mask.vocab import Vocabulary, decode_prefix

VIABLE, DEAD, UNDECIDED, SKIPPED, NOT_TEXT = 1, 0, -1, -2, -3


@dataclass
class MaskVerdicts:
    """Per-id verdicts (``VIABLE``/``DEAD``/``UNDECIDED``/``SKIPPED``/``NOT_TEXT``)."""

    verdicts: np.ndarray
    seconds: float
    #: Reference steps taken (one per trie node visited).
    steps: int

    def count(self, code: int) -> int:
        return int((self.verdicts == code).sum())


class _Stepper:
    """One-character steps of a prefix checker: ``begin(text)``, ``push(state, text)``."""

    def __init__(self, checker):
        self.checker = checker
        if isinstance(checker, LarkPrefixChecker):
            self.kind = "lark"
        elif isinstance(checker, RegexPrefixChecker):
            self.kind = "regex"
        else:
            self.kind = "generic"

    def begin(self, text: str):
        if self.kind == "lark":
            configs = self.checker._configs(text)
            return configs or None
        return True if self.checker.viable(text) else None

    def push(self, state, text: str):
        """State after ``text`` (the previous text plus one character), or None if dead."""
        if self.kind == "lark":
            return self.checker._extend(state, len(text) - 1, text) or None
        return True if self.checker.viable(text) else None


def _utf8_need(lead: int) -> int:
    return 2 if 0xC2 <= lead <= 0xDF else 3 if 0xE0 <= lead <= 0xEF else \
        4 if 0xF0 <= lead <= 0xF4 else 0


def _witnesses(pending: bytes) -> list[str]:
    """A few characters whose UTF-8 encoding starts with ``pending``."""
    need = _utf8_need(pending[0]) - len(pending)
    out = []
    for fill in (0x80, 0xA0, 0x90, 0xBF, 0x85, 0x8F, 0xB0, 0x9F):
        try:
            out.append((pending + bytes([fill]) * need).decode())
        except UnicodeDecodeError:
            continue
    return list(dict.fromkeys(out))


def _upper(prefix: bytes) -> bytes | None:
    """The smallest byte string greater than every string starting with ``prefix``."""
    p = bytearray(prefix)
    while p and p[-1] == 0xFF:
        p.pop()
    if not p:
        return None
    p[-1] += 1
    return bytes(p)


def reference_verdicts(checker, prefix: bytes, vocab: Vocabulary,
                       deadline: float = float("inf")) -> MaskVerdicts:
    """The reference's verdict on ``prefix + token`` for every id of ``vocab``."""
    t0 = time.perf_counter()
    width = vocab.logits_width
    out = np.full(width, NOT_TEXT, dtype=np.int8)
    order, keys = vocab.sorted_text
    out[order] = SKIPPED
    stepper = _Stepper(checker)
    steps = 0
    try:
        text0, tail0 = decode_prefix(prefix)
        root = stepper.begin(text0)
    except UnicodeDecodeError:
        root = None
        text0, tail0 = "", b""
    except PrefixUndecided:
        out[order] = UNDECIDED
        return MaskVerdicts(out, time.perf_counter() - t0, 0)
    if root is None:
        out[order] = DEAD
        return MaskVerdicts(out, time.perf_counter() - t0, 0)
    # frames[k]: (state, text, pending) after the first k bytes of ``path``.
    frames: list[tuple] = [(root, text0, tail0)]
    path = b""
    n = len(keys)
    i = 0
    while i < n:
        if (i & 127) == 0 and time.perf_counter() > deadline:
            break  # the rest stays SKIPPED
        key = keys[i]
        common = 0
        limit = min(len(path), len(key))
        while common < limit and path[common] == key[common]:
            common += 1
        del frames[common + 1:]
        path = key[:common]
        dead_at = None
        undecided_at = None
        for k in range(common, len(key)):
            state, text, pending = frames[-1]
            pending = pending + key[k:k + 1]
            try:
                ch = pending.decode()
            except UnicodeDecodeError as exc:
                if exc.reason == "unexpected end of data" and _utf8_need(pending[0]) > len(pending):
                    frames.append((state, text, pending))
                    path = key[:k + 1]
                    continue
                dead_at = k
                break
            text = text + ch
            steps += 1
            try:
                state = stepper.push(state, text)
            except PrefixUndecided:
                undecided_at = k
                break
            if state is None:
                dead_at = k
                break
            frames.append((state, text, b""))
            path = key[:k + 1]
        stop = dead_at if dead_at is not None else undecided_at
        if stop is not None:
            settled = key[:stop + 1]
            upper = _upper(settled)
            j = n if upper is None else bisect.bisect_left(keys, upper, lo=i)
            out[order[i:j]] = DEAD if dead_at is not None else UNDECIDED
            i = j
            continue
        state, text, pending = frames[-1]
        if not pending:
            out[order[i]] = VIABLE
        else:
            verdict = UNDECIDED
            for ch in _witnesses(pending):
                steps += 1
                try:
                    if stepper.push(state, text + ch) is not None:
                        verdict = VIABLE
                        break
                except PrefixUndecided:
                    continue
            out[order[i]] = verdict
        i += 1
    return MaskVerdicts(out, time.perf_counter() - t0, steps)
