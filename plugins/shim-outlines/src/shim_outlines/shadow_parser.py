"""A shadow LALR parser that recovers parser/lexer state for a backend that exposes none.

llguidance computes masks from its own Earley parser but offers no state readout, so SHIM's
features are *derived*: the text the masker accepted is fed, character by character, to a
Lark LALR parser (its interactive parser: the state stack is the parser state) behind a
maximal-munch lexer built from one FSM per terminal (interegular, the FSM library Lark itself
uses). The lexer keeps every terminal still consistent with the unfinished lexeme and its FSM
state, which is exactly the lexer-state feature; the unfinished text is the partial lexeme.

Lark numbers LALR states in an order that depends on Python's string hashing (it changes with
``PYTHONHASHSEED``), and features must be stable across processes (a controller is fitted in
one process and used in another). States are therefore renumbered canonically: breadth-first
from the start state over the parse table, symbols in sorted order. FSM states likewise, in
breadth-first order over transitions sorted by their smallest character.
"""

from __future__ import annotations

import codecs
from collections import deque
from dataclasses import dataclass
from shim_adapters.errors import GrammarError, ShimError

#: Stack entries reported as the parser-state feature (top first).
DEFAULT_STACK_TOP_K = 8


class ShadowParserError(ShimError):
    """The shadow parser cannot follow text the masker accepted (its features would be wrong)."""


@dataclass(frozen=True)
class TerminalFSM:
    """One terminal's character FSM, with what the lexer asks of each state precomputed."""

    name: str
    #: Stable display name: the named terminal, or the literal/regex of an anonymous one.
    display: str
    priority: int
    is_literal: bool
    initial: object
    transitions: dict
    alphabet: object
    finals: frozenset
    #: States from which a final state is reachable (others are dead).
    live: frozenset
    #: States with a transition into a live state (the lexeme may still grow).
    extendable: frozenset
    #: Raw interegular state -> canonical breadth-first index.
    canonical: dict

    def step(self, state, char: str):
        try:
            symbol = self.alphabet[char]
        except KeyError:
            return None
        nxt = self.transitions.get(state, {}).get(symbol)
        return nxt if nxt in self.live else None


def _terminal_fsm(term) -> TerminalFSM:
    import interegular
    from lark.lexer import PatternStr

    regexp = term.pattern.to_regexp()
    fsm = interegular.parse_pattern(regexp).to_fsm()
    transitions = {s: dict(row) for s, row in fsm.map.items()}
    # live = states that can reach a final state (reverse reachability)
    reverse: dict = {}
    for s, row in transitions.items():
        for t in row.values():
            reverse.setdefault(t, set()).add(s)
    live = set(fsm.finals)
    todo = deque(live)
    while todo:
        for prev in reverse.get(todo.popleft(), ()):
            if prev not in live:
                live.add(prev)
                todo.append(prev)
    extendable = frozenset(s for s, row in transitions.items()
                           if any(t in live for t in row.values()))
    # canonical numbering: BFS, symbols ordered by their smallest character
    by_symbol: dict = {}
    for char, symbol in fsm.alphabet.items():
        key = (1, "") if not isinstance(char, str) else (0, char)  # anything_else last
        by_symbol[symbol] = min(by_symbol.get(symbol, key), key)
    canonical = {fsm.initial: 0}
    todo = deque([fsm.initial])
    while todo:
        s = todo.popleft()
        for symbol in sorted(transitions.get(s, {}), key=lambda x: by_symbol.get(x, (2, ""))):
            t = transitions[s][symbol]
            if t not in canonical:
                canonical[t] = len(canonical)
                todo.append(t)
    is_literal = isinstance(term.pattern, PatternStr)
    if term.name.startswith("__"):
        display = repr(term.pattern.value) if is_literal else f"/{term.pattern.value}/"
    else:
        display = term.name
    return TerminalFSM(term.name, display, term.priority, is_literal, fsm.initial, transitions,
                       fsm.alphabet, frozenset(fsm.finals), frozenset(live), extendable, canonical)


def _discard(children):
    return None


class ShadowGrammar:
    """A Lark grammar compiled once for shadow parsing: LALR tables + terminal FSMs.

    Raises :class:`GrammarError` when Lark cannot build an LALR(1) table (e.g. a conflict) or
    a terminal's regex is outside what interegular can turn into an FSM; the caller then
    declares the derived features missing instead of guessing.
    """

    def __init__(self, lark_text: str, grammar_name: str = "<grammar>",
                 stack_top_k: int = DEFAULT_STACK_TOP_K):
        import lark

        try:
            self.lark = lark.Lark(lark_text, parser="lalr", lexer="contextual")
        except lark.exceptions.GrammarError as exc:
            raise GrammarError(f"shadow LALR parser: {exc}", grammar_name=grammar_name) from exc
        except lark.exceptions.UnexpectedInput as exc:
            raise GrammarError(f"shadow LALR parser: {exc}", grammar_name=grammar_name,
                               line=getattr(exc, "line", None)) from exc
        self.name = grammar_name
        self.stack_top_k = stack_top_k
        lalr = self.lark.parser.parser.parser
        # Build no trees: only the state stack matters, and parser copies stay cheap.
        lalr.callbacks = {rule: _discard for rule in lalr.callbacks}
        table = lalr.parse_table
        self._table = table
        self.terminals: dict[str, TerminalFSM] = {}
        for term in self.lark.terminals:
            try:
                self.terminals[term.name] = _terminal_fsm(term)
            except Exception as exc:  # interegular: unsupported regex construct
                raise GrammarError(f"shadow lexer cannot build an FSM for terminal {term.name} "
                                   f"/{term.pattern.to_regexp()}/: {exc}",
                                   grammar_name=grammar_name) from exc
        self.ignore = frozenset(self.lark.ignore_tokens)
        self.canonical_state = self._canonical_states(table)
        order = lambda name: (-self.terminals[name].priority,  # noqa: E731
                              not self.terminals[name].is_literal, name)
        #: Raw LALR state -> terminals the lexer may produce there (contextual lexing).
        self.expected: dict[int, tuple[str, ...]] = {
            state: tuple(sorted((set(actions) & set(self.terminals)) | self.ignore, key=order))
            for state, actions in table.states.items()
        }

    @staticmethod
    def _canonical_states(table) -> dict[int, int]:
        from lark.parsers.lalr_analysis import Shift

        canonical: dict[int, int] = {}
        todo: deque = deque()
        for start in sorted(table.start_states):
            s = table.start_states[start]
            if s not in canonical:
                canonical[s] = len(canonical)
                todo.append(s)
        while todo:
            s = todo.popleft()
            for symbol in sorted(table.states[s]):
                action, arg = table.states[s][symbol]
                if action is Shift and arg not in canonical:
                    canonical[arg] = len(canonical)
                    todo.append(arg)
        for s in sorted(table.states):  # unreachable states (none in practice): after the rest
            canonical.setdefault(s, len(canonical))
        return canonical

    def new_parser(self) -> "ShadowParser":
        return ShadowParser(self, self.lark.parse_interactive(""))


class ShadowParser:
    """Incremental parse of the generated text: LALR stack + unfinished lexeme."""

    __slots__ = ("grammar", "_ip", "_decoder", "pending", "_alive", "_accept")

    def __init__(self, grammar: ShadowGrammar, interactive):
        self.grammar = grammar
        self._ip = interactive
        self._decoder = codecs.getincrementaldecoder("utf-8")()
        #: Text of the unfinished lexeme.
        self.pending = ""
        #: terminal name -> FSM state, for every terminal consistent with ``pending``.
        self._alive: dict[str, object] | None = None
        #: (length, terminal) of the longest complete lexeme at the start of ``pending``.
        self._accept: tuple[int, str] | None = None

    # ---- state readout ------------------------------------------------------------------
    @property
    def raw_stack(self) -> list[int]:
        return self._ip.parser_state.state_stack

    def parser_state(self) -> tuple[str, ...]:
        """Canonical LALR states, stack top first (at most ``stack_top_k``)."""
        canon = self.grammar.canonical_state
        stack = self.raw_stack
        k = self.grammar.stack_top_k
        return tuple(f"s{canon[s]}" for s in reversed(stack[-k:]))

    def lexer_state(self) -> frozenset[tuple[str, int]]:
        """(terminal, canonical FSM state) for each terminal consistent with the partial lexeme."""
        terms = self.grammar.terminals
        alive = self._current_alive()
        return frozenset((terms[name].display, terms[name].canonical[state])
                         for name, state in alive.items())

    @property
    def stack_depth(self) -> int:
        return len(self.raw_stack)

    # ---- feeding ------------------------------------------------------------------------
    def copy(self) -> "ShadowParser":
        other = ShadowParser.__new__(ShadowParser)
        other.grammar = self.grammar
        other._ip = self._ip.copy(deepcopy_values=False)
        other._decoder = codecs.getincrementaldecoder("utf-8")()
        other._decoder.setstate(self._decoder.getstate())
        other.pending = self.pending
        other._alive = None if self._alive is None else dict(self._alive)
        other._accept = self._accept
        return other

    def feed_bytes(self, data: bytes) -> None:
        """Feed a token's bytes (partial UTF-8 sequences wait for their continuation)."""
        text = self._decoder.decode(data)
        for char in text:
            self._feed_char(char)

    def feed_text(self, text: str) -> None:
        for char in text:
            self._feed_char(char)

    def finish(self) -> None:
        """End of output: close the last lexeme and check the parse completes."""
        import lark

        if self._decoder.getstate()[0]:
            raise self._error("output ends inside a UTF-8 sequence")
        if self.pending:
            if self._accept is None or self._accept[0] != len(self.pending):
                raise self._error(f"output ends inside the lexeme {self.pending!r}")
            self._commit(self._accept[1], self.pending)
        try:
            self._ip.feed_eof()
        except lark.exceptions.LarkError as exc:
            raise self._error(f"parse incomplete at end of output: {exc}") from None

    def _current_alive(self) -> dict[str, object]:
        if self._alive is None:
            terms = self.grammar.terminals
            self._alive = {name: terms[name].initial
                           for name in self.grammar.expected[self.raw_stack[-1]]}
        return self._alive

    def _feed_char(self, char: str) -> None:
        terms = self.grammar.terminals
        alive = self._current_alive()
        grown = {}
        for name, state in alive.items():
            nxt = terms[name].step(state, char)
            if nxt is not None:
                grown[name] = nxt
        if not grown:
            # ``char`` cannot extend the lexeme: close the longest complete one and re-lex.
            if self._accept is None:
                raise self._error(f"no terminal continues {self.pending!r} with {char!r}")
            length, name = self._accept
            rest = self.pending[length:] + char
            self._commit(name, self.pending[:length])
            for c in rest:
                self._feed_char(c)
            return
        self.pending += char
        self._alive = grown
        finals = [name for name, state in grown.items() if state in terms[name].finals]
        if finals:
            self._accept = (len(self.pending), finals[0])  # ``expected`` is in lexer priority
        if all(state not in terms[name].extendable for name, state in grown.items()):
            # Nothing can grow: the lexeme is complete now (keeps the partial lexeme empty
            # after e.g. ``bvand`` instead of waiting for the next character).
            self._commit(finals[0], self.pending)

    def _commit(self, name: str, text: str) -> None:
        import lark

        if name not in self.grammar.ignore:
            try:
                self._ip.feed_token(lark.Token(name, text))
            except lark.exceptions.LarkError as exc:
                raise self._error(f"parser rejects {name} {text!r}: {exc}") from None
        self.pending = ""
        self._alive = None
        self._accept = None

    def _error(self, what: str) -> ShadowParserError:
        return ShadowParserError(f"shadow parser for grammar {self.grammar.name!r} lost track: "
                                 f"{what}; LALR stack {self.parser_state()}")

