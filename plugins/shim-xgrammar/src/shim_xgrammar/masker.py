"""The XGrammar masker: one grammar compiled for one tokenizer, one matcher per sequence.

Masks come from ``GrammarMatcher.fill_next_token_bitmask`` (a packed int32 bitmask, unpacked
with numpy, never a Python loop over the vocabulary). EOS is allowed exactly when the matcher
is completed; ids beyond the tokenizer (logit padding) are always masked; after EOS the state
is finished and the mask is all False (XGrammar raises if filled after termination).

Features (docs/design.md), read from the matcher's debug dump (see ``internal_state``):
- parser_state, exact: the Earley items that can consume the next byte, e.g. ``r3.s1.e2/0``;
  ``start_positions`` picks how an item's start is rendered: ``"none"`` (the default, with
  ``position_feature=False``: the readout forgets byte offsets, so states recur and the γ cache
  hits 0.94-0.98 of steps, at no held-out KL cost measured on json, bv4 and sql, see
  benchmarks/gamma_mask_cost.md), ``"absolute"`` (``@5``: carries nesting depth) or
  ``"relative"``. The choice is part of the fingerprint (``xgrammar_features``).
- lexer_state, exact: XGrammar is scannerless, so "inside a lexeme" is the FSM node inside a
  rule: pairs (``rule_name.e<element_id>``, sub_element_id).
- partial_lexeme, missing: literals are merged into per-rule FSMs, so where the current
  literal began is not visible.
If the dump format is not recognised (a newer XGrammar), parser_state falls back to a derived
readout (a digest of the mask and the forced continuation), lexer_state becomes missing, and a
warning says so.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import re
import threading
import warnings
from collections import OrderedDict
from typing import Mapping, Sequence

import numpy as np

from shim_adapters.errors import GrammarError, UnsupportedGrammarError, VocabMismatchError
from shim_adapters.grammars.convert import convert
from shim_adapters.grammars.grammar import Grammar
from shim_adapters.mask.bitmask import apply_token_bitmask_, numpy_view, word_items
from shim_adapters.mask.protocol import FeatureStatus, Masker, MaskerState, StateFeatures
from shim_adapters.mask.tokenizer_identity import TokenizerIdentity

from .byte_guards import REFUSED, ByteGuard, json_string_guard, surrogate_guard
from .internal_state import START_POSITION_MODES, InternalState, parse_internal_state

GRAMMAR_FORMATS = ("ebnf", "json_schema", "regex", "lark")
#: What this backend provides when XGrammar's debug dump is in the known format.
DECLARED_FEATURES: Mapping[str, FeatureStatus] = {
    "parser_state": FeatureStatus.EXACT,
    "lexer_state": FeatureStatus.EXACT,
    "partial_lexeme": FeatureStatus.MISSING,
}
#: What it provides when the dump is not recognised.
FALLBACK_FEATURES: Mapping[str, FeatureStatus] = {
    "parser_state": FeatureStatus.DERIVED,
    "lexer_state": FeatureStatus.MISSING,
    "partial_lexeme": FeatureStatus.MISSING,
}


def xgrammar_version() -> str:
    return importlib.metadata.version("xgrammar")


# ---- compiler cache: one TokenizerInfo + GrammarCompiler per tokenizer identity -------------
_COMPILERS: "OrderedDict[tuple, object]" = OrderedDict()
_COMPILERS_LOCK = threading.Lock()
_MAX_COMPILERS = 8
_TOKENIZER_INFOS: dict[int, object] = {}


def compiler_for(tokenizer, vocab_size: int, stop_token_ids: Sequence[int]):
    """The GrammarCompiler for this tokenizer (by content hash), logits width and stop ids."""
    import xgrammar as xgr

    key = (TokenizerIdentity.of(tokenizer).sha256, vocab_size, tuple(sorted(stop_token_ids)))
    with _COMPILERS_LOCK:
        if key in _COMPILERS:
            _COMPILERS.move_to_end(key)
            return _COMPILERS[key]
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                              stop_token_ids=list(stop_token_ids))
    compiler = xgr.GrammarCompiler(info)
    _TOKENIZER_INFOS[id(compiler)] = info  # deserialising a cached grammar needs it
    with _COMPILERS_LOCK:
        _COMPILERS[key] = compiler
        while len(_COMPILERS) > _MAX_COMPILERS:
            _TOKENIZER_INFOS.pop(id(_COMPILERS.popitem(last=False)[1]), None)
    return compiler


_LINE_COL = re.compile(r"line (\d+), column (\d+)")


#: Compiled grammars above this size stay out of the cross-process cache: XGrammar's JSON
#: serialisation grows up to about 100x the grammar's memory size (a MaskBench Kubernetes schema:
#: 3 MB compiled in 0.1 s, 342 MB of JSON in 25 s at 3 GB resident), so writing and reading it
#: back costs far more than compiling again.
MAX_CACHED_GRAMMAR_BYTES = 2**20


def _compile_cached(compiler, grammar: Grammar, ebnf_text: str | None, tokenizer,
                    vocab_size: int, stop_token_ids) -> object:
    """``_compile`` through the cross-process cache (shim_adapters.mask.compile_cache), keyed on
    the text XGrammar compiles, its version, the tokenizer content, width and stop ids."""
    import xgrammar as xgr

    from shim_adapters.mask.compile_cache import cache_key, default_cache

    info = _TOKENIZER_INFOS.get(id(compiler))
    if info is None:
        return _compile(compiler, grammar, ebnf_text)
    compiled_text = grammar if grammar.format != "lark" else Grammar(ebnf_text, "ebnf",
                                                                       grammar.name)
    key = cache_key(compiled_text, "xgrammar", xgrammar_version(),
                    TokenizerIdentity.of(tokenizer).sha256, vocab_size,
                    {"stop_token_ids": sorted(int(t) for t in stop_token_ids)})
    return default_cache().get_or_build(
        key, lambda: _compile(compiler, grammar, ebnf_text), lambda c: c.serialize_json(),
        lambda text: xgr.CompiledGrammar.deserialize_json(text, info),
        worth_storing=lambda c: c.memory_size_bytes <= MAX_CACHED_GRAMMAR_BYTES)


def _compile(compiler, grammar: Grammar, ebnf_text: str | None):
    try:
        if grammar.format == "json_schema":
            return compiler.compile_json_schema(grammar.text)
        if grammar.format == "regex":
            return compiler.compile_regex(grammar.text)
        return compiler.compile_grammar(ebnf_text)
    except (RuntimeError, ValueError) as exc:
        message = str(exc).strip().splitlines()[-1] if str(exc).strip() else repr(exc)
        message = re.sub(r"^\[[0-9:]+\] \S+: ", "", message)
        where = _LINE_COL.search(message)
        raise GrammarError(f"XGrammar cannot compile this {grammar.format} grammar: {message}",
                           grammar_name=grammar.name,
                           line=int(where.group(1)) if where else None,
                           column=int(where.group(2)) if where else None) from exc


class XGrammarMasker(Masker):
    backend_name = "xgrammar"
    grammar_formats = GRAMMAR_FORMATS

    def __init__(self, grammar: Grammar, tokenizer, vocab_size: int | None = None, *,
                 stop_token_ids: Sequence[int] | None = None,
                 start_positions: str = "none", position_feature: bool = False):
        import xgrammar as xgr

        if grammar.format not in GRAMMAR_FORMATS:
            raise UnsupportedGrammarError(f"xgrammar takes {', '.join(GRAMMAR_FORMATS)}, not "
                                          f"{grammar.format}", grammar_name=grammar.name)
        if start_positions not in START_POSITION_MODES:
            raise ValueError(f"start_positions must be one of {START_POSITION_MODES}")
        self.backend_version = xgrammar_version()
        self.grammar = grammar
        self.tokenizer = tokenizer
        self.tokenizer_size = len(tokenizer)
        self.vocab_size = int(vocab_size) if vocab_size is not None else self.tokenizer_size
        if self.vocab_size < self.tokenizer_size:
            raise VocabMismatchError(f"logits width {self.vocab_size} is smaller than the "
                                     f"tokenizer's {self.tokenizer_size} tokens")
        if stop_token_ids is None:
            if tokenizer.eos_token_id is None:
                raise VocabMismatchError("the tokenizer has no eos_token_id; pass stop_token_ids")
            stop_token_ids = [tokenizer.eos_token_id]
        self.eos_token_ids = frozenset(int(t) for t in stop_token_ids)
        self._eos_array = np.array(sorted(self.eos_token_ids), dtype=np.int64)
        # XGrammar lets control tokens (<unk>, <|im_start|>, ...) through wherever their literal
        # text would fit (found by the conformance suite): only EOS may ever be allowed.
        specials = set(getattr(tokenizer, "all_special_ids", ())) | {
            i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if t.special}
        self._special_array = np.array(sorted(i for i in specials - set(self.eos_token_ids)
                                              if i < self.tokenizer_size), dtype=np.int64)
        self._special_ids = frozenset(self._special_array.tolist())
        self.start_positions = start_positions
        #: Whether the byte position is a feature (``extra["position"]``). Without it and with
        #: ``start_positions="none"`` the features forget absolute offsets, so states recur
        #: far more often (γ cache hits) at the price of nesting depth.
        self.position_feature = bool(position_feature)
        self._position_free = start_positions == "none" and not position_feature
        #: feature_key's readout: 0 the raw dump, 1 the dump without offsets, 2 the features
        #: (the dump is not in the known format)
        self._key_mode = 1 if self._position_free else 0
        #: raw dump -> position-free key: exact dumps recur (bv4: 9 steps in 10), and a
        #: lookup is cheaper than the reduction. One memo for the process: the key is a
        #: function of the dump alone, and a wrapper's masker is built afresh per generate
        #: call (its own memo would start cold every time)
        self._key_memo: dict[str, str] = _KEY_MEMO
        #: token prefix -> feature key, shared by maskers with one fingerprint (see _KeyTrie)
        self._trie: _KeyTrie | None = None

        #: Capability report: ("exact",) or what the Lark -> EBNF conversion lowered.
        self.conversion_notes: tuple[str, ...] = ("exact",)
        ebnf_text = grammar.text if grammar.format == "ebnf" else None
        if grammar.format == "lark":
            converted = convert(grammar, "ebnf")
            self.conversion_notes = converted.notes
            ebnf_text = converted.grammar.text
            if not converted.exact:
                warnings.warn(f"{grammar.name}: lowered for XGrammar: "
                              f"{'; '.join(converted.notes)}", stacklevel=2)
        self.compiler = compiler_for(tokenizer, self.vocab_size, sorted(self.eos_token_ids))
        self.compiled = _compile_cached(self.compiler, grammar, ebnf_text, tokenizer,
                                        self.vocab_size, self.eos_token_ids)
        self._xgr = xgr
        #: XGrammar's batched fill (one C++ call per batch instead of one per row), on one
        #: thread: torch is pinned to one in the benchmarks, and the HF processor it is
        #: compared with fills row by row on the calling thread
        self._batch_matcher = xgr.BatchGrammarMatcher(max_threads=1)
        self._bitmask_shape = xgr.get_bitmask_shape(1, self.vocab_size)
        self._prepare_fixup()
        #: where XGrammar's mask admits invalid text (byte_guards.py): UTF-8 surrogates
        #: always, raw control characters in strings for JSON schemas
        self._guards = _guards_for(self)
        #: the guards' start states (one shared list: a state there holds this very object),
        #: the tokens that move any guard from it, and whether it refuses anything already
        self._guard_start = [guard.start for guard in self._guards]
        self._guard_movers = frozenset().union(*(g.next[g.start] for g in self._guards))
        self._guard_start_clears = any(len(g.clear[g.start][0]) for g in self._guards)
        #: rule_id -> rule name, read from the compiled grammar's printed form (ids follow it).
        self.rule_names: tuple[str, ...] = tuple(
            line.split(" ::= ", 1)[0] for line in str(self.compiled.grammar).splitlines()
            if " ::= " in line)
        self.feature_status = dict(DECLARED_FEATURES)
        probe = xgr.GrammarMatcher(self.compiled)
        if parse_internal_state(probe._debug_print_internal_state()) is None:
            self._use_fallback_features("at start")
        if self._key_mode != 2:
            # stop ids are compiled in (a stop token is no text), so they are part of it
            self._trie = _shared_trie((tuple(sorted(self.fingerprint().items())),
                                       tuple(sorted(self.eos_token_ids))))

    #: Artefacts written before the feature key was recorded used absolute offsets.
    legacy_fingerprint = {"xgrammar_features": "start_positions=absolute,position_feature=True"}

    def fingerprint(self) -> dict[str, str]:
        """The shared fields plus the feature readout: a controller fitted on absolute
        offsets does not read position-free features (and vice versa)."""
        return {**super().fingerprint(),
                "xgrammar_features": f"start_positions={self.start_positions},"
                                     f"position_feature={self.position_feature}"}

    @classmethod
    def feature_options(cls, manifest: Mapping[str, object]) -> dict[str, object]:
        """The ``start_positions`` / ``position_feature`` a manifest's controller was fitted
        with (wrappers build their masker with them)."""
        text = str(manifest.get("xgrammar_features",
                                cls.legacy_fingerprint["xgrammar_features"]))
        fields = dict(part.split("=", 1) for part in text.split(",") if "=" in part)
        if (fields.get("start_positions") not in START_POSITION_MODES
                or fields.get("position_feature") not in ("True", "False")):
            raise ValueError(f"manifest field 'xgrammar_features' is {text!r}: expected "
                             f"'start_positions=<{'|'.join(START_POSITION_MODES)}>,"
                             f"position_feature=<True|False>'")
        return {"start_positions": fields["start_positions"],
                "position_feature": fields["position_feature"] == "True"}

    def _prepare_fixup(self) -> None:
        """The few bitmask words XGrammar's fill gets wrong for us: control tokens (it lets
        them through), logit padding it does not know as special, and EOS (allowed exactly
        when the matcher completes)."""
        words = self._bitmask_shape[1]
        clear = np.zeros(words * 32, dtype=bool)
        clear[self._special_array] = True
        clear[self.tokenizer_size:] = True
        # XGrammar never allows its own special tokens (padding among them): no fix-up there
        never = np.array([i for i in self.compiled.tokenizer_info.special_token_ids
                          if 0 <= i < words * 32 and i not in self.eos_token_ids], dtype=np.int64)
        clear[never] = False
        clear[self._eos_array] = True
        eos = np.zeros(words * 32, dtype=bool)
        eos[self._eos_array] = True
        packed_clear = np.packbits(clear, bitorder="little").view(np.int32)
        packed_eos = np.packbits(eos, bitorder="little").view(np.int32)
        self._fix_words = np.flatnonzero(packed_clear)
        self._fix_keep = ~packed_clear[self._fix_words]
        self._fix_eos = packed_eos[self._fix_words]
        # the same as runs of consecutive words (padding and control tokens usually sit
        # together): basic slices, far cheaper than fancy indexing for one row
        fix = self._fix_words
        breaks = np.flatnonzero(np.diff(fix) != 1) + 1
        self._fix_runs = [(int(run[0]), int(run[-1]) + 1, ~packed_clear[run[0]:run[-1] + 1])
                          for run in np.split(fix, breaks) if len(run)]
        self._eos_words = [(int(w), int(packed_eos[w])) for w in np.flatnonzero(packed_eos)]
        #: (word, bits) when every EOS id sits in one word, else None
        self._eos_word = self._eos_words[0] if len(self._eos_words) == 1 else None
        #: the same word by word (Python ints), where there are only a few words to fix
        self._fix_scalars = ([(int(w), int(k)) for w, k in zip(fix, self._fix_keep)]
                             if len(fix) <= _ITEM_FIX_WORDS else None)
        self._fix_eos_by_word = {int(w): int(b) for w, b in self._eos_words}
        self._eos_word_ids = np.array([w for w, _ in self._eos_words], dtype=np.intp)
        self._eos_word_bits = np.array([b for _, b in self._eos_words], dtype=np.int32)

    def fill_next_token_bitmasks(self, states, bitmask, rows) -> None:
        """XGrammar's fill (one batched call for a batch), then :meth:`_fix_up_rows`: row by
        row, word by word through the bitmask's memoryview when the masker has at most
        ``_ITEM_FIX_WORDS`` words to fix (every tokenizer measured); otherwise row by row for
        a few rows and with array ops for a batch."""
        words = _numpy_view(bitmask)
        items = word_items(words) if self._fix_scalars is not None else None
        if len(states) == 1 and type(states[0]) is XGrammarState:  # batch 1: no lists
            state, row = states[0], rows[0]
            if state.masker is self and not state._finished:
                state._matcher.fill_next_token_bitmask(bitmask, row)
                self._fix_up_rows(words, items, states, rows)
                return
        live, live_rows, batched, batched_rows = [], [], [], []
        own_fill = XGrammarState._fill_raw
        for row, state in zip(rows, states):
            if state.masker is not self:  # another masker's state: its own fill
                state.fill_next_token_bitmask(bitmask, row)
                continue
            if state._finished:
                words[row] = 0
                continue
            if type(state)._fill_raw is own_fill:
                batched.append(state._matcher)
                batched_rows.append(row)
            else:  # a state whose mask comes from elsewhere (a wrapped processor's bitmask)
                state._fill_raw(bitmask, row)
            live.append(state)
            live_rows.append(row)
        if len(batched) == 1:
            batched[0].fill_next_token_bitmask(bitmask, batched_rows[0])
        elif batched:
            self._batch_matcher.batch_fill_next_token_bitmask(batched, bitmask, batched_rows)
        if not live:
            return
        if items is not None or len(live) <= _ITEM_FIX_ROWS:
            # a few words to fix, or a few rows: row by row, word by word (inside generate
            # cheaper than the array ops below, whose every call runs cold)
            self._fix_up_rows(words, items, live, live_rows)
            return
        # a batch: one gather of the EOS words, one slice op per run of fix-up words
        first, last = live_rows[0], live_rows[-1] + 1
        consecutive = last - first == len(live)
        block = words[first:last] if consecutive else words[live_rows]
        raw = block[:, self._eos_word_ids] & self._eos_word_bits  # only the EOS words copied
        completed = [live_rows[i] for i in np.flatnonzero(raw.any(axis=1)).tolist()
                     if live[i]._matcher.is_completed()]
        if consecutive:
            for a, b, keep in self._fix_runs:
                words[first:last, a:b] &= keep
        else:
            for row in live_rows:
                for a, b, keep in self._fix_runs:
                    words[row, a:b] &= keep
        for row in completed:
            for w, bits in self._eos_words:
                words[row, w] |= bits
        start = self._guard_start
        for row, state in zip(live_rows, live):
            at = state._guard_states
            if at is not start or self._guard_start_clears:  # usually no guard refuses here
                self._guard_rows(words, row, at)

    def _fix_up_rows(self, words: np.ndarray, items: memoryview | None, states, rows) -> None:
        """The masker's corrections to XGrammar's fill of row ``rows[i]`` for ``states[i]``
        (of the numpy bitmask ``words``), in one loop: control tokens and padding cleared, EOS
        where XGrammar allowed it and the matcher completes (so ``is_completed`` is asked only
        there), the byte guards' refusals. ``items``: the bitmask's
        :func:`~shim_adapters.mask.bitmask.word_items` when the masker has only a few words to fix
        (then they are fixed word by word), else None (slice ops on each row)."""
        eos_words = self._eos_words
        start, start_clears = self._guard_start, self._guard_start_clears
        if items is not None:
            per_row, fixes, eos_word = self._bitmask_shape[1], self._fix_scalars, self._eos_word
            for state, row in zip(states, rows):
                base = row * per_row
                if eos_word is not None:  # the usual case: every EOS id in one word
                    eos_allowed = items[base + eos_word[0]] & eos_word[1]
                else:
                    eos_allowed = any(items[base + w] & bits for w, bits in eos_words)
                for w, keep in fixes:
                    items[base + w] &= keep
                if eos_allowed and state._matcher.is_completed():
                    for w, bits in eos_words:
                        items[base + w] |= bits
                if state._guard_states is not start or start_clears:
                    self._guard_rows(words, row, state._guard_states)
            return
        for state, row in zip(states, rows):
            own = words[row]
            eos_allowed = any(int(own[w]) & bits for w, bits in eos_words)
            for a, b, keep in self._fix_runs:
                own[a:b] &= keep
            if eos_allowed and state._matcher.is_completed():
                for w, bits in eos_words:
                    own[w] |= bits
            if state._guard_states is not start or start_clears:
                self._guard_rows(words, row, state._guard_states)

    def _guard_rows(self, words: np.ndarray, row: int, guard_states) -> None:
        """The byte guards' refusals at their states ``guard_states``, in row ``row``."""
        for guard, g_state in zip(self._guards, guard_states):
            index, keep = guard.clear[g_state]
            if len(index):
                words[row, index] &= keep

    def advance_states(self, states, token_ids) -> None:
        """``advance`` of each row, inlined for this masker's plain states (a batch's step is
        per-row Python overhead around XGrammar's accept). XGrammar's ``batch_accept_token``
        measured slower than this loop (``benchmarks/gamma_mask_cost.md``, 'XGrammar's step')."""
        size, special = self.tokenizer_size, self._special_ids
        start, movers = self._guard_start, self._guard_movers
        for state, token_id in zip(states, token_ids):
            token_id = int(token_id)
            if type(state) is not XGrammarState or state.masker is not self:
                state.advance(token_id)
                continue
            # the guards' usual case (all at their start, a token that moves none) inline
            after = start if state._guard_states is start and token_id not in movers \
                else state._guards_after(token_id)
            if (state._finished or not 0 <= token_id < size or token_id in special
                    or after is None or not state._matcher.accept_token(token_id)):
                raise state._forbidden(token_id)
            state._note_accepted(token_id, after)

    def apply_token_bitmask_(self, logits, bitmask) -> None:
        """XGrammar's own kernel on an accelerator; on CPU the core's kernel
        (:func:`shim_adapters.mask.bitmask.apply_token_bitmask_`), which measured cheaper than
        XGrammar's CPU kernel, warm (1.1-5.5x, ``benchmarks/apply_kernel.py``) and inside
        ``generate`` (``benchmarks/cold_ops.py``), and stays inside each row (XGrammar
        0.2.9's writes past it at some widths: docs/upstream-reports.md)."""
        if logits.is_cpu:
            apply_token_bitmask_(logits, bitmask)
        else:
            self._xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device))

    def _use_fallback_features(self, where: str) -> None:
        if self.feature_status != FALLBACK_FEATURES:
            warnings.warn(f"XGrammar {self.backend_version}: unrecognised internal-state dump "
                          f"({where}); parser_state is derived from the mask, lexer_state is "
                          "missing", RuntimeWarning, stacklevel=3)
            self.feature_status = dict(FALLBACK_FEATURES)
            self._key_mode = 2
            self._trie = None

    @functools.cached_property
    def decoded_vocab(self) -> list[bytes]:
        """Token bytes as XGrammar sees them (its property rebuilds the list on every access)."""
        return list(self.compiled.tokenizer_info.decoded_vocab)

    def new_state(self) -> "XGrammarState":
        return XGrammarState(self, self._xgr.GrammarMatcher(self.compiled), [], False)

    def clear_key_trie(self) -> None:
        """Forget the prefixes seen (benchmarks: time fresh sequences from a cold trie)."""
        if self._trie is not None:
            self._trie.reset()

    def key_trie_info(self) -> dict[str, int]:
        """Size of the token-prefix key memo (nodes, bound, dumps it saved; empty without)."""
        trie = self._trie
        if trie is None:
            return {}
        return {"nodes": trie.nodes, "max_nodes": trie.max_nodes, "served": trie.served,
                "dumped": trie.dumped}

    def rule_name(self, rule_id: int) -> str:
        if 0 <= rule_id < len(self.rule_names):
            return self.rule_names[rule_id]
        return f"rule{rule_id}"


#: What the reference position-free key (:func:`_position_free_key_regex`) leaves out of
#: XGrammar's dump: the step count and start offsets (captured, to rank them).
_OFFSETS = re.compile(r"There are \d+ steps|rule_start_pos=(-?\d+)")


#: Bound on the raw-dump memo (cleared when full; a dump is a few hundred bytes).
_KEY_MEMO_SIZE = 1 << 14
#: The raw-dump memo every position-free masker shares (see ``XGrammarMasker._key_memo``).
_KEY_MEMO: dict[str, str] = {}


def _position_free_key(dump: str) -> str:
    """The feature key of a dump, as one ``str``: its items without their start offsets, then
    the offsets' rank order (0 = innermost; the usual innermost-first layout is written as the
    item count); the header's step count is dropped. A ``str`` caches its hash, so the γ
    cache's lookup of a key the trie serves costs no hashing. String methods only, no regex
    and no Python loop over items: inside ``generate`` a new state's key is built with caches
    cold, where a loop over items measured slower (``benchmarks/gamma_mask_cost.md``, 'state
    key'). Each offset lies between ``rule_start_pos=`` and ``, sub_element_id=`` (XGrammar
    0.2.9's layout), so one replace and one split leave texts and offsets alternating; a dump
    in any other layout (an offset that is not an integer) gets the reference's key itself, as
    one ``str`` (rare: speed moot). The same partition of states as
    :func:`_position_free_key_regex` (the reference; tested)."""
    parts = dump.replace(", sub_element_id=", "rule_start_pos=").split("rule_start_pos=")
    starts = parts[1::2]
    if starts:
        # each offset digits with an optional sign, as the reference's pattern reads them
        # (int() alone would also take " 5", "+5" or "1_0")
        if not "".join(starts).replace("-", "").isdigit():
            return str(_position_free_key_regex(dump))
        try:
            ints = list(map(int, starts))
        except ValueError:  # "5-3", "--5": digits and signs, but not one integer
            return str(_position_free_key_regex(dump))
    head = parts[0]
    cut = head.find(" steps", 10)
    if cut > 10 and head.startswith("There are ") and head[10:cut].isdigit():
        parts[0] = head[cut:]
    text = "\x02".join(parts[::2])
    if len(starts) > 1:
        order = sorted(set(ints), reverse=True)
        if order != ints:  # not the usual layout: the rank of each item's offset
            rank = {start: str(i) for i, start in enumerate(order)}
            return text + "\x01" + ",".join(map(rank.__getitem__, ints))
    return text + "\x01" + str(len(starts))


def _position_free_key_regex(dump: str) -> tuple:
    """The reference position-free key, by one regex split: (the dump's texts without the step
    count and offsets, the offsets' ranks or the item count)."""
    parts = _OFFSETS.split(dump)
    starts = parts[3::2]  # parts[1] is the header's (uncaptured) None
    if len(starts) < 2:
        return tuple(parts[::2]), len(starts)
    order = sorted(set(starts), key=int, reverse=True)
    return tuple(parts[::2]), tuple([order.index(p) for p in starts])


class _TrieNode:
    __slots__ = ("key", "next")

    def __init__(self):
        self.key = None  # the feature key after this token prefix, once dumped
        self.next: dict[int, "_TrieNode"] | None = None


#: (id(compiler), kind) -> guard: one per tokenizer, width and stop ids
_GUARDS: dict[tuple[int, str], ByteGuard] = {}


def _guards_for(masker: "XGrammarMasker") -> tuple[ByteGuard, ...]:
    """The masker's guards, each built once per compiler (tokenizer, width, stop ids)."""
    kinds = [("surrogates", surrogate_guard)]
    if masker.grammar.format == "json_schema":
        kinds.append(("json-strings", json_string_guard))
    out = []
    for kind, build in kinds:
        key = (id(masker.compiler), kind)
        guard = _GUARDS.get(key)
        if guard is None:
            vocab = masker.decoded_vocab[:masker.tokenizer_size]
            skip = set(masker._special_ids) | set(masker.eos_token_ids)
            guard = build(vocab, masker._bitmask_shape[1], skip)
            with _COMPILERS_LOCK:
                live = {id(c) for c in _COMPILERS.values()}
                for stale in [k for k in _GUARDS if k[0] not in live]:
                    del _GUARDS[stale]
                _GUARDS[key] = guard
        out.append(guard)
    return tuple(out)


#: Fix-ups word by word when at most this many words and rows (else slice ops).
_ITEM_FIX_WORDS = 8
_ITEM_FIX_ROWS = 4


class _KeyTrie:
    """Feature keys by token prefix: a matcher's state is a function of the tokens it
    accepted from the start, so a prefix seen before gives its key without XGrammar's state
    dump, the largest item of a γ-cache hit. Exact by construction, unlike a (key, token) ->
    key memo: the position-free key does not determine the next one (after ``)`` or a closing
    quote it depends on the enclosing rule; ``benchmarks/gamma_mask_cost.md``, 'state key').
    Bounded: when full it starts over (states keep walking the nodes they hold)."""

    __slots__ = ("root", "nodes", "max_nodes", "served", "dumped")

    def __init__(self, max_nodes: int):
        self.max_nodes = max_nodes
        self.reset()

    def reset(self) -> None:
        self.root = _TrieNode()
        self.nodes = 1
        self.served = self.dumped = 0

    def child(self, node: _TrieNode, token_id: int) -> _TrieNode | None:
        nxt = node.next
        if nxt is None:
            nxt = node.next = {}
        else:
            found = nxt.get(token_id)
            if found is not None:
                return found
        if self.nodes >= self.max_nodes:
            self.root, self.nodes = _TrieNode(), 1
            return None
        self.nodes += 1
        found = nxt[token_id] = _TrieNode()
        return found


#: Bound on a key trie's nodes (about 0.3 KiB each with their child dicts: ~20 MiB).
KEY_TRIE_NODES = 1 << 16
_TRIES: "OrderedDict[tuple, _KeyTrie]" = OrderedDict()
_MAX_TRIES = 16


def _shared_trie(identity: tuple) -> _KeyTrie:
    """The key trie of maskers with this fingerprint (a wrapper's masker is built afresh per
    ``generate`` call; its prefixes stay warm)."""
    with _COMPILERS_LOCK:
        trie = _TRIES.get(identity)
        if trie is None:
            trie = _TRIES[identity] = _KeyTrie(KEY_TRIE_NODES)
            while len(_TRIES) > _MAX_TRIES:
                _TRIES.popitem(last=False)
        else:
            _TRIES.move_to_end(identity)
        return trie


def _numpy_view(bitmask) -> np.ndarray:
    """A bitmask's words as numpy (the caller reuses one bitmask: its view is remembered)."""
    return bitmask if isinstance(bitmask, np.ndarray) else numpy_view(bitmask)


class XGrammarState(MaskerState):
    def __init__(self, masker: XGrammarMasker, matcher, token_ids: list[int], finished: bool,
                 node: _TrieNode | None = None, guard_states: Sequence[int] | None = None):
        self.masker = masker
        self._matcher = matcher
        self._token_ids = token_ids
        self._finished = finished
        self._bitmask = np.zeros(masker._bitmask_shape, dtype=np.int32)
        #: this state's token prefix in the masker's key trie (None: not tracked)
        trie = masker._trie
        self._node = node if node is not None else (
            trie.root if trie is not None and not token_ids else None)
        #: each of the masker's byte guards' state (byte_guards.py); never mutated, replaced
        #: (the masker's start list itself while every guard is at its start)
        self._guard_states = masker._guard_start if guard_states is None else guard_states

    # ---- mask ------------------------------------------------------------------------------
    def _fill(self) -> np.ndarray:
        self._matcher.fill_next_token_bitmask(self._bitmask)
        return self._bitmask

    def allowed_mask(self) -> np.ndarray:
        masker = self.masker
        if self._finished:
            return np.zeros(masker.vocab_size, dtype=bool)
        mask = np.unpackbits(self._fill().view(np.uint8), count=masker.vocab_size,
                             bitorder="little").view(bool)
        mask[masker.tokenizer_size:] = False
        mask[masker._special_array] = False
        # EOS: where XGrammar allows it and the matcher completes (as the bitmask fills)
        mask[masker._eos_array] = bool(mask[masker._eos_array].any()) and \
            self._matcher.is_completed()
        for guard, state in zip(masker._guards, self._guard_states):
            mask[guard.refused_ids[state]] = False
        return mask

    def fill_next_token_bitmask(self, bitmask, row: int = 0) -> None:
        """XGrammar's own fill into the caller's bitmask, then the few words it gets wrong."""
        words = _numpy_view(bitmask)
        if self._finished:
            words[row] = 0
            return
        self._fill_raw(bitmask, row)
        masker = self.masker
        masker._fix_up_rows(words, word_items(words) if masker._fix_scalars is not None
                            else None, (self,), (row,))

    def _fill_raw(self, bitmask, row: int) -> None:
        """XGrammar's mask for this row, before the fix-ups."""
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def dumped_feature_key(self):
        """The key computed from the matcher's dump, bypassing the prefix trie (to check that
        the trie serves exactly the key the dump gives)."""
        node, self._node = self._node, None
        try:
            return self.feature_key()
        finally:
            self._node = node

    def feature_key(self):
        """XGrammar's raw state dump: it determines the features, and skips their parse
        (position-free: the dump without its byte offsets, plus the offsets' rank order)."""
        if self._finished:
            return ("finished",)
        node = self._node
        masker = self.masker
        if node is not None:
            key = node.key
            if key is not None and masker._trie is not None:
                masker._trie.served += 1
                return key
        if masker._key_mode == 0:
            key = self._matcher._debug_print_internal_state()
        elif masker._key_mode == 1:
            dump = self._matcher._debug_print_internal_state()
            memo = masker._key_memo
            key = memo.get(dump)
            if key is None:
                if len(memo) >= _KEY_MEMO_SIZE:
                    memo.clear()
                key = memo[dump] = _position_free_key(dump)
        else:
            return super().feature_key()
        if node is not None and masker._trie is not None:
            node.key = key
            masker._trie.dumped += 1
        return key

    @property
    def step(self) -> int:
        return len(self._token_ids)

    def eos_allowed(self) -> bool:
        return not self._finished and self._matcher.is_completed()

    # ---- transitions -----------------------------------------------------------------------
    def advance(self, token_id: int) -> None:
        token_id = int(token_id)
        after = self._guards_after(token_id)
        if (self._finished or not 0 <= token_id < self.masker.tokenizer_size
                or token_id in self.masker._special_ids or after is None
                or not self._matcher.accept_token(token_id)):
            raise self._forbidden(token_id)
        self._note_accepted(token_id, after)

    def _guards_after(self, token_id: int) -> list[int] | None:
        """The byte guards' states after ``token_id``; None if one of them refuses it."""
        masker = self.masker
        start = masker._guard_start
        if self._guard_states is start and token_id not in masker._guard_movers:
            return start  # the usual case: every guard stays where it started
        after = []
        for guard, state in zip(masker._guards, self._guard_states):
            nxt = guard.next[state].get(token_id, guard.default[state])
            if nxt == REFUSED:
                return None
            after.append(nxt)
        return start if after == start else after

    def _note_accepted(self, token_id: int, guard_states: list[int] | None = None) -> None:
        """Bookkeeping after the matcher accepted ``token_id``: history, key trie, EOS, the
        byte guards' states (computed here unless given)."""
        if guard_states is None:
            guard_states = self._guards_after(token_id)
            if guard_states is None:  # only a matcher advanced elsewhere (a wrapper's) gets here
                raise self._forbidden(token_id)
        self._guard_states = guard_states
        self._token_ids.append(token_id)
        node = self._node
        if node is not None:
            trie = self.masker._trie
            self._node = trie.child(node, token_id) if trie is not None else None
        if token_id in self.masker.eos_token_ids:
            self._finished = True

    def fork(self) -> "XGrammarState":
        return XGrammarState(self.masker, self._matcher.fork(), list(self._token_ids),
                             self._finished, self._node, self._guard_states)

    @property
    def token_ids(self) -> Sequence[int]:
        return tuple(self._token_ids)

    @property
    def is_finished(self) -> bool:
        return self._finished

    # ---- features --------------------------------------------------------------------------
    def internal_state(self) -> InternalState | None:
        """The parsed Earley items, or None when the dump format is not recognised."""
        return parse_internal_state(self._matcher._debug_print_internal_state())

    def features(self) -> StateFeatures:
        masker = self.masker
        if self._finished:
            return StateFeatures(
                parser_state=(), partial_lexeme=None,
                lexer_state=None if masker.feature_status["lexer_state"] is FeatureStatus.MISSING
                else frozenset(), extra={"finished": True})
        state = None
        if masker.feature_status["parser_state"] is FeatureStatus.EXACT:
            state = self.internal_state()
            if state is None:
                masker._use_fallback_features(f"at step {self.step}")
        if state is None:
            digest = hashlib.blake2b(self._fill().tobytes(), digest_size=8).hexdigest()
            forced = self._matcher.find_jump_forward_string()
            return StateFeatures(parser_state=(f"mask:{digest}", f"forced:{forced}"),
                                 extra={"completed": self._matcher.is_completed()})
        mode = masker.start_positions
        parser_state = tuple(dict.fromkeys(item.render(state.position, mode)
                                           for item in state.items))
        lexer_state = frozenset(
            (f"{masker.rule_name(item.rule_id)}.e{item.element_id}", item.sub_element_id)
            for item in state.items)
        extra = {"n_items": len(state.items)}
        if masker.position_feature:
            extra["position"] = state.position
        return StateFeatures(parser_state=parser_state, lexer_state=lexer_state,
                             partial_lexeme=None, extra=extra)
