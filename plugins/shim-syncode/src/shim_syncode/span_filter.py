"""Which multi-lexeme ("span") tokens the parser can possibly accept, decided in bulk.

SynCode's store never allows a token that spans several lexemes, so the masker checks each
such candidate with :meth:`FrontierParser.would_accept` (a parser fork, a re-lex and a parse:
tens of microseconds). Most candidates fail, and they fail for reasons visible without a
fork: the lexemes inside the token cannot follow the parser's stack. This module rules those
out with per-(terminal, DFA state) token tables and one LALR check per distinct way the rest
of a token lexes, so only the few that may pass are checked one by one; the mask stays
exactly what the per-token loop gave.

Why it is exact (a necessary condition, never a sufficient one): when ``d`` is fed after the
tail ``T``, SynCode's basic lexer re-lexes from the frontier. Lexemes of ``T`` that end before
the first lexeme reading into ``d`` are unchanged (a regex match that ends inside ``T`` does not
depend on what follows, unless a higher-priority alternative reads on, and then *that* one is
the crossing lexeme). So the text lexes as: the current lexemes before some position ``p`` of
``T`` (a lexeme start, a gap between lexemes, or where lexing stopped), one lexeme of terminal
``X`` from ``p`` that ends at byte ``k`` of ``d`` (or covers all of ``d``), then ``d[k:]`` lexed
on its own, which depends on the token alone and is tabled. :meth:`SpanFilter.possible` keeps
a token if for some such ``(p, X, k)`` every lexeme but the last parses from the stack at ``p``
and the end is one that ``is_valid_prefix`` (or its open-start fallback) could accept; every
bound used is looser than the parser's own rule. Pending UTF-8 bytes are read as the start of
the token. Anything outside these assumptions (``ignore_whitespace``, a lexeme that may end
right before pending bytes, tokens that are not whole UTF-8) is kept and checked.
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass

import numpy as np

from ._syncode_import import syncode_modules
from .frontier_parser import FrontierParser, GrammarTables, LexerState, UnexpectedCharacters

_UnlessCallback = syncode_modules()["syncode.larkm.lexer"].UnlessCallback


#: bound on the token ids held by memoised (stack, terminal, DFA state) answers: 32 MiB
_MEMO_IDS = 8 << 20


@dataclass(frozen=True)
class LexSummary:
    """How ``rest`` (a token's bytes after a lexeme boundary) lexes on its own."""

    types: tuple[str, ...]  # non-ignored lexemes, in order
    #: per lexeme: terminals alive over its own text / over the text from its start to the end
    value_live: tuple[frozenset, ...]
    live_to_end: tuple[frozenset, ...]
    ends_ignored: bool  # no unlexable tail, and ignored text after the last lexeme
    tail_live: frozenset | None  # terminals alive over an unlexable tail (None: no tail)


@dataclass(frozen=True)
class _CutTable:
    """Per (terminal, DFA state): pool tokens with a cut point, and per token (CSR rows from
    ``indptr`` into ``indices``) the local numbers of its summaries (ids in ``entries``)."""

    ids: np.ndarray
    entries: np.ndarray
    indices: np.ndarray
    indptr: np.ndarray


class SpanFilter:
    """Per-grammar, per-tokenizer tables for bulk span-candidate checks; thread-safe."""

    def __init__(self, tables: GrammarTables, token_bytes: list[bytes], pool: np.ndarray,
                 inside: dict):
        self.tables = tables
        self.token_bytes = token_bytes
        self.n = len(token_bytes)
        self.ignore = frozenset(tables.ignore_terminals)
        self.inside = inside
        self.pool = np.flatnonzero(pool)
        whole = np.array([_decodes(token_bytes[i]) for i in self.pool], dtype=np.bool_)
        #: pool tokens that are not whole UTF-8 (after the continuation bytes that may finish
        #: a pending character): always checked one by one
        self.undecodable = np.zeros(self.n, dtype=np.bool_)
        self.undecodable[self.pool[~whole]] = True
        self._decodable = self.pool[whole]
        self._lock = threading.Lock()
        self._tables: dict[tuple[str, object], _CutTable] = {}
        self._summaries: list[LexSummary] = []
        self._summary_of: dict[bytes, int] = {}
        self._passing_memo: dict[tuple, np.ndarray] = {}
        self._memo_ids = 0
        self._verdicts: dict[tuple, dict[int, bool]] = {}
        self._accepts: dict[tuple, frozenset] = {}
        self._types: dict[str, tuple[str, ...] | None] = {}

    # ---- per step -----------------------------------------------------------------------
    def possible(self, parser: FrontierParser) -> np.ndarray | None:
        """Tokens of the pool that ``parser.would_accept`` may accept (a superset), or None
        when this state is outside the filter's assumptions (check every candidate)."""
        if parser._ignore_whitespace:
            return None
        pending = parser.pending_bytes
        keep = self.undecodable.copy()
        for stack, live in self._scenarios(parser):
            if pending:
                # The text lexed is T + pending + token: a lexeme reading into the token reads
                # the pending bytes first, unless it ends right before them (then give up).
                if any(state in self.tables.fsms[name].finals for name, state in live.items()):
                    return None
                live, _ = self.tables.advance_map(live, pending)
            acc = self._acc(stack) | self.ignore
            for name, state in live.items():
                if name in acc:
                    inside = self.inside.get((name, state))
                    if inside is not None:
                        keep |= inside
                keep[self._passing(stack, name, state)] = True
        return keep

    def _passing(self, stack: tuple, name: str, state) -> np.ndarray:
        """Pool tokens for which lexeme ``name`` (at DFA ``state`` after T[p:]) may close at
        a cut point and the rest be taken from ``stack``: one check per distinct summary."""
        key = (stack, name, state)
        found = self._passing_memo.get(key)
        if found is None:
            table = self._table(name, state)
            if not len(table.ids):
                found = table.ids
            else:
                verdicts = self._verdicts.get((stack, name))
                if verdicts is None:
                    verdicts = self._verdicts[(stack, name)] = {}
                ok = np.fromiter((self._entry_ok(verdicts, stack, name, e) for e in table.entries),
                                 dtype=np.bool_, count=len(table.entries))
                found = table.ids[np.logical_or.reduceat(ok[table.indices], table.indptr)]
            if self._memo_ids + len(found) > _MEMO_IDS or len(self._verdicts) > 65536:
                self._passing_memo.clear()
                self._verdicts.clear()
                self._memo_ids = 0
            self._passing_memo[key] = found
            self._memo_ids += len(found) + 1
        return found

    def _entry_ok(self, verdicts: dict, stack: tuple, name: str, entry: int) -> bool:
        found = verdicts.get(entry)
        if found is None:
            found = verdicts[entry] = self._check(stack, name, self._summaries[entry])
        return found

    def _scenarios(self, parser: FrontierParser):
        """(LALR stack at p, terminals alive over T[p:]) for every p where the first lexeme
        reading into the next token may start: a lexeme start still open, the start of an
        ignored lexeme in a gap, or the end of the lexed text (where lexing stopped)."""
        tables = parser.tables
        text = parser._text
        tokens, stacks = parser._tokens, parser._stacks
        ends = [t.end_pos for t in tokens]
        limit = parser.lexer_pos if parser._lex_incomplete else len(text)
        positions = dict(parser._open)  # start -> terminals alive from it
        gap_starts = [0] + ends
        gap_ends = [t.start_pos for t in tokens] + [limit]
        for a, b in zip(gap_starts, gap_ends):
            pos = a
            while pos < b:  # the ignored lexemes the lexer skips here, as it skips them
                if pos not in positions:
                    positions[pos] = None
                found = tables.lexer.match(text, pos)
                if not found or not found[0]:
                    break
                pos += len(found[0])
        if limit not in positions:
            positions[limit] = parser._tail_map if parser._lex_incomplete else None
        for p, live in positions.items():
            before = bisect.bisect_right(ends, p)
            if before > len(stacks):
                continue  # a lexeme before p failed to parse: anything after it is refused
            if live is None:
                live, _ = tables.advance_map(tables.initial_map(), text[p:].encode("utf-8"))
            if live:
                yield stacks[before - 1] if before else parser._base_stack, live

    def _check(self, stack: tuple, name: str, summary: LexSummary) -> bool:
        types = self._types_of(name)
        if types is None:
            return True  # a lexer callback may give it any type
        return any(self._check_seq(stack, [] if t in self.ignore else [t], summary)
                   for t in types)

    def _types_of(self, name: str) -> tuple[str, ...] | None:
        """Types the lexer may give a lexeme matched by ``name``: Lark retypes a match that
        equals a keyword (``UnlessCallback``); other callbacks are unknown (None)."""
        found = self._types.get(name, False)
        if found is False:
            lexer = self.tables.lexer
            lexer.scanner  # noqa: B018 (builds the callbacks)
            callback = lexer.callback.get(name)
            if callback is None:
                found = (name,)
            elif isinstance(callback, _UnlessCallback):
                found = (name, *sorted(callback.scanner.allowed_types))
            else:
                found = None
            self._types[name] = found
        return found

    def _check_seq(self, stack: tuple, head: list, summary: LexSummary) -> bool:
        """The crossing lexeme (``head``: its type, or nothing if ignored) then the summary's
        lexemes, from ``stack``: False only where FrontierParser.would_accept is False."""
        seq = head + list(summary.types)
        tables = self.tables
        cur = list(stack)
        stacks = [tuple(cur)]  # stacks[i]: before seq[i]
        for i, terminal in enumerate(seq):
            try:
                tables.feed(cur, terminal)
            except KeyError:
                if i < len(seq) - 1:
                    return False  # a lexeme that is not the last fails to parse: NonViableText
                break
            stacks.append(tuple(cur))
        all_parsed = len(stacks) == len(seq) + 1
        ignore = self.ignore
        if summary.tail_live is not None:  # INCOMPLETE: the unlexable tail is the remainder
            if summary.tail_live & (self._acc(stacks[-1]) | ignore):
                return True
        elif summary.ends_ignored and all_parsed:
            return True  # COMPLETE: only ignored text after the last lexeme
        elif not summary.types:
            return True  # the remainder is the crossing lexeme, whose text starts before d
        elif summary.value_live[-1] & (self._acc(stacks[len(seq) - 1]) | ignore):
            return True  # MAYBE_COMPLETE / parse-incomplete: the last lexeme is the remainder
        # open-start fallback: a lexeme of the token still alive at its end
        shift = len(head)
        for j, live in enumerate(summary.live_to_end):
            if live and live & self._acc(stacks[min(shift + j, len(stacks) - 1)]):
                return True
        return False

    def _acc(self, stack: tuple) -> frozenset:
        found = self._accepts.get(stack)
        if found is None:
            found = self._accepts[stack] = frozenset(self.tables.accepts(list(stack)))
        return found

    # ---- per (terminal, DFA state), built on first use ---------------------------------
    def _table(self, name: str, state) -> "_CutTable":
        key = (name, state)
        found = self._tables.get(key)
        if found is None:
            with self._lock:
                found = self._tables.get(key)
                if found is None:
                    found = self._tables[key] = self._build_table(name, state)
        return found

    def _build_table(self, name: str, state) -> "_CutTable":
        """Decodable pool tokens with a cut point (``name`` final at a character boundary
        before their end), each with the summaries of the bytes after its cut points."""
        fsm = self.tables.fsms[name]
        finals = fsm.finals
        ids: list[int] = []
        per_token: list[list[int]] = []
        for i in self._decodable:
            data = self.token_bytes[i]
            cur = state
            # a token finishing a pending character cannot be cut before its first whole one
            cuts = [0] if cur in finals and not 0x80 <= data[0] <= 0xBF else []
            for k, byte in enumerate(data):
                cur = fsm.get_next_state(cur, byte)
                if cur is None:
                    break
                if cur in finals and k + 1 < len(data) and not 0x80 <= data[k + 1] <= 0xBF:
                    cuts.append(k + 1)
            if cuts:
                ids.append(int(i))
                per_token.append(sorted({self._summary(data[k:]) for k in cuts}))
        entries = sorted({e for row in per_token for e in row})
        local = {e: j for j, e in enumerate(entries)}
        indices = np.array([local[e] for row in per_token for e in row], dtype=np.int64)
        indptr = np.cumsum([0] + [len(row) for row in per_token[:-1]], dtype=np.int64)
        return _CutTable(ids=np.array(ids, dtype=np.int32),
                         entries=np.array(entries, dtype=np.int64), indices=indices,
                         indptr=indptr)

    def _summary(self, rest: bytes) -> int:
        found = self._summary_of.get(rest)
        if found is None:
            self._summaries.append(self._lex(rest))
            found = self._summary_of[rest] = len(self._summaries) - 1
        return found

    def _lex(self, rest: bytes) -> LexSummary:
        tables = self.tables
        text = rest.decode("utf-8")
        state = LexerState(text)
        lexemes = []
        tail_at = None
        try:
            while state.line_ctr.char_pos < len(text):
                token = tables.lexer.next_token(state)
                lexemes.append((token.type, token.start_pos, token.end_pos))
        except UnexpectedCharacters:
            tail_at = state.line_ctr.char_pos
        except EOFError:
            pass

        def live(part: str) -> frozenset:
            return frozenset(tables.advance_map(tables.initial_map(), part.encode("utf-8"))[0])

        tail_live = live(text[tail_at:]) if tail_at is not None else None
        last_end = lexemes[-1][2] if lexemes else 0
        return LexSummary(
            types=tuple(t for t, _, _ in lexemes),
            value_live=tuple(live(text[s:e]) for _, s, e in lexemes),
            live_to_end=tuple(live(text[s:]) for _, s, _ in lexemes),
            ends_ignored=tail_at is None and last_end < len(text),
            tail_live=tail_live)


def _decodes(data: bytes) -> bool:
    """Whether ``data`` is whole UTF-8 after up to three leading continuation bytes (which
    finish a character left pending by earlier tokens)."""
    lead = 0
    while lead < min(3, len(data)) and 0x80 <= data[lead] <= 0xBF:
        lead += 1
    try:
        data[lead:].decode("utf-8")
    except UnicodeDecodeError:
        return False
    return bool(data)
