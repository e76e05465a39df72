"""SynCode's incremental parser, fed only the text appended since the last step.

SynCode's :class:`IncrementalParser` re-lexes the whole output on every call, finds its cached
parser state by hashing the tuple of *all* lexer tokens, deep-copies the list of parsed tokens
and the parse-tree value stack on every stored state: each step costs time proportional to the
output length. :class:`FrontierParser` keeps SynCode's semantics (its remainder rules and
:class:`ParseResult`, which the mask store consumes) but only re-lexes from the *frontier*: the
earliest lexeme start from which some terminal's DFA is still alive. A lexeme that no terminal
can extend any more is final whatever text follows, so everything before the frontier is lexed
and parsed once. The parser keeps only LALR state stacks (no parse tree), one per lexeme.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Mapping, NamedTuple

from ._syncode_import import syncode_modules

_mods = syncode_modules()
IncrementalParser = _mods["syncode.parsers.incremental_parser"].IncrementalParser
ParseResult = _mods["syncode.parse_result"].ParseResult
RemainderState = _mods["syncode.parse_result"].RemainderState
JointFSMState = _mods["syncode.mask_store.fsm_set"].JointFSMState
LexerState = _mods["syncode.larkm.lexer"].LexerState
UnexpectedCharacters = _mods["syncode.larkm.exceptions"].UnexpectedCharacters
Shift = _mods["syncode.larkm.parsers.lalr_analysis"].Shift

#: terminal name -> DFA state: the terminals still alive after some text.
LiveMap = Mapping[str, object]


class NonViableText(ValueError):
    """The text cannot be extended to a string of the grammar (a closed lexeme fails to parse)."""


@dataclass(frozen=True)
class GrammarTables:
    """Per-grammar, read-only data shared by every parser of one masker."""

    lexer: object  # syncode.larkm BasicLexer
    states: Mapping  # LALR parse table: state -> {symbol: (action, arg)}
    start_state: object
    end_state: object
    ignore_terminals: tuple[str, ...]
    #: LALR state -> canonical number (Lark numbers states differently on every build)
    state_names: Mapping[object, int]
    fsms: Mapping[str, object]  # terminal -> syncode ByteFSM
    live_states: Mapping[str, frozenset]  # terminal -> DFA states from which a final is reachable
    initial: Mapping[str, object]  # terminal -> its DFA's initial state

    @classmethod
    def build(cls, base_parser, fsm_set) -> "GrammarTables":
        table = base_parser.parser.parser._parse_table
        fsms = dict(fsm_set._terminals_to_byte_fsm)
        live = {name: frozenset(s for s in fsm.transitions if fsm.islive(s))
                for name, fsm in fsms.items()}
        return cls(lexer=base_parser.parse_interactive("").lexer_thread.lexer,
                   states=table.states, start_state=table.start_states["start"],
                   end_state=table.end_states["start"],
                   state_names=canonical_state_numbers(table.states, table.start_states["start"]),
                   ignore_terminals=tuple(base_parser.lexer_conf.ignore),
                   fsms=fsms, live_states=live,
                   initial={name: fsm.initial for name, fsm in fsms.items()})

    def initial_map(self) -> Mapping[str, object]:
        """Every terminal at its DFA's initial state (read-only; advance_map copies)."""
        return self.initial

    def advance_map(self, live: LiveMap, data: bytes) -> tuple[dict[str, object], bool]:
        """Feed ``data`` to every live terminal DFA; also report whether any hit a final state."""
        out: dict[str, object] = {}
        hit_final = False
        for name, state in live.items():
            fsm = self.fsms[name]
            finals = fsm.finals
            for byte in data:
                state = fsm.get_next_state(state, byte)
                if state is None:
                    break
                if state in finals:
                    hit_final = True
            if state is not None and state in self.live_states[name]:
                out[name] = state
        return out, hit_final

    def accepts(self, stack: list) -> set[str]:
        """Terminals the LALR parser can take next (Lark's ``accepts()``, without tree copies)."""
        return {t for t in self.states[stack[-1]] if t.isupper() and self._can_feed(stack, t)}

    def _can_feed(self, stack: list, terminal: str) -> bool:
        stack = list(stack)
        try:
            self.feed(stack, terminal)
        except KeyError:
            return False
        return True

    def feed(self, stack: list, terminal: str) -> None:
        """Shift ``terminal`` onto ``stack`` in place (reducing first); KeyError if impossible."""
        states = self.states
        is_end = terminal == "$END"
        while True:
            action, arg = states[stack[-1]][terminal]
            if action is Shift:
                if is_end:
                    raise KeyError(terminal)
                stack.append(arg)
                return
            size = len(arg.expansion)
            if size:
                del stack[-size:]
            _, goto = states[stack[-1]][arg.origin.name]
            stack.append(goto)
            if is_end and goto == self.end_state:
                return


class Lexeme(NamedTuple):
    """A lexer token, positioned in the parser's unfrozen text (what _get_remainder reads)."""

    type: str
    value: str
    start_pos: int
    end_pos: int


class FrontierParser(IncrementalParser):
    """One sequence's lexer/parser state; :meth:`feed` appends bytes and returns SynCode's result.

    Lexemes before the frontier are frozen: only the LALR stack after them is kept, and their
    text is dropped, so memory, :meth:`fork` and every step cost O(unfinished tail), not
    O(output). Not thread-safe and not shared: :meth:`fork` gives an independent copy.
    """

    def __init__(self, tables: GrammarTables, ignore_whitespace: bool = False) -> None:
        # SynCode's constructor builds a Lark InteractiveParser we do not use; set its fields.
        self.tables = tables
        self._ignore_whitespace = ignore_whitespace
        self.lexer_pos = 0
        self.parsed_lexer_tokens: list = []
        self.cur_ac_terminals: set = set()
        self.next_ac_terminals: set = set()
        self.dedent_queue: list = []
        # Frozen prefix: summarised by the parser state after it.
        start = (tables.start_state,)
        self._base_stack: tuple = start
        self._base_accepts = frozenset(tables.accepts(list(start)))
        self._base_prev_accepts: frozenset = frozenset()
        self._base_last: Lexeme | None = None
        # Unfrozen tail, positions relative to its start.
        self._text = ""
        self._pending = b""  # trailing bytes that are not yet valid UTF-8
        self._tokens: list[Lexeme] = []
        self._starts: list[int] = []
        self._stacks: list[tuple] = []  # LALR stack after each successfully parsed lexeme
        self._accepts: list[frozenset] = []
        self._open: dict[int, dict] = {}  # lexeme start -> terminals still alive from there
        self._lex_incomplete = False
        self._tail_map: dict = {}
        self._resume_pos = 0
        self._failed_token: Lexeme | None = None
        self.result = None
        self.current_stack = start
        self.remainder_fsm_states: list = []
        self._update(b"", relex=True)

    # ---- public -----------------------------------------------------------------------
    def feed(self, data: bytes):
        """Append ``data`` (a token's bytes); returns the new :class:`ParseResult`.

        Raises :class:`NonViableText` when a lexeme that can no longer change fails to parse.
        """
        return self._update(data, relex=False)

    def would_accept(self, data: bytes) -> bool:
        """Whether feeding ``data`` leaves a valid prefix (on a throwaway fork)."""
        other = self.fork()
        try:
            other.feed(data)
        except NonViableText:
            return False
        return other.is_valid_prefix()

    def fork(self) -> "FrontierParser":
        other = object.__new__(FrontierParser)
        other.__dict__.update(self.__dict__)
        for name in ("_tokens", "_starts", "_stacks", "_accepts", "parsed_lexer_tokens"):
            setattr(other, name, list(getattr(self, name)))
        other._open = dict(self._open)
        other._tail_map = dict(self._tail_map)
        other.cur_ac_terminals = set(self.cur_ac_terminals)
        other.next_ac_terminals = set(self.next_ac_terminals)
        return other

    @property
    def pending_bytes(self) -> bytes:
        """Trailing bytes of an unfinished UTF-8 character."""
        return self._pending

    @property
    def state_stack(self) -> tuple:
        """SynCode's LALR state stack after the parsed lexemes (bottom first)."""
        return self._stacks[-1] if self._stacks else self._base_stack

    @property
    def accepts_end(self) -> bool:
        """Whether the output is a complete string: nothing pending and $END can come next."""
        r = self.result
        return (r.remainder_state != RemainderState.INCOMPLETE and not self._pending
                and "$END" in self.next_ac_terminals)

    def config_key(self) -> tuple:
        """Everything the next mask depends on: the frozen prefix's summary and the tail."""
        last = self._base_last
        return (self._base_stack, self._base_prev_accepts,
                None if last is None else (last.type, last.value), self._text, self._pending)

    def is_valid_prefix(self) -> bool:
        """SynCode's MaskStore.is_valid_prefix on the tracked remainder DFA states."""
        result = self.result
        if result.remainder_state == RemainderState.COMPLETE and not result.remainder:
            return True
        firsts = {seq[0] for seq in result.accept_sequences}
        return any(s.terminal in firsts for s in self.remainder_fsm_states)

    # ---- the step ---------------------------------------------------------------------
    def _update(self, data: bytes, relex: bool):
        tables = self.tables
        committed, self._pending = _split_utf8(self._pending + data)
        new_bytes = committed.encode("utf-8")
        self._text += committed

        # 1. A lexeme start whose DFAs were alive at the old end may lex differently now: the
        #    earliest such start is the frontier. Then advance the DFAs; close the dead ones.
        had_open = bool(self._open)
        frontier = min(self._open) if had_open else self._resume_pos
        tail_hit = False
        if new_bytes:
            for start in list(self._open):
                live, _ = tables.advance_map(self._open[start], new_bytes)
                if live:
                    self._open[start] = live
                else:
                    del self._open[start]
            if self._lex_incomplete:
                self._tail_map, tail_hit = tables.advance_map(self._tail_map, new_bytes)

        # 2. Re-lex from the frontier unless nothing there can have changed (a long unfinished
        #    lexeme, e.g. a JSON string, where no terminal reached a final state).
        tail_unchanged = (not had_open and self._lex_incomplete and bool(self._tail_map)
                          and not tail_hit and self.lexer_pos == self._resume_pos)
        if relex or (new_bytes and not tail_unchanged):
            self._relex(frontier)

        # 3. Parse the lexemes not parsed yet.
        parse_incomplete = self._parse()

        # 4. SynCode's remainder rules and ParseResult.
        n = len(self._stacks)
        self.next_ac_terminals = set(self._acc(-1) if n else self._base_accepts)
        self.cur_ac_terminals = set(self._acc(-2) if n >= 2 else
                                    self._base_accepts if n == 1 else self._base_prev_accepts)
        last = self._failed_token if parse_incomplete else (
            self._tokens[n - 1] if n else self._base_last)
        self.parsed_lexer_tokens = [last] if last is not None else []
        if parse_incomplete:
            self.cur_ac_terminals, self.next_ac_terminals = self.next_ac_terminals, set()
        remainder_state, remainder, final_terminal = self._get_remainder(
            self._text, lexing_incomplete=self._lex_incomplete, parse_incomplete=parse_incomplete)
        if (remainder_state == RemainderState.MAYBE_COMPLETE and not n
                and self._base_last is not None):
            remainder = self._base_last.value  # the last lexeme is frozen: its text was dropped
        result = ParseResult.from_accept_terminals(
            self.cur_ac_terminals, self.next_ac_terminals, remainder, remainder_state,
            final_terminal=final_terminal, ignore_terminals=tables.ignore_terminals)
        # As SynCode's GrammarConstrainer: undecodable trailing bytes make the lexeme incomplete.
        result.remainder = remainder.encode("utf-8") + self._pending
        if self._pending:
            result.remainder_state = RemainderState.INCOMPLETE
        self.result = result
        self.current_stack = self.state_stack
        self.remainder_fsm_states = self._remainder_states(result, remainder)
        if not self.is_valid_prefix():
            self._lexeme_from_open_start()
        self._freeze()
        return result

    def _relex(self, frontier: int) -> None:
        tables = self.tables
        k = bisect.bisect_left(self._starts, frontier)
        del self._tokens[k:], self._starts[k:]
        del self._stacks[k:], self._accepts[k:]
        for start in [s for s in self._open if s >= frontier]:
            del self._open[start]
        text = self._text
        lex_state = LexerState(text)
        lex_state.line_ctr.char_pos = frontier
        self._lex_incomplete = False
        try:
            while lex_state.line_ctr.char_pos < len(text):
                token = tables.lexer.next_token(lex_state)
                lexeme = Lexeme(token.type, str(token.value), token.start_pos, token.end_pos)
                self._tokens.append(lexeme)
                self._starts.append(lexeme.start_pos)
                live, _ = tables.advance_map(tables.initial_map(),
                                             text[lexeme.start_pos:].encode("utf-8"))
                if live:
                    self._open[lexeme.start_pos] = live
        except UnexpectedCharacters:
            self._lex_incomplete = True
        except EOFError:
            pass
        self._resume_pos = self._tokens[-1].end_pos if self._tokens else frontier
        if self._lex_incomplete:
            self.lexer_pos = lex_state.line_ctr.char_pos
            self._tail_map, _ = tables.advance_map(tables.initial_map(),
                                                   text[self.lexer_pos:].encode("utf-8"))
        else:
            self.lexer_pos = self._resume_pos
            self._tail_map = {}

    def _parse(self) -> bool:
        """Feed unparsed lexemes; True if the last one was rejected (SynCode tolerates that)."""
        tables = self.tables
        stack = list(self.state_stack)
        self._failed_token = None
        for i in range(len(self._stacks), len(self._tokens)):
            token = self._tokens[i]
            try:
                tables.feed(stack, token.type)
            except KeyError:
                if i == len(self._tokens) - 1:
                    self._failed_token = token
                    return True
                raise NonViableText(
                    f"lexeme {token.type} {token.value!r} cannot follow LALR state "
                    f"{tables.state_names[stack[-1]]}") from None
            self._stacks.append(tuple(stack))
            self._accepts.append(None)  # computed on demand: most are never read
        return False

    def _acc(self, i: int) -> frozenset:
        """Terminals acceptable after tail lexeme ``i`` (lazily computed, then kept)."""
        if i < 0:
            i += len(self._accepts)
        found = self._accepts[i]
        if found is None:
            found = self._accepts[i] = frozenset(self.tables.accepts(list(self._stacks[i])))
        return found

    def _freeze(self) -> None:
        """Drop lexemes no future text can change (closed and parsed), keeping their stack."""
        boundary = min(self._open) if self._open else self._resume_pos
        if self._lex_incomplete:
            boundary = min(boundary, self.lexer_pos)
        k = min(bisect.bisect_left(self._starts, boundary), len(self._stacks))
        if k == 0:
            return
        cut = self._tokens[k - 1].end_pos
        if k >= 2:
            self._base_prev_accepts = self._acc(k - 2)
        else:
            self._base_prev_accepts = self._base_accepts
        self._base_stack, self._base_accepts = self._stacks[k - 1], self._acc(k - 1)
        last = self._tokens[k - 1]
        self._base_last = Lexeme(last.type, last.value, last.start_pos - cut, 0)
        self._text = self._text[cut:]
        self._tokens = [Lexeme(t.type, t.value, t.start_pos - cut, t.end_pos - cut)
                        for t in self._tokens[k:]]
        self._starts = [t.start_pos for t in self._tokens]
        del self._stacks[:k], self._accepts[:k]
        self._open = {start - cut: live for start, live in self._open.items()}
        self._resume_pos -= cut
        self.lexer_pos -= cut
        if self._failed_token is not None:
            f = self._failed_token
            self._failed_token = Lexeme(f.type, f.value, f.start_pos - cut, f.end_pos - cut)

    def _lexeme_from_open_start(self) -> None:
        """Where SynCode's remainder rule gives up, take the remainder from an open lexeme start.

        SynCode takes the remainder to be the last lexeme (or the unlexable tail). With a basic
        lexer that is wrong when a longer terminal is still being written: bv4's
        ``(define-fun ...`` lexes as ``(`` + unlexable ``d`` after two characters, and SQL's
        `` FROM `` lexes as a lone space + ``F``; SynCode then rejects the text (or finds no
        acceptable terminal) although the mask allowed it. The remainder then starts at the
        latest still-open lexeme start whose live terminals the parser accepts there.
        """
        tables = self.tables
        candidates = set(self._open)
        if self._lex_incomplete:
            candidates.add(self.lexer_pos)
        for start in sorted(candidates, reverse=True):
            before = bisect.bisect_left(self._starts, start)
            if before > len(self._stacks):
                continue  # a lexeme before this start failed to parse
            live = self._open.get(start) if start in self._open else self._tail_map
            if self._pending:
                live, _ = tables.advance_map(live, self._pending)
            acc = set(self._acc(before - 1)) if before else set(self._base_accepts)
            if not acc & set(live):
                continue
            self.cur_ac_terminals, self.next_ac_terminals = acc, set()
            text = self._text[start:]
            result = ParseResult.from_accept_terminals(
                acc, set(), text, RemainderState.INCOMPLETE,
                ignore_terminals=tables.ignore_terminals)
            result.remainder = text.encode("utf-8") + self._pending
            self.result = result
            self.current_stack = self._stacks[before - 1] if before else self._base_stack
            self.remainder_fsm_states = [JointFSMState(n, st) for n, st in live.items()]
            return

    def _remainder_states(self, result, remainder: str) -> list:
        """(terminal, DFA state) pairs for the remainder, as MaskStore.get_fsm_states gives them
        (restricted to live states).

        The unfinished tail is tracked incrementally, so a long open lexeme (a JSON string)
        costs nothing per step; a finished lexeme is short and recomputed.
        """
        tables = self.tables
        if (self._lex_incomplete and not self._ignore_whitespace
                and remainder == self._text[self.lexer_pos:]):
            live = self._tail_map
            if self._pending:
                live, _ = tables.advance_map(live, self._pending)
            if remainder or self._pending:
                return [JointFSMState(name, state) for name, state in live.items()]
        live, _ = tables.advance_map(tables.initial_map(), result.remainder)
        return [JointFSMState(name, state) for name, state in live.items()]


def canonical_state_numbers(states: Mapping, start) -> dict[object, int]:
    """Number LALR states by breadth-first search from the start state over sorted symbols.

    Lark enumerates LALR states from hash-ordered sets, so the same grammar gets different
    state numbers in two builds (or processes); SHIM features must be the same at training
    and inference. The parse table's graph is the same, so this numbering is too.
    """
    names = {start: 0}
    queue = [start]
    for state in queue:
        for symbol in sorted(states[state]):
            action, target = states[state][symbol]
            if action is Shift and target not in names:
                names[target] = len(names)
                queue.append(target)
    for state in states:  # unreachable states (none in a proper table) keep a stable order
        names.setdefault(state, len(names))
    return names


def _split_utf8(data: bytes) -> tuple[str, bytes]:
    """The longest valid UTF-8 prefix as text, and the bytes after it."""
    try:
        return data.decode("utf-8"), b""
    except UnicodeDecodeError as exc:
        return data[:exc.start].decode("utf-8"), data[exc.start:]
