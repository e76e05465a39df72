"""The conformance checks for one masker (backend x tokenizer x grammar).

Every verdict comes from references that share no code with the masker: the reference
acceptor for finished strings, the prefix checkers of :mod:`.prefix` for unfinished ones, the
tokenizer definition for token bytes. Failures are minimised (fewest prefix tokens, shortest
valid string) before they are reported, with the grammar, prefix text, token id and text.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from shim_adapters.conformance.generate import valid_strings
from shim_adapters.conformance.grammar_analysis import grammar_diagnostics
from shim_adapters.conformance.known_bugs import Probe, known_bug, match_known_bug
from shim_adapters.conformance.prefix import (
    LarkPrefixChecker,
    PrefixUndecided,
    prefix_checker,
    refusal_checker,
)
from shim_adapters.conformance.profiles import Profile
from shim_adapters.conformance.reference_mask import (
    DEAD,
    SKIPPED,
    UNDECIDED,
    VIABLE,
    reference_verdicts,
)
from shim_adapters.conformance.report import CheckResult, Repro
from shim_adapters.conformance.tokenizations import (
    ForcedText,
    declared_tokenizations,
    excused_split,
)
from shim_adapters.errors import ForbiddenTokenError, ShimError, UnsupportedGrammarError
from shim_adapters.grammars.grammar import Grammar
from shim_adapters.grammars.reference import reference_acceptor
from shim_adapters.mask.protocol import Masker, MaskerState, Tokenizations
from shim_adapters.mask.vocab import Vocabulary, decode_prefix

_CLOSERS = frozenset(b")]};\"'")
_OPENERS = frozenset(b"([{")


@dataclass
class CellContext:
    """Everything the checks of one cell share."""

    masker: Masker
    grammar: Grammar
    vocab: Vocabulary
    tokenizer_name: str
    profile: Profile
    prefix: object | None
    rng: random.Random
    notes: list[str] = field(default_factory=list)
    #: The control-token check's result (set by run_cell_checks).
    control: CheckResult | None = None
    mask_calls: int = 0
    seconds_per_mask: float = 0.0
    #: Wall-clock safety net (``time.perf_counter()`` value): past it a check stops and is
    #: reported incomplete. The work each check does is fixed by the profile's counts.
    deadline: float = float("inf")

    def out_of_time(self) -> bool:
        return time.perf_counter() > self.deadline

    def __post_init__(self) -> None:
        self.reference = reference_acceptor(self.grammar)
        self.n_tokens = len(self.vocab.tokenizer)
        width = self.masker.vocab_size
        self.is_text = np.zeros(width, dtype=bool)
        self.is_text[self.vocab.text_ids[self.vocab.text_ids < width]] = True
        #: Added tokens not flagged special and not named by the grammar: control tokens,
        #: judged on their own (never allowed), never text.
        self.control_ids = np.array(sorted(i for i in self.vocab.control_ids_for(
            self.grammar.text) if i < width), dtype=np.int64)
        self.is_text[self.control_ids] = False
        self._syntactic = None
        self.eos_ids = sorted(i for i in self.masker.eos_token_ids if i < width)
        self.non_eos_special = np.array(sorted(self.vocab.special_ids
                                               - set(self.masker.eos_token_ids)), dtype=np.int64)
        self.non_eos_special = self.non_eos_special[self.non_eos_special < width]
        ids = np.arange(width, dtype=np.float64)
        self.rare_weight = ((ids + 1) / max(self.n_tokens, 1)) ** 4 + 1e-6
        # Steering towards an end: tokens that only close (rank 0), neither open nor close
        # (1), open (2); shorter first.
        self.finish_rank = np.full(width, 10**6, dtype=np.int64)
        for i in self.vocab.text_ids:
            i = int(i)
            if i >= width:
                continue
            b = self.vocab.token_bytes[i]
            if self.vocab.is_partial_utf8(i):
                self.rare_weight[i] *= 20
            chars = set(b)
            rank = 0 if (chars & _CLOSERS and not chars & _OPENERS) else \
                1 if not chars & _OPENERS else 2
            self.finish_rank[i] = rank * 1000 + min(len(b), 999)
        self.np_rng = np.random.default_rng(self.profile.seed)
        self.tokenizations = declared_tokenizations(self.masker)
        self.forced = ForcedText(self)

    def sample(self, ids: np.ndarray, k: int) -> list[int]:
        """Up to ``k`` distinct ids drawn from ``ids``."""
        if k <= 0 or not len(ids):
            return []
        if k >= len(ids):
            return [int(i) for i in ids]
        return [int(i) for i in self.np_rng.choice(ids, size=k, replace=False)]

    # ---- helpers ------------------------------------------------------------------------
    def data(self, ids: Sequence[int]) -> bytes:
        return self.vocab.to_bytes(ids) or b""

    def text(self, ids: Sequence[int]) -> str:
        return self.data(ids).decode(errors="replace")

    def replay(self, ids: Sequence[int]) -> MaskerState | None:
        state = self.masker.new_state()
        try:
            for t in ids:
                state.advance(int(t))
        except ShimError:
            return None
        return state

    def viable(self, data: bytes) -> bool | None:
        """Whether output bytes can still become a string of the grammar (None: undecided)."""
        try:
            text, tail = decode_prefix(data)
        except UnicodeDecodeError:
            return False
        if tail or self.prefix is None:
            return None
        try:
            return self.prefix.viable(text)
        except PrefixUndecided:
            return None

    @property
    def refusal_reference(self):
        """The reference that judges refused tokens: the prefix reference, or for a JSON
        schema its ordered reading (None, with ``refusal_note``, where it has none)."""
        if not hasattr(self, "_refusal"):
            self.refusal_note = None
            try:
                self._refusal = refusal_checker(self.grammar)
                if self._refusal is None:
                    self._refusal = self.prefix
            except UnsupportedGrammarError as exc:
                self._refusal, self.refusal_note = None, str(exc)
        return self._refusal

    def viable_for_refusal(self, data: bytes) -> bool | None:
        """Whether output bytes certainly start a valid string (None: undecided): refusing a
        token is wrong only where this is True."""
        ref = self.refusal_reference
        if ref is self.prefix:
            return self.viable(data)
        if ref is None or self.viable(data) is False:
            return None if ref is None else False
        try:
            text, tail = decode_prefix(data)
        except UnicodeDecodeError:
            return False
        if tail:
            return None
        try:
            return True if ref.viable(text) else None
        except PrefixUndecided:
            return None

    @property
    def has_unfinishable_rules(self) -> bool:
        analysis = getattr(self.prefix, "analysis", None)
        return bool(analysis is not None and analysis.dropped_rules)

    def syntactically_viable(self, data: bytes) -> bool:
        """Viable when rules that can never finish count too: an allowed token that is only
        this is a dead end (generation can go on but never end), not an unsound token."""
        if not self.has_unfinishable_rules:
            return False
        if self._syntactic is None:
            self._syntactic = prefix_checker(self.grammar, finite=False)
        try:
            text, tail = decode_prefix(data)
            return bool(self._syntactic.viable(text)) and not tail
        except (UnicodeDecodeError, PrefixUndecided):
            return False

    def accepts(self, ids: Sequence[int]) -> bool:
        try:
            text = self.data(ids).decode()
        except UnicodeDecodeError:
            return False
        return self.reference.accepts(text)

    def repro(self, check: str, kind: str, prefix_ids: Sequence[int], token_id: int | None,
              detail: str) -> Repro:
        added = None
        if token_id is not None:
            try:
                tail = decode_prefix(self.data(prefix_ids))[1]
                added = decode_prefix(tail + (self.vocab.token_bytes[int(token_id)] or b""))[0]
            except (UnicodeDecodeError, IndexError):
                added = None
        return Repro(check=check, kind=kind, backend=self.masker.backend_name,
                     tokenizer=self.tokenizer_name, grammar=self.grammar.name,
                     prefix_text=self.text(prefix_ids), prefix_token_ids=[int(i) for i in prefix_ids],
                     token_id=None if token_id is None else int(token_id),
                     token_text=None if token_id is None else self.vocab.text_of(int(token_id)),
                     detail=detail, added_text=added,
                     token_hex=None if token_id is None or int(token_id) >= len(
                         self.vocab.token_bytes) or self.vocab.token_bytes[int(token_id)] is None
                     else self.vocab.token_bytes[int(token_id)].hex())

    def fail(self, result: CheckResult, repro: Repro) -> None:
        result.add_failure(repro, match_known_bug(repro, self.masker.backend_version,
                                                       self.grammar),
                           keep=self.profile.keep_failures)


def minimise(items: list, still_fails: Callable[[list], bool], budget: int) -> list:
    """Delta debugging: a shorter list for which ``still_fails`` holds (within ``budget``)."""
    current = list(items)
    chunk = max(1, len(current) // 2)
    calls = 0
    while chunk >= 1 and current and calls < budget:
        i = 0
        removed = False
        while i < len(current) and calls < budget:
            candidate = current[:i] + current[i + chunk:]
            calls += 1
            if still_fails(candidate):
                current = candidate
                removed = True
            else:
                i += chunk
        if not removed:
            if chunk == 1:
                break
            chunk //= 2
    return current


# ---------------------------------------------------------------------------------------------
# Soundness + no dead ends: random walks over the masker's own allowed tokens
# ---------------------------------------------------------------------------------------------
def walks(ctx: CellContext, sound: CheckResult, dead: CheckResult) -> None:
    p = ctx.profile
    finished = unfinished = undecided = 0
    t0 = time.perf_counter()
    masks0 = ctx.mask_calls
    done = 0
    for w in range(p.uniform_walks + p.rare_walks):
        if ctx.out_of_time():
            _incomplete(sound, f"walks: {done} of {p.uniform_walks + p.rare_walks} ran")
            _incomplete(dead, f"walks: {done} of {p.uniform_walks + p.rare_walks} ran")
            break
        done += 1
        strategy = "uniform" if w < p.uniform_walks else "rare"
        outcome, n_undecided = _walk(ctx, strategy, sound, dead)
        undecided += n_undecided
        if outcome == "finished":
            finished += 1
        elif outcome == "unfinished":
            unfinished += 1
    calls = ctx.mask_calls - masks0
    ctx.seconds_per_mask = (time.perf_counter() - t0) / calls if calls else 0.0
    sound.info.update(walks=done, finished=finished, unfinished_at_cap=unfinished,
                      undecided_prefixes=undecided,
                      ms_per_mask_incl_checks=round(1000 * ctx.seconds_per_mask, 2))
    if ctx.prefix is None:
        sound.notes.append("no prefix reference for this grammar: allowed tokens are judged "
                           "only through finished strings and EOS")


def _choose(ctx: CellContext, strategy: str, allowed: np.ndarray, eos: bool, step: int) -> int | None:
    """The next token of a walk (None: EOS)."""
    budget = ctx.profile.walk_budget
    rng = ctx.rng
    if eos and (not len(allowed) or step >= budget or rng.random() < 0.25):
        return None
    if step >= budget:
        ranks = ctx.finish_rank[allowed]
        best = allowed[ranks == ranks.min()]
        return int(best[rng.randrange(len(best))])
    if strategy == "rare":
        w = ctx.rare_weight[allowed]
        return int(allowed[np.searchsorted(np.cumsum(w), rng.random() * w.sum())
                           .clip(0, len(allowed) - 1)])
    return int(allowed[rng.randrange(len(allowed))])


def _incomplete(check: CheckResult, what: str) -> None:
    """The safety cap stopped ``check`` before its work budget was done."""
    text = f"stopped by the wall-clock safety cap: {what}"
    check.incomplete = f"{check.incomplete}; {text}" if check.incomplete else text


def _walk(ctx: CellContext, strategy: str, sound: CheckResult, dead: CheckResult
          ) -> tuple[str, int]:
    m = ctx.masker
    p = ctx.profile
    state = m.new_state()
    ids: list[int] = []
    undecided = 0
    for step in range(2 * p.walk_budget):
        if ctx.out_of_time():
            _incomplete(sound, f"a walk was cut at step {step}")
            return "cut", undecided
        mask = state.allowed_mask()
        ctx.mask_calls += 1
        if not _state_checks(ctx, state, mask, ids, sound):
            return "failed", undecided
        eos = state.eos_allowed()
        allowed = np.flatnonzero(mask & ctx.is_text)
        if not len(allowed) and not eos:
            ctx.fail(dead, ctx.repro("no_dead_ends", "dead_end", ids[:-1],
                                     ids[-1] if ids else None,
                                     "no token and no EOS allowed after this token"))
            return "failed", undecided
        # Each allowed token sampled must extend to a viable prefix; the chosen one first.
        choice = _choose(ctx, strategy, allowed, eos, step)
        sample = [choice] if choice is not None else []
        k = p.tokens_per_step
        sample += ctx.sample(allowed, k)
        data = ctx.data(ids)
        for t in dict.fromkeys(sample):
            verdict = ctx.viable(data + (ctx.vocab.token_bytes[t] or b""))
            if verdict is None:
                undecided += 1
            elif sound.count(verdict):
                pass
            elif ctx.syntactically_viable(data + (ctx.vocab.token_bytes[t] or b"")):
                ctx.fail(dead, ctx.repro("no_dead_ends", "no_finite_completion", ids, t,
                                         "token allowed but no finite completion exists after "
                                         "it (it enters a rule that can never finish)"))
                if t == choice:
                    return "failed", undecided
            else:
                _report_unsound(ctx, sound, ids, t)
                if t == choice:
                    return "failed", undecided
        # Dead ends: follow a few allowed tokens one step.
        for t in ctx.sample(allowed, p.dead_end_tokens_per_step):
            nxt = state.fork()
            try:
                nxt.advance(int(t))
            except ShimError as exc:
                ctx.fail(sound, ctx.repro("soundness", "advance_refuses_allowed", ids, int(t),
                                          f"the mask allows this token but advance() refuses "
                                          f"it: {exc}"))
                continue
            ctx.mask_calls += 1
            ok = bool(nxt.allowed_mask().any()) or nxt.eos_allowed()
            if dead.count(ok):
                continue
            if ctx.viable(data + (ctx.vocab.token_bytes[int(t)] or b"")) is False:
                continue  # already an unsound token; the dead end follows from it
            ctx.fail(dead, ctx.repro("no_dead_ends", "dead_end", ids, int(t),
                                     "after this token no token and no EOS is allowed"))
        if choice is None:
            state.advance(ctx.eos_ids[0])
            after = state.allowed_mask()
            if sound.count(state.is_finished and not after.any()):
                return "finished", undecided
            ctx.fail(sound, ctx.repro("soundness", "allows_after_eos", ids, None,
                                      f"after EOS is_finished={state.is_finished} and "
                                      f"{int(after.sum())} tokens still allowed"))
            return "failed", undecided
        state.advance(choice)
        ids.append(choice)
    return "unfinished", undecided


def _state_checks(ctx: CellContext, state: MaskerState, mask: np.ndarray, ids: list[int],
                  sound: CheckResult) -> bool:
    """Per-state soundness: shape, padding, special tokens, EOS only where accepting."""
    width = ctx.masker.vocab_size
    if not sound.count(mask.shape == (width,) and mask.dtype == np.bool_):
        ctx.fail(sound, ctx.repro("soundness", "mask_shape", ids, None,
                                  f"mask shape {mask.shape} dtype {mask.dtype}, logits width "
                                  f"{width}"))
        return False
    pad = np.flatnonzero(mask[ctx.n_tokens:])
    if not sound.count(not len(pad)):
        _report_minimised(ctx, sound, "padding_allowed", ids, ctx.n_tokens + int(pad[0]),
                          lambda st: bool(st.allowed_mask()[ctx.n_tokens + int(pad[0])]),
                          f"{len(pad)} padding ids allowed")
        return False
    special = ctx.non_eos_special[mask[ctx.non_eos_special]] if len(ctx.non_eos_special) else []
    if not sound.count(not len(special)):
        t = int(special[0])
        _report_minimised(ctx, sound, "special_allowed", ids, t,
                          lambda st: bool(st.allowed_mask()[t]),
                          f"{len(special)} special (non-EOS) tokens allowed")
        return False
    if len(ctx.control_ids) and ctx.control is not None:
        allowed_control = ctx.control_ids[mask[ctx.control_ids]]
        if ctx.control.count(not len(allowed_control)) is False:
            t = int(allowed_control[0])
            ctx.fail(ctx.control, ctx.repro("control_tokens", "control_token_allowed", ids, t,
                                            f"{len(allowed_control)} chat-template control "
                                            "tokens (added, not flagged special) allowed in "
                                            "output"))
    eos = state.eos_allowed()
    in_mask = any(bool(mask[e]) for e in ctx.eos_ids)
    if not sound.count(eos == in_mask):
        ctx.fail(sound, ctx.repro("soundness", "eos_mask_mismatch", ids, None,
                                  f"eos_allowed()={eos} but EOS in mask={in_mask}"))
        return False
    if eos and not sound.count(ctx.accepts(ids)):
        _report_minimised(ctx, sound, "eos_not_accepting", ids, None,
                          lambda st: st.eos_allowed(),
                          "EOS allowed but the reference does not accept the text",
                          also=lambda sub: not ctx.accepts(sub))
        return False
    return True


def _report_minimised(ctx: CellContext, result: CheckResult, kind: str, ids: list[int],
                      token: int | None, holds: Callable[[MaskerState], bool], detail: str,
                      also: Callable[[list], bool] | None = None) -> None:
    def still_fails(sub: list) -> bool:
        state = ctx.replay(sub)
        return state is not None and holds(state) and (also is None or also(sub))

    short = minimise(list(ids), still_fails, ctx.profile.minimise_budget)
    ctx.fail(result, ctx.repro(result.name, kind, short, token, detail))


def _report_unsound(ctx: CellContext, sound: CheckResult, ids: list[int], token: int) -> None:
    def still_fails(sub: list) -> bool:
        state = ctx.replay(sub)
        return (state is not None and bool(state.allowed_mask()[token])
                and ctx.viable(ctx.data(sub) + (ctx.vocab.token_bytes[token] or b"")) is False)

    short = minimise(list(ids), still_fails, ctx.profile.minimise_budget)
    ctx.fail(sound, ctx.repro("soundness", "unsound_token", short, token,
                              "token allowed but no string of the grammar starts with the text "
                              "plus this token"))


# ---------------------------------------------------------------------------------------------
# Completeness: valid strings under canonical (and non-canonical) tokenizations
# ---------------------------------------------------------------------------------------------
def _follow(ctx: CellContext, ids: Sequence[int]) -> tuple[int | None, bool, list[bool]]:
    """Feed ``ids``: (index of the first refused token or None, EOS allowed at the end,
    whether EOS was allowed before each token)."""
    state = ctx.masker.new_state()
    eos_before = []
    for i, t in enumerate(ids):
        mask = state.allowed_mask()
        eos_before.append(state.eos_allowed())
        if not mask[t]:
            return i, False, eos_before
        state.advance(int(t))
    return None, state.eos_allowed(), eos_before


def completeness(ctx: CellContext, comp: CheckResult, edges: CheckResult, sound: CheckResult
                 ) -> None:
    p = ctx.profile
    strings, rejected = valid_strings(ctx.grammar, p.valid_strings, p.seed)
    comp.info.update(strings=len(strings), generator_rejects=rejected)
    if rejected:
        comp.notes.append(f"{rejected} generated strings were rejected by the reference "
                          "(generator vs Earley lexing) and not used")
    if not strings:
        comp.notes.append("the generator produced no valid string for this grammar")
    declared = ctx.tokenizations
    judged = declared is not Tokenizations.CANONICAL
    comp.info["tokenizations_declared"] = declared.value
    noncanon: dict[str, list[int]] = {}
    categories = {"leading_space": [0, 0], "multi_terminal": [0, 0], "partial_utf8": [0, 0],
                  "three_plus_terminals": [0, 0]}
    modes = {}
    for n_done, (mode, s) in enumerate(strings):
        if ctx.out_of_time():
            _incomplete(comp, f"canonical tokenizations of {n_done} of {len(strings)} valid "
                        "strings checked")
            strings = strings[:n_done]
            break
        ids, how = ctx.vocab.canonical(s)
        modes[how] = modes.get(how, 0) + 1
        refused, eos_end, eos_before = _follow(ctx, ids)
        _categorise(ctx, s, ids, refused, categories, edges)
        # EOS before the end is only sound where the prefix itself is accepted.
        for i, flag in enumerate(eos_before[1:], start=1):
            if flag and not sound.count(ctx.accepts(ids[:i])):
                ctx.fail(sound, ctx.repro("soundness", "eos_not_accepting", ids[:i], None,
                                          "EOS allowed inside a valid string where the prefix "
                                          "is not accepted"))
        if refused is None and comp.count(eos_end):
            continue
        _report_incomplete(ctx, comp, s, mode)
        continue
    comp.info.update(tokenization=modes)
    for n_done, (mode, s) in enumerate(strings):
        if ctx.out_of_time():
            _incomplete(comp, f"non-canonical tokenizations of {n_done} of {len(strings)} "
                        "valid strings checked")
            break
        variants = [("char_by_char", ctx.vocab.char_by_char(s))]
        for _ in range(max(0, p.noncanonical_per_string - 1)):
            variants.append(("random_segmentation", ctx.vocab.segmentation(s, ctx.rng)))
        if any(ord(c) > 127 for c in s):
            variants.append(("bytewise_utf8", ctx.vocab.bytewise(s)))
        canonical = ctx.vocab.canonical(s)[0]
        for kind, ids in variants:
            if ids is None or ids == canonical:
                continue
            refused, eos_end, _ = _follow(ctx, ids)
            ok = refused is None and eos_end
            excused = not ok and _excused_refusal(ctx, ids, refused)
            stats = noncanon.setdefault(kind, [0, 0, 0])
            stats[0 if ok else 2 if excused else 1] += 1
            if not judged:
                continue
            if ok or excused:
                comp.passed += 1
                continue
            _report_non_canonical(ctx, comp, s, kind, ids, refused)
    comp.info["non_canonical_accepted_refused_excused"] = noncanon
    if noncanon and not judged:
        comp.notes.append("non-canonical tokenizations are recorded, not judged (the backend "
                          "declares tokenizations=canonical): " + ", ".join(
                              f"{k} {a} accepted / {r} refused"
                              for k, (a, r, _) in noncanon.items()))
    excused_total = sum(e for _, _, e in noncanon.values())
    if excused_total:
        comp.notes.append(f"{excused_total} non-canonical tokenizations refused inside text the "
                          f"grammar forces, as the backend declares (tokenizations="
                          f"{declared.value}): not failures")
    edges.info["categories_seen_refused"] = categories


def _excused_refusal(ctx: CellContext, ids: list[int], refused: int | None) -> bool:
    """A refusal the backend's tokenizations declaration covers (a split of forced text)."""
    if refused is None or ctx.tokenizations is not Tokenizations.CANONICAL_IN_FORCED_TEXT:
        return False
    state = ctx.replay(ids[:refused])
    return state is not None and excused_split(ctx, ctx.forced, ctx.data(ids[:refused]),
                                               int(ids[refused]),
                                               np.asarray(state.allowed_mask()))


_SEGMENTERS = {"char_by_char": lambda v, s: v.char_by_char(s),
               "bytewise_utf8": lambda v, s: v.bytewise(s)}


def _report_non_canonical(ctx: CellContext, comp: CheckResult, s: str, kind: str,
                          ids: list[int], refused: int | None) -> None:
    """A non-canonical tokenization of a valid string refused (a deterministic segmentation
    is shrunk with its string first)."""
    segment = _SEGMENTERS.get(kind)
    if segment is not None:
        def fails(chars: list) -> bool:
            text = "".join(chars)
            if not text or not ctx.reference.accepts(text):
                return False
            seq = segment(ctx.vocab, text)
            if seq is None:
                return False
            r, eos_end, _ = _follow(ctx, seq)
            return not (r is None and eos_end) and not _excused_refusal(ctx, seq, r)

        short = "".join(minimise(list(s), fails, ctx.profile.minimise_budget))
        seq = segment(ctx.vocab, short) if short else None
        if seq is not None and fails(list(short)):
            s, ids = short, seq
            refused = _follow(ctx, ids)[0]
    where = "EOS refused at its end" if refused is None else f"refused at token {refused}"
    ctx.fail(comp, ctx.repro("completeness", "non_canonical_refused",
                             ids if refused is None else ids[:refused],
                             None if refused is None else ids[refused],
                             f"{kind} tokenization of the valid string {s!r} {where}; the "
                             f"backend declares tokenizations={ctx.tokenizations.value}"))


def _categorise(ctx: CellContext, s: str, ids: list[int], refused: int | None,
                categories: dict, edges: CheckResult) -> None:
    """Count the canonical tokens of each edge category and whether the masker took them."""
    spans = ctx.prefix.terminal_spans(s) if isinstance(ctx.prefix, LarkPrefixChecker) else None
    boundaries = sorted({e for _, _, e in spans}) if spans else []
    pos = 0
    char_of_byte = _char_offsets(s)
    limit = len(ids) if refused is None else refused + 1
    for i, t in enumerate(ids[:limit]):
        b = ctx.vocab.token_bytes[t] or b""
        start, end = char_of_byte(pos), char_of_byte(pos + len(b))
        pos += len(b)
        inner = [x for x in boundaries if start < x < end]
        flags = []
        if ctx.vocab.has_leading_space(t):
            flags.append("leading_space")
        if inner:
            flags.append("multi_terminal")
        if len(inner) >= 2:
            flags.append("three_plus_terminals")
        if ctx.vocab.is_partial_utf8(t):
            flags.append("partial_utf8")
        ok = i != refused
        for f in flags:
            categories[f][0 if ok else 1] += 1
            if ok:
                edges.passed += 1
            else:
                ctx.fail(edges, ctx.repro("tokenizer_edges", f"refused_{f}", ids[:i], t,
                                          f"canonical token of a valid string refused "
                                          f"(terminals={len(inner) + 1})"))


def _char_offsets(s: str) -> Callable[[int], int]:
    """Byte offset -> character offset in ``s`` (a byte inside a character maps into it)."""
    table = []
    for ci, ch in enumerate(s):
        table.extend([ci] * len(ch.encode()))
    table.append(len(s))
    return lambda b: table[min(b, len(table) - 1)]


def _report_incomplete(ctx: CellContext, comp: CheckResult, s: str, mode: str) -> None:
    """Shrink the valid string while it stays valid and still fails, then report."""
    def fails(chars: list) -> bool:
        text = "".join(chars)
        if not text or not ctx.reference.accepts(text):
            return False
        ids = ctx.vocab.canonical(text)[0]
        refused, eos_end, _ = _follow(ctx, ids)
        return refused is not None or not eos_end

    short = "".join(minimise(list(s), fails, ctx.profile.minimise_budget))
    ids = ctx.vocab.canonical(short)[0]
    refused, eos_end, _ = _follow(ctx, ids)
    if refused is not None:
        spans = ctx.prefix.terminal_spans(short) if isinstance(ctx.prefix, LarkPrefixChecker) \
            else None
        ctx.fail(comp, ctx.repro("completeness", "valid_token_refused", ids[:refused],
                                 ids[refused], f"valid string {short!r} (from a {mode!r} string "
                                 f"of {len(s)} chars) refused at token {refused}"
                                 + _terminal_note(ctx, short, ids, refused, spans)))
    else:
        ctx.fail(comp, ctx.repro("completeness", "eos_refused_at_end", ids, None,
                                 f"valid string {short!r} fully accepted but EOS refused at "
                                 "its end"))


def _terminal_note(ctx, s, ids, refused, spans) -> str:
    if not spans:
        return ""
    start = len(ctx.data(ids[:refused]))
    end = start + len(ctx.vocab.token_bytes[ids[refused]] or b"")
    cs, ce = _char_offsets(s)(start), _char_offsets(s)(end)
    inside = [name for name, a, b in spans if a < ce and b > cs]
    return f"; token covers terminals {inside} (terminals={len(inside)})"


# ---------------------------------------------------------------------------------------------
# Tokenizer edge-case probes: padding and special ids are refused by advance()
# ---------------------------------------------------------------------------------------------
def edge_probes(ctx: CellContext, edges: CheckResult) -> None:
    m = ctx.masker
    state = m.new_state()
    width = m.vocab_size
    edges.info.update(logits_width=width, tokenizer_len=ctx.n_tokens,
                      padding_ids=max(0, width - ctx.n_tokens),
                      special_ids=len(ctx.vocab.special_ids), scheme=ctx.vocab.scheme)
    probes = []
    if width > ctx.n_tokens:
        probes.append(("padding", width - 1))
    if len(ctx.non_eos_special):
        probes.append(("special", int(ctx.non_eos_special[0])))
    disallowed = np.flatnonzero(~state.allowed_mask() & ctx.is_text)
    if len(disallowed):
        probes.append(("text", int(disallowed[0])))
    for kind, token in probes:
        probe = state.fork()
        try:
            probe.advance(token)
            ok = False
            why = "advance() accepted it"
        except ForbiddenTokenError as exc:
            ok = exc.token_id == token and exc.step == 0
            why = f"ForbiddenTokenError names token {exc.token_id} step {exc.step}"
        except Exception as exc:  # noqa: BLE001 - any other error is the finding
            ok = False
            why = f"raised {type(exc).__name__}: {exc}"
        if not edges.count(ok):
            ctx.fail(edges, ctx.repro("tokenizer_edges", f"forbidden_{kind}_not_refused", [],
                                      token, why))
    if not len(ctx.non_eos_special):
        edges.notes.append("tokenizer has no special token besides EOS: special-token probe "
                           "not applicable")
    if width == ctx.n_tokens:
        edges.notes.append("logits width equals the vocabulary: no padding ids to probe")


def _phase(run: Callable[[], None], crashed: Sequence[CheckResult]) -> float:
    """Run one phase; a crash in it (the masker's or a check's own) marks the checks it fills
    as crashed: an error of the cell, never a verdict on another class. Returns seconds."""
    t0 = time.perf_counter()
    try:
        run()
    except Exception as exc:  # noqa: BLE001 - a crash is a finding, reported per check
        text = f"{type(exc).__name__}: {exc}"
        for check in crashed:
            check.error = check.error or text
    return round(time.perf_counter() - t0, 3)


def run_cell_checks(ctx: CellContext) -> dict[str, CheckResult]:
    """All per-masker checks; the γ check is added by the runner. The work is fixed by the
    profile's counts; ``profile.safety_cap_s`` (from now) only stops a runaway cell, whose
    unfinished checks are then reported incomplete."""
    sound = CheckResult("soundness")
    comp = CheckResult("completeness")
    dead = CheckResult("no_dead_ends")
    edges = CheckResult("tokenizer_edges")
    control = CheckResult("control_tokens")
    ctx.control = control
    ctx.deadline = time.perf_counter() + ctx.profile.safety_cap_s
    if not len(ctx.control_ids):
        control.not_run = ("the tokenizer has no added token outside its special tokens "
                           "(or the grammar names each one)")
    else:
        control.info["control_tokens"] = [ctx.vocab.text_of(int(i)) for i in ctx.control_ids]
    first = ctx.masker.new_state().allowed_mask()
    width = ctx.masker.vocab_size
    if not sound.count(first.shape == (width,) and first.dtype == np.bool_):
        # Every later check indexes the mask by token id: judged on a misshapen mask they
        # would misread it or crash; the shape failure is the finding.
        ctx.fail(sound, ctx.repro("soundness", "mask_shape", [], None,
                                  f"mask shape {first.shape} dtype {first.dtype}, logits "
                                  f"width {width}"))
        why = "not run: the start state's mask has the wrong shape (see soundness)"
        for check in (comp, dead, edges, control):
            check.not_run = check.not_run or why
        return {c.name: c for c in (sound, comp, dead, edges, control)}
    diagnostics = grammar_diagnostics(ctx.grammar)
    if diagnostics:
        sound.info["grammar_diagnostics"] = diagnostics
        sound.notes.extend(f"grammar: {d}" for d in diagnostics)
    sound.seconds = dead.seconds = _phase(lambda: walks(ctx, sound, dead), (sound, dead))
    comp.seconds = _phase(lambda: completeness(ctx, comp, edges, sound), (comp,))
    edges.seconds = _phase(lambda: edge_probes(ctx, edges), (edges,))
    seconds = _phase(lambda: exhaustive(ctx, sound, comp, dead, control),
                     (sound, comp, dead, control))
    control.seconds = seconds
    sound.info.setdefault("exhaustive", {})["seconds"] = seconds
    return {c.name: c for c in (sound, comp, dead, edges, control)}


# ---------------------------------------------------------------------------------------------
# Exhaustive per-state masks: the whole vocabulary against the reference
# ---------------------------------------------------------------------------------------------
#: Seed of the strings whose prefixes are the exhaustive states: fixed, so a defect found at
#: one profile seed is found at every seed.
EXHAUSTIVE_SEED = 0
#: Repros kept per state, failure kind and known bug (every failing token is still counted).
EXHAUSTIVE_REPROS_PER_STATE = 3


#: The rule by which exhaustive states are drawn, as the report states it.
EXHAUSTIVE_SAMPLING_RULE = (
    "the start state, then for each of `exhaustive_strings` valid strings generated at a fixed "
    "seed (canonical tokenization of L tokens): every depth 1..L when `exhaustive_states` "
    "allows it, else the accepting state (depth L), the last state before it (L-1), the "
    "first state inside a UTF-8 character, and depths spread evenly over 1..L-2 up to an "
    "equal share of `exhaustive_states` (at least 4: a small budget sweeps fewer strings); "
    "states are deduplicated and swept string by string, the deepest first")
#: States per string at least: the two last ones and two more depths (a small budget sweeps
#: fewer strings rather than only their ends).
MIN_STATES_PER_STRING = 4


def _spread(lo: int, hi: int, k: int) -> list[int]:
    """``k`` integers spread evenly over ``lo..hi`` (both ends included when k >= 2)."""
    if k <= 0 or hi < lo:
        return []
    if k >= hi - lo + 1:
        return list(range(lo, hi + 1))
    if k == 1:
        return [(lo + hi) // 2]
    return sorted({lo + round(i * (hi - lo) / (k - 1)) for i in range(k)})


def exhaustive_states(ctx: CellContext) -> list[list[int]]:
    """The states the exhaustive check sweeps (:data:`EXHAUSTIVE_SAMPLING_RULE`): drawn along
    whole valid strings, at every depth or spread over all depths, always with the accepting
    state and the last state before it. At most ``exhaustive_states`` states."""
    p = ctx.profile
    strings, _ = valid_strings(ctx.grammar, p.exhaustive_strings, EXHAUSTIVE_SEED)
    seqs = [ctx.vocab.canonical(s)[0] for _, s in strings]
    total = max(1, p.exhaustive_states)
    share = max(MIN_STATES_PER_STRING, (total - 1) // max(1, len(seqs)))
    out: list[list[int]] = [[]]
    seen = {()}
    for q in seqs:
        n = len(q)
        if n == 0:
            continue
        depths: list[int] = []
        if share >= n:
            depths = list(range(n, 0, -1))
        else:
            depths = [n, n - 1] if n > 1 else [n]
            for k in range(1, n):  # the first state inside a UTF-8 character
                try:
                    tail = decode_prefix(ctx.data(q[:k]))[1]
                except UnicodeDecodeError:
                    continue
                if tail:
                    depths.append(k)
                    break
            rest = share - len(set(depths))
            depths += sorted(_spread(1, n - 2, rest), reverse=True)
        for k in dict.fromkeys(depths):
            if len(out) >= total:
                return out
            if tuple(q[:k]) not in seen:
                seen.add(tuple(q[:k]))
                out.append(list(q[:k]))
    return out


def exhaustive(ctx: CellContext, sound: CheckResult, comp: CheckResult, dead: CheckResult,
               control: CheckResult) -> None:
    """At each exhaustive state, the masker's whole mask against the reference's verdict on
    every token: wrongly allowed (soundness; a dead end when only a rule that never finishes
    continues), wrongly blocked (completeness), control tokens allowed. Per state: counts and
    the shortest token of each kind; per cell: one prefix-minimised repro of each kind."""
    p = ctx.profile
    summary = sound.info.setdefault("exhaustive", {})
    if ctx.prefix is None or p.exhaustive_states <= 0:
        why = "no prefix reference for this grammar" if ctx.prefix is None else "disabled"
        summary["not_run"] = why
        sound.notes.append(f"exhaustive mask check not run: {why}")
        return
    states = exhaustive_states(ctx)
    # Refusals are judged by the refusal reference (for a JSON schema its ordered reading,
    # an under-approximation); without one, only allowed tokens are judged token by token.
    blocking = ctx.refusal_reference
    judge_blocked = blocking is not None
    for note in getattr(ctx.prefix, "notes", []):
        sound.notes.append(note)
    if blocking is not None and blocking is not ctx.prefix:
        summary["refusals_judged_by"] = "the schema's ordered reading (members in schema order)"
    if not judge_blocked:
        summary["blocked_not_judged"] = ctx.refusal_note
        comp.notes.append(f"exhaustive check judges only allowed tokens: {ctx.refusal_note}; "
                          "refusals are judged on generated valid strings")
    elif ctx.tokenizations is Tokenizations.CANONICAL:
        judge_blocked = False
        summary["blocked_not_judged"] = "the backend declares tokenizations=canonical"
        comp.notes.append("exhaustive check judges only allowed tokens: the backend declares "
                          "canonical tokenizations only, so refusals are judged on canonical "
                          "tokenizations of generated valid strings")
    t0 = time.perf_counter()
    deadline = ctx.deadline
    summary["sampling_rule"] = EXHAUSTIVE_SAMPLING_RULE
    rows = []
    totals = dict(states=0, tokens_checked=0, wrongly_allowed=0, wrongly_blocked=0,
                  dead_end_tokens=0, control_allowed=0, undecided=0, skipped_tokens=0,
                  refused_as_declared=0, special_allowed=0, padding_allowed=0, eos_wrong=0)
    minimised: set[str] = set()
    width = ctx.masker.vocab_size
    for n_done, ids in enumerate(states):
        if ctx.out_of_time():
            break
        state = ctx.replay(ids)
        if state is None or state.is_finished:
            continue  # a refused canonical token: the completeness check reports it
        full = np.asarray(state.allowed_mask())
        if full.shape != (width,):
            continue  # the walks report the misshapen mask
        mask = full[:width]
        ctx.mask_calls += 1
        data = ctx.data(ids)
        _sweep_non_text(ctx, state, mask, ids, sound, comp, totals)
        verdicts = reference_verdicts(ctx.prefix, data, ctx.vocab, deadline).verdicts[:width]
        if judge_blocked and blocking is not ctx.prefix:
            certain = reference_verdicts(blocking, data, ctx.vocab, deadline).verdicts[:width]
        else:
            certain = verdicts
        txt = ctx.is_text
        decided_allowed = txt & mask & ((verdicts == VIABLE) | (verdicts == DEAD))
        wrong_allowed = np.flatnonzero(txt & mask & (verdicts == DEAD))
        wrong_blocked = np.flatnonzero(txt & ~mask & (certain == VIABLE))
        viable = txt & (certain == VIABLE)
        excused = 0
        if not judge_blocked:
            wrong_blocked = wrong_blocked[:0]
        elif len(wrong_blocked) and ctx.tokenizations is Tokenizations.CANONICAL_IN_FORCED_TEXT:
            keep = [t for t in wrong_blocked
                    if not excused_split(ctx, ctx.forced, data, int(t), mask)]
            excused = len(wrong_blocked) - len(keep)
            wrong_blocked = np.array(keep, dtype=np.int64)
        row = dict(prefix=ctx.text(ids)[-80:], prefix_tokens=len(ids),
                   tokens_checked=int((txt & (verdicts >= 0)).sum()),
                   undecided=int((txt & (verdicts == UNDECIDED)).sum()),
                   skipped=int((txt & (verdicts == SKIPPED)).sum()),
                   allowed=int((txt & mask).sum()), viable=int(viable.sum()),
                   wrongly_allowed=0, dead_end_tokens=0, wrongly_blocked=int(len(wrong_blocked)),
                   refused_as_declared=excused)
        sound.passed += int(decided_allowed.sum()) - len(wrong_allowed)
        if judge_blocked:
            comp.passed += int((viable & mask).sum())
        dead_ends, unsound = [], []
        for t in wrong_allowed:
            t = int(t)
            if ctx.syntactically_viable(data + ctx.vocab.token_bytes[t]):
                dead_ends.append(t)
            else:
                unsound.append(t)
        row["wrongly_allowed"], row["dead_end_tokens"] = len(unsound), len(dead_ends)
        dead.passed += 1 if not dead_ends else 0
        for kind, check, tokens, detail in (
                ("unsound_token", sound, unsound, "token allowed but no string of the grammar "
                 "starts with the text plus this token (exhaustive mask check)"),
                ("no_finite_completion", dead, dead_ends, "token allowed but no finite "
                 "completion exists after it (exhaustive mask check)"),
                ("valid_token_refused", comp, wrong_blocked, "token refused though the text "
                 "plus this token is the start of a valid string (exhaustive mask check)")):
            if not len(tokens):
                continue
            ordered = sorted((int(t) for t in tokens),
                             key=lambda t: (len(ctx.vocab.token_bytes[t] or b""), t))
            row[f"shortest_{kind}"] = [ordered[0], ctx.vocab.text_of(ordered[0])]
            first_unknown = None
            kept: dict[str | None, int] = {}
            for t in ordered:
                why = detail
                if kind == "valid_token_refused" and \
                        ctx.tokenizations is Tokenizations.ANY and \
                        excused_split(ctx, ctx.forced, data, t, mask):
                    why = detail + f"; {FORCED_TEXT_MARK}: only a split of text the grammar " \
                        "forces is refused, another split is allowed (the backend declares " \
                        "tokenizations=any; canonical_in_forced_text would cover this)"
                repro = ctx.repro(check.name, kind, ids, t, why)
                bug = match_known_bug(repro, ctx.masker.backend_version, ctx.grammar)
                # Every failing token is counted; a few per state and bug keep their repro.
                if kept.get(bug, 0) < EXHAUSTIVE_REPROS_PER_STATE:
                    kept[bug] = kept.get(bug, 0) + 1
                    ctx.fail(check, repro)
                elif bug:
                    check.add_known(bug)
                else:
                    check.failed += 1
                if first_unknown is None and bug is None:
                    first_unknown = t
            if first_unknown is not None and kind not in minimised:
                minimised.add(kind)
                _minimise_exhaustive(ctx, check, kind, ids, first_unknown, detail)
        if len(ctx.control_ids):
            allowed_control = ctx.control_ids[mask[ctx.control_ids]]
            row["control_allowed"] = int(len(allowed_control))
            if control.count(not len(allowed_control)) is False:
                for t in allowed_control:
                    ctx.fail(control, ctx.repro("control_tokens", "control_token_allowed", ids,
                                                int(t), "chat-template control token (added, "
                                                "not flagged special) allowed in output"))
        rows.append(row)
        totals["states"] += 1
        for key in ("tokens_checked", "wrongly_allowed", "wrongly_blocked", "dead_end_tokens",
                    "undecided", "refused_as_declared"):
            totals[key] += row[key]
        totals["skipped_tokens"] += row["skipped"]
        totals["control_allowed"] += row.get("control_allowed", 0)
    seconds = time.perf_counter() - t0
    summary.update(totals, states_available=len(states), seconds=round(seconds, 3),
                   per_state=rows)
    summary["depths"] = sorted({r["prefix_tokens"] for r in rows})
    if ctx.out_of_time() or totals["skipped_tokens"]:
        what = (f"exhaustive mask check: {totals['states']} of {len(states)} states swept, "
                f"{totals['skipped_tokens']} tokens skipped at the last state")
        for check in (sound, comp, dead, control):
            if not check.not_run:
                _incomplete(check, what)


def _sweep_non_text(ctx: CellContext, state: MaskerState, mask: np.ndarray, ids: list[int],
                    sound: CheckResult, comp: CheckResult, totals: dict) -> None:
    """The ids the reference does not judge as text, at an exhaustive state: every special
    (non-EOS) token and every padding id refused, EOS allowed exactly where the reference
    accepts the text (and the mask agrees with ``eos_allowed()``)."""
    special = ctx.non_eos_special[mask[ctx.non_eos_special]] if len(ctx.non_eos_special) \
        else np.zeros(0, dtype=np.int64)
    pad = np.flatnonzero(mask[ctx.n_tokens:]) + ctx.n_tokens
    totals["special_allowed"] += len(special)
    totals["padding_allowed"] += len(pad)
    sound.passed += (len(ctx.non_eos_special) - len(special)) + \
        (len(mask) - ctx.n_tokens - len(pad))
    for kind, wrong in (("special_allowed", special), ("padding_allowed", pad)):
        for t in wrong[:EXHAUSTIVE_REPROS_PER_STATE]:
            ctx.fail(sound, ctx.repro("soundness", kind, ids, int(t),
                                      f"{kind.split('_')[0]} token allowed (exhaustive mask "
                                      "check)"))
        sound.failed += max(0, len(wrong) - EXHAUSTIVE_REPROS_PER_STATE)
    eos = state.eos_allowed()
    in_mask = any(bool(mask[e]) for e in ctx.eos_ids)
    accepts = ctx.accepts(ids)
    if eos != in_mask:
        totals["eos_wrong"] += 1
        ctx.fail(sound, ctx.repro("soundness", "eos_mask_mismatch", ids, None,
                                  f"eos_allowed()={eos} but EOS in mask={in_mask} (exhaustive "
                                  "mask check)"))
    elif eos and not accepts:
        totals["eos_wrong"] += 1
        _report_minimised(ctx, sound, "eos_not_accepting", ids, None,
                          lambda st: st.eos_allowed(),
                          "EOS allowed but the reference does not accept the text (exhaustive "
                          "mask check)", also=lambda sub: not ctx.accepts(sub))
    elif not eos and accepts:
        totals["eos_wrong"] += 1
        ctx.fail(comp, ctx.repro("completeness", "eos_refused_at_end", ids, None,
                                 "the reference accepts the text but EOS is refused (exhaustive "
                                 "mask check)"))
    else:
        sound.passed += 1


#: Marks a refused token where the grammar forces the next text and the backend allows
#: another tokenization of it: only a non-canonical split is refused (known bugs key on it).
FORCED_TEXT_MARK = "forced text"


def _minimise_exhaustive(ctx: CellContext, check: CheckResult, kind: str, ids: list[int],
                         token: int, detail: str) -> None:
    """Replace the first failure of ``kind`` by one with the fewest prefix tokens."""
    def still_fails(sub: list) -> bool:
        state = ctx.replay(sub)
        if state is None or state.is_finished:
            return False
        allowed = bool(state.allowed_mask()[token])
        data = ctx.data(sub) + (ctx.vocab.token_bytes[token] or b"")
        if kind == "valid_token_refused":
            return not allowed and ctx.viable_for_refusal(data) is True
        verdict = ctx.viable(data)
        if kind == "no_finite_completion":
            return allowed and verdict is False and ctx.syntactically_viable(
                ctx.data(sub) + ctx.vocab.token_bytes[token])
        return allowed and verdict is False and not ctx.syntactically_viable(
            ctx.data(sub) + ctx.vocab.token_bytes[token])

    short = minimise(list(ids), still_fails, ctx.profile.minimise_budget)
    if len(short) < len(ids):
        before = (check.failed, check.xfailed)
        ctx.fail(check, ctx.repro(check.name, kind, short, token, detail + " (minimised)"))
        check.failed, check.xfailed = before  # the same failure, not another one


#: Valid strings and cut points a known-bug probe looks at (fixed: a replay is deterministic).
PROBE_STRINGS = 4
PROBE_CUTS_PER_STRING = 3


def replay_known_bug(ctx: CellContext, bug_id: str) -> tuple[bool | None, str]:
    """Whether a known bug the cell's checks did not meet still shows, by its probe.

    True: a probed token behaved as the bug says (the bug reproduces); False: the probe looked
    at its tokens and the backend was right everywhere (the entry is stale); None: nothing to
    look at (no probe, no cut point the masker could be replayed to). The second value says
    where it looked, for the report."""
    probe: Probe | None = known_bug(bug_id).probe
    if probe is None:
        return None, "no probe"
    candidates = [int(t) for t in ctx.vocab.text_ids if probe.token(ctx.vocab.text_of(int(t)))]
    if not candidates:
        return None, "no token of the kind in this vocabulary"
    strings, _ = valid_strings(ctx.grammar, PROBE_STRINGS, EXHAUSTIVE_SEED)
    looked = 0
    for _, text in strings:
        for cut in probe.at(text)[:PROBE_CUTS_PER_STRING]:
            prefix = text[:cut]
            ids = ctx.vocab.canonical(prefix)[0]
            if ctx.vocab.to_bytes(ids) != prefix.encode():
                continue
            state = ctx.replay(ids)
            if state is None:
                continue
            mask = state.allowed_mask()
            for t in candidates:
                viable = ctx.viable(prefix.encode() + ctx.vocab.token_bytes[t])
                if viable is None or viable == probe.shows_when_allowed:
                    continue  # the reference must say the backend is wrong to allow/refuse
                looked += 1
                if bool(mask[t]) == probe.shows_when_allowed:
                    verb = "allowed" if probe.shows_when_allowed else "refused"
                    return True, f"token {ctx.vocab.text_of(t)!r} ({t}) {verb} after {prefix!r}"
    if not looked:
        return None, "no cut point where the reference decides the probed tokens"
    return False, f"{looked} probed token(s) at fixed cut points all handled correctly"

