"""Reading XGrammar's parser state from ``GrammarMatcher._debug_print_internal_state()``.

XGrammar 0.2.9 exposes its Earley items only through this debug dump: the items of the last
step that can consume the next byte, as ``ParserState(rule_id=.., sequence_id=.., element_id=..,
rule_start_pos=.., sub_element_id=..)`` lines under a ``There are N steps in history`` header
(N - 1 bytes consumed). The format is private and may change, so the parser is strict: any line
it does not recognise makes it return ``None`` and callers fall back to a derived readout
instead of guessing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_HEADER = re.compile(r"There are (\d+) steps in history\. Last step: \[\n?(.*)\]\s*\Z", re.S)
_ITEM = re.compile(r"ParserState\(rule_id=(-?\d+), sequence_id=(-?\d+), element_id=(-?\d+), "
                   r"rule_start_pos=(-?\d+), sub_element_id=(-?\d+)\),?")

#: How an item's start position is rendered: as XGrammar stores it (absolute byte offset,
#: -1 for the root), relative to the current position (bytes inside the rule), or not at all
#: (XGrammar's own mask-cache key; loses nesting depth).
START_POSITION_MODES = ("absolute", "relative", "none")


@dataclass(frozen=True, order=True)
class EarleyItem:
    """One Earley item that can consume the next byte."""

    rule_id: int
    sequence_id: int
    element_id: int  # an FSM node: already encodes progress inside a literal
    rule_start_pos: int  # byte offset where the rule started; -1 for the root rule
    sub_element_id: int  # progress inside the element (e.g. bytes of a UTF-8 character)

    def render(self, position: int, start_positions: str = "absolute") -> str:
        """``r3.s1.e2@5/0``: rule, sequence, element, start position, sub-element."""
        base = f"r{self.rule_id}.s{self.sequence_id}.e{self.element_id}"
        if start_positions == "absolute":
            return f"{base}@{self.rule_start_pos}/{self.sub_element_id}"
        if start_positions == "relative":
            return f"{base}@-{position - self.rule_start_pos}/{self.sub_element_id}"
        return f"{base}/{self.sub_element_id}"


@dataclass(frozen=True)
class InternalState:
    position: int  #: bytes consumed so far
    items: tuple[EarleyItem, ...]  #: innermost (latest start) first, deterministic order


def parse_internal_state(dump: str) -> InternalState | None:
    """Parse a 0.2.x debug dump; ``None`` if anything in it is not in the known format."""
    match = _HEADER.match(dump.strip())
    if match is None:
        return None
    items = []
    for line in match.group(2).splitlines():
        line = line.strip()
        if not line:
            continue
        item = _ITEM.fullmatch(line)
        if item is None:
            return None
        items.append(EarleyItem(*(int(g) for g in item.groups())))
    unique = sorted(set(items), key=lambda i: (-i.rule_start_pos, i))
    return InternalState(position=int(match.group(1)) - 1, items=tuple(unique))
