"""Earley-style ("dynamic") lexing over SynCode's LALR tables and terminal DFAs, byte by byte.

SynCode lexes with Lark's basic lexer: one tokenisation, decided by terminal priority and
pattern width, never by the parser. The reference language (Lark Earley, ``lexer='dynamic'``)
is different: at each position it tries every terminal the parser expects (plus the %ignore
ones), each taking its own longest match there. With overlapping terminals the two disagree:
Spider's ``AGGREGATION: "COUNT("i`` loses to ``CNAME`` in the basic lexer (so
``SELECT COUNT(x) FROM t`` is refused), while Earley also reads ``SELECTION`` as ``SELECT`` +
``ION`` and ``FROMt`` as ``FROM`` + ``t``.

This module follows the Earley semantics exactly, as a set of *items* per byte position:
``(LALR stack, terminal, DFA state, guards)``, one per way of reading the text so far. A
terminal may close wherever its DFA is final, but only at its longest match: closing leaves a
*guard* (the terminal's DFA, continued over the following bytes) that kills the item if it
ever reaches a final state again. The grammar's LALR table decides which terminals may start.
Masks come from per-(terminal, DFA state) token tables plus, for tokens that cross a lexeme
boundary, a parser-independent "signature" of how the rest of the token lexes, checked
against the LALR stack once per (stack, signature).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Iterable

import numpy as np

from .frontier_parser import GrammarTables

Guards = tuple  # ((terminal, dfa_state), ...): closed terminals that must not match longer
Item = tuple  # (stack, terminal, dfa_state, guards)
Boundary = tuple  # (stack, guards): a lexeme boundary with nothing open yet


def basic_lexer_is_exact(tables: GrammarTables) -> bool:
    """Whether no terminal's match can be a prefix of (or equal to) another terminal's text.

    Then every position has at most one terminal that can match there and be continued, and
    the basic lexer's single tokenisation is the Earley one. Otherwise the grammar needs
    dynamic lexing (keywords beside identifiers, ``COUNT(`` beside ``CNAME``, ...).
    """
    names = list(tables.fsms)
    for a in names:
        for b in names:
            if a != b and _overlap(tables, a, b):
                return False
    return True


def _overlap(tables: GrammarTables, a: str, b: str) -> bool:
    """Some non-empty string in L(a) that ``b``'s DFA can read and stay live on."""
    fa, fb = tables.fsms[a], tables.fsms[b]
    live_b = tables.live_states[b]
    start = (fa.initial, fb.initial)
    seen = {start}
    queue = [start]
    while queue:
        sa, sb = queue.pop()
        for byte in range(256):
            na, nb = fa.get_next_state(sa, byte), fb.get_next_state(sb, byte)
            if na is None or nb is None or nb not in live_b:
                continue
            if na in fa.finals:
                return True
            if (na, nb) not in seen and na in tables.live_states[a]:
                seen.add((na, nb))
                queue.append((na, nb))
    return False


class DynamicTables:
    """Per grammar and tokenizer, read-only once built (lazy tables are filled under the GIL
    with idempotent writes, so sharing across states and threads is safe)."""

    def __init__(self, tables: GrammarTables, token_bytes: list[bytes], skip: frozenset[int]):
        self.tables = tables
        self.fsms = tables.fsms
        self.live = tables.live_states
        self.finals = {n: frozenset(f.finals) for n, f in self.fsms.items()}
        self.ignore = frozenset(tables.ignore_terminals)
        self.token_bytes = token_bytes
        self.n_tokens = len(token_bytes)
        self._ids = [i for i, b in enumerate(token_bytes) if b and i not in skip]
        # DFA state from which a final is reachable in >= 1 byte: only there can a guard fire
        self.extendable = {
            n: frozenset(s for s in f.transitions
                         if any(f.get_next_state(s, c) in self.live[n] for c in range(256)))
            for n, f in self.fsms.items()}
        starters: dict[int, list] = defaultdict(list)
        for name, fsm in self.fsms.items():
            for c in range(256):
                q = fsm.get_next_state(fsm.initial, c)
                if q is not None and q in self.live[name]:
                    starters[c].append((name, q))
        self.starters = {c: tuple(v) for c, v in starters.items()}
        self._feed: dict = {}
        self._accepts: dict = {}
        self._inside: dict = {}
        self._crossing: dict = {}
        self._sig_of: dict[bytes, int] = {}
        self._sigs: list[frozenset] = []
        self._sig_ok: dict = {}
        self._guard_effects: dict = {}
        self._viable: dict = {}
        self._trie = _Trie(token_bytes, self._ids)

    # ---- LALR ----------------------------------------------------------------------------
    def feed(self, stack: tuple, terminal: str) -> tuple | None:
        key = (stack, terminal)
        found = self._feed.get(key, False)
        if found is False:
            work = list(stack)
            try:
                self.tables.feed(work, terminal)
                found = tuple(work)
            except KeyError:
                found = None
            self._feed[key] = found
        return found

    def accepts(self, stack: tuple) -> frozenset:
        found = self._accepts.get(stack)
        if found is None:
            found = self._accepts[stack] = frozenset(self.tables.accepts(list(stack)))
        return found

    def can_start(self, stack: tuple, terminal: str) -> bool:
        return terminal in self.ignore or terminal in self.accepts(stack)

    def after_close(self, stack: tuple, terminal: str) -> tuple | None:
        return stack if terminal in self.ignore else self.feed(stack, terminal)

    # ---- one byte ------------------------------------------------------------------------
    def advance_guards(self, guards: Guards, byte: int) -> Guards | None:
        """Guards after ``byte``; None if one fired (a closed terminal would match longer)."""
        out = []
        for name, state in guards:
            nxt = self.fsms[name].get_next_state(state, byte)
            if nxt is None or nxt not in self.live[name]:
                continue
            if nxt in self.finals[name]:
                return None
            out.append((name, nxt))
        return tuple(out)

    def close_guards(self, guards: Guards, terminal: str, state) -> Guards:
        """Guards after closing ``terminal`` at DFA ``state`` (its longest match must hold)."""
        if state in self.extendable[terminal]:
            return guards + ((terminal, state),)
        return guards

    def step(self, items: dict[Item, int], boundaries: Iterable[Boundary], byte: int,
             pos: int = 0) -> dict[Item, int]:
        """Items after one more byte at offset ``pos``, each with its lexeme's start offset."""
        out: dict[Item, int] = {}
        bounds = set(boundaries)
        for (stack, name, state, guards), start in items.items():
            if state in self.finals[name]:
                after = self.after_close(stack, name)
                if after is not None:
                    bounds.add((after, self.close_guards(guards, name, state)))
            guards_next = self.advance_guards(guards, byte)
            if guards_next is None:
                continue
            nxt = self.fsms[name].get_next_state(state, byte)
            if nxt is not None and nxt in self.live[name]:
                if not guards_next or self.viable(name, nxt, guards_next):
                    item = (stack, name, nxt, guards_next)
                    out[item] = min(start, out.get(item, start))
        starters = self.starters.get(byte, ())
        for stack, guards in bounds:
            guards_next = self.advance_guards(guards, byte)
            if guards_next is None:
                continue
            for name, state in starters:
                if self.can_start(stack, name) and (
                        not guards_next or self.viable(name, state, guards_next)):
                    out.setdefault((stack, name, state, guards_next), pos)
        return out

    def viable(self, name: str, state, guards: Guards) -> bool:
        """Whether ``name`` can still reach a final state without any guard firing."""
        key = (name, state, guards)
        found = self._viable.get(key)
        if found is None:
            found = False
            seen = {(state, guards)}
            queue = [(state, guards)]
            fsm = self.fsms[name]
            while queue and not found:
                q, g = queue.pop()
                if q in self.finals[name]:
                    found = True
                    break
                for c in range(256):
                    nq = fsm.get_next_state(q, c)
                    if nq is None or nq not in self.live[name]:
                        continue
                    ng = self.advance_guards(g, c)
                    if ng is not None and (nq, ng) not in seen:
                        seen.add((nq, ng))
                        queue.append((nq, ng))
            self._viable[key] = found
        return found

    def run(self, items: Iterable[Item], boundaries: Iterable[Boundary], data: bytes
            ) -> dict[Item, int]:
        state = {item: 0 for item in items}
        bounds = set(boundaries)
        for byte in data:
            state = self.step(state, bounds, byte)
            bounds = set()
            if not state:
                break
        return state

    def accepts_end(self, items: Iterable[Item], boundaries: Iterable[Boundary]) -> bool:
        for stack, _ in boundaries:
            if "$END" in self.accepts(stack):
                return True
        for stack, name, state, _ in items:
            if state in self.finals[name]:
                after = self.after_close(stack, name)
                if after is not None and "$END" in self.accepts(after):
                    return True
        return False

    # ---- masks ---------------------------------------------------------------------------
    def mask(self, items: Iterable[Item], boundaries: Iterable[Boundary]) -> np.ndarray:
        """Tokens after which some item survives (before UTF-8 and special-token rules)."""
        out = np.zeros(self.n_tokens, dtype=np.bool_)
        for stack, guards in boundaries:
            ok = np.zeros(self.n_tokens, dtype=np.bool_)
            for sig, ids in self._whole_token_groups():
                if self._signature_ok(stack, sig):
                    ok[ids] = True
            out |= self._apply_guards(ok, guards, stack, None)
        for stack, name, state, guards in items:
            ok = np.zeros(self.n_tokens, dtype=np.bool_)
            ok[self._inside_ids(name, state)] = True
            after = self.after_close(stack, name)
            if after is not None:
                for sig, ids in self._crossing_groups(name, state):
                    if self._signature_ok(after, sig):
                        ok[ids] = True
            out |= self._apply_guards(ok, guards, stack, (stack, name, state, guards))
        return out

    def _apply_guards(self, ok: np.ndarray, guards: Guards, stack: tuple, item) -> np.ndarray:
        """Drop tokens on which a guard fires; re-run the few it survives exactly."""
        if not guards:
            return ok
        ok &= ~self._fires(guards)
        for i in np.flatnonzero(ok & self._survives(guards)):
            items = {item} if item is not None else set()
            bounds = set() if item is not None else {(stack, guards)}
            ok[i] = bool(self.run(items, bounds, self.token_bytes[i]))
        return ok

    def _fires(self, guards: Guards) -> np.ndarray:
        self._guard_tables(guards)
        return self._guard_effects[guards][0]

    def _survives(self, guards: Guards) -> np.ndarray:
        self._guard_tables(guards)
        return self._guard_effects[guards][1]

    def _guard_tables(self, guards: Guards) -> None:
        if guards in self._guard_effects:
            return
        fires = np.zeros(self.n_tokens, dtype=np.bool_)
        survives = np.zeros(self.n_tokens, dtype=np.bool_)
        for i in self._ids:
            g = guards
            for byte in self.token_bytes[i]:
                g = self.advance_guards(g, byte)
                if not g:
                    break
            if g is None:
                fires[i] = True
            elif g:
                survives[i] = True
        self._guard_effects[guards] = (fires, survives)

    def _inside_ids(self, name: str, state) -> np.ndarray:
        """Tokens that leave ``name``'s DFA live from ``state`` (the lexeme stays open)."""
        key = (name, state)
        found = self._inside.get(key)
        if found is None:
            fsm, live = self.fsms[name], self.live[name]
            ids: list[int] = []

            def walk(node, q):
                for byte, child in node.children.items():
                    nq = fsm.get_next_state(q, byte)
                    if nq is None or nq not in live:
                        continue
                    ids.extend(child.ids)
                    walk(child, nq)

            walk(self._trie.root, state)
            found = self._inside[key] = np.array(ids, dtype=np.int64)
        return found

    def _crossing_groups(self, name: str, state) -> list[tuple[int, np.ndarray]]:
        """Tokens that close ``name`` inside them, at its last final point before their end,
        grouped by the signature of the rest of the token."""
        key = (name, state)
        found = self._crossing.get(key)
        if found is None:
            fsm, finals, live = self.fsms[name], self.finals[name], self.live[name]
            groups: dict[int, list[int]] = defaultdict(list)
            for i in self._ids:
                data = self.token_bytes[i]
                q = state
                last = 0 if q in finals else -1
                end_final = False
                for k, byte in enumerate(data):
                    q = fsm.get_next_state(q, byte)
                    if q is None or q not in live:
                        break
                    if q in finals:
                        if k + 1 == len(data):
                            end_final = True
                        else:
                            last = k + 1
                if last < 0 or end_final:
                    continue
                groups[self._signature(data[last:])].append(i)
            found = self._crossing[key] = [(s, np.array(v, dtype=np.int64))
                                           for s, v in groups.items()]
        return found

    def _whole_token_groups(self) -> list[tuple[int, np.ndarray]]:
        key = ("<boundary>", None)
        found = self._crossing.get(key)
        if found is None:
            groups: dict[int, list[int]] = defaultdict(list)
            for i in self._ids:
                groups[self._signature(self.token_bytes[i])].append(i)
            found = self._crossing[key] = [(s, np.array(v, dtype=np.int64))
                                           for s, v in groups.items()]
        return found

    def _signature(self, data: bytes) -> int:
        """Id of the set of ways ``data`` lexes from a boundary, parser aside: each a tuple of
        closed non-ignored terminals and the terminal left open at the end."""
        found = self._sig_of.get(data)
        if found is None:
            # path item: (closed terminals, open terminal, dfa state, guards)
            paths: set = set()
            bounds = {((), ())}
            for byte in data:
                nxt: set = set()
                for closed, name, state, guards in paths:
                    if state in self.finals[name]:
                        seq = closed if name in self.ignore else closed + (name,)
                        bounds.add((seq, self.close_guards(guards, name, state)))
                    g = self.advance_guards(guards, byte)
                    if g is None:
                        continue
                    q = self.fsms[name].get_next_state(state, byte)
                    if q is not None and q in self.live[name]:
                        nxt.add((closed, name, q, g))
                for closed, guards in bounds:
                    g = self.advance_guards(guards, byte)
                    if g is None:
                        continue
                    for name, q in self.starters.get(byte, ()):
                        nxt.add((closed, name, q, g))
                paths, bounds = nxt, set()
                if not paths:
                    break
            sig = frozenset((closed, name) for closed, name, state, guards in paths
                            if not guards or self.viable(name, state, guards))
            found = self._sig_of[data] = self._sig_index(sig)
        return found

    def _sig_index(self, sig: frozenset) -> int:
        try:
            return self._sig_lookup[sig]
        except AttributeError:
            self._sig_lookup: dict = {}
        except KeyError:
            pass
        self._sig_lookup[sig] = len(self._sigs)
        self._sigs.append(sig)
        return self._sig_lookup[sig]

    def _signature_ok(self, stack: tuple, sig: int) -> bool:
        key = (stack, sig)
        found = self._sig_ok.get(key)
        if found is None:
            found = False
            for closed, name in self._sigs[sig]:
                s = stack
                for terminal in closed:
                    s = self.feed(s, terminal)
                    if s is None:
                        break
                if s is not None and self.can_start(s, name):
                    found = True
                    break
            self._sig_ok[key] = found
        return found


class _Node:
    __slots__ = ("children", "ids")

    def __init__(self):
        self.children: dict[int, _Node] = {}
        self.ids: list[int] = []


class _Trie:
    """Token bytes as a trie, so a DFA walk visits each shared prefix once."""

    def __init__(self, token_bytes: list[bytes], ids: list[int]):
        self.root = _Node()
        for i in ids:
            node = self.root
            for byte in token_bytes[i]:
                child = node.children.get(byte)
                if child is None:
                    child = node.children[byte] = _Node()
                node = child
            node.ids.append(i)


class DynamicLexParser:
    """One sequence's readings (items) under dynamic lexing; :meth:`feed` appends bytes.

    Not thread-safe; :meth:`fork` gives an independent copy (items are immutable tuples).
    """

    def __init__(self, dyn: DynamicTables):
        self.dyn = dyn
        self.items: dict[Item, int] = {}
        self.boundaries: frozenset = frozenset({((dyn.tables.start_state,), ())})
        self.data = b""
        self.pending_bytes = b""

    def feed(self, data: bytes) -> None:
        """Append ``data``; raises NonViableText (state unchanged) if no reading survives."""
        from .frontier_parser import NonViableText

        items, bounds, pos = self.items, self.boundaries, len(self.data)
        for k, byte in enumerate(data):
            items = self.dyn.step(items, bounds, byte, pos + k)
            bounds = frozenset()
            if not items:
                raise NonViableText(
                    f"no reading of the text survives byte {k} ({bytes([byte])!r}) of "
                    f"{data!r}: no terminal the parser accepts can take it")
        self.items, self.boundaries = items, bounds
        self.data += data
        self.pending_bytes = _unfinished_char(self.data)

    def would_accept(self, data: bytes) -> bool:
        return bool(self.dyn.run(self.items, self.boundaries, data))

    def fork(self) -> "DynamicLexParser":
        other = object.__new__(DynamicLexParser)
        other.__dict__.update(self.__dict__)
        other.items = dict(self.items)
        return other

    @property
    def accepts_end(self) -> bool:
        return not self.pending_bytes and self.dyn.accepts_end(self.items, self.boundaries)

    def config_key(self) -> tuple:
        """Everything the next mask depends on (not the text: names share DFA states)."""
        return (frozenset(self.items), self.boundaries, self.pending_bytes)

    def mask(self) -> np.ndarray:
        return self.dyn.mask(self.items, self.boundaries)

    def main_stack(self) -> tuple:
        """A deterministic representative LALR stack among the readings."""
        names = self.dyn.tables.state_names
        stacks = {item[0] for item in self.items} | {b[0] for b in self.boundaries}
        return min(stacks, key=lambda s: (len(s), tuple(names[x] for x in s)))

    def partial_lexeme(self) -> bytes:
        if not self.items:
            return b""
        return self.data[min(self.items.values()):]


def _unfinished_char(data: bytes) -> bytes:
    """The trailing bytes of a UTF-8 character that is not complete yet (else b"")."""
    for k in range(1, min(4, len(data)) + 1):
        byte = data[-k]
        if byte < 0x80:
            return b""
        if byte >= 0xC0:
            need = 2 if byte < 0xE0 else 3 if byte < 0xF0 else 4
            return data[-k:] if k < need else b""
    return b""
