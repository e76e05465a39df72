"""A grammar compiled by SynCode for one tokenizer: LALR tables, terminal DFAs, mask store.

SynCode's own ``MaskStore.init_mask_store`` caches on disk under ``cache/`` in the working
directory, keyed on (tokenizer class, grammar hash, ``tokenizer.vocab_size``): two tokenizers of
the same class and size share one file and get each other's masks. We bypass it and key an
in-memory cache on the tokenizer's content hash, the grammar hash and the SynCode version;
nothing is written to disk and nothing is unpickled.
"""

from __future__ import annotations

import functools
import re
import threading
import time
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np

from shim_adapters.errors import GrammarError, UnsupportedGrammarError, VocabMismatchError
from shim_adapters.grammars.grammar import Grammar
from shim_adapters.mask.tokenizer_identity import TokenizerIdentity
from shim_adapters.mask.utf8 import utf8_prefix_ok

from ._syncode_import import syncode_modules, syncode_version
from .frontier_parser import GrammarTables
from .span_filter import SpanFilter
from .utf8_table import Utf8Continuations

#: SynCode mask-store mode. ``grammar_mask`` over-approximates (allows invalid tokens and then
#: stops constraining), so it is never used.
MASK_STORE_MODE = "grammar_strict"


@dataclass(frozen=True)
class CacheKey:
    tokenizer_sha256: str
    grammar_sha256: str
    syncode_version: str
    mode: str
    vocab_len: int
    lexing: str = "auto"


@dataclass
class CompiledGrammar:
    """Read-only after construction; shared by every state of every masker built from it."""

    key: CacheKey
    lark_text: str
    tables: GrammarTables
    mask_store: object  # syncode MaskStore (None with dynamic lexing)
    token_bytes: list[bytes]  # token id -> bytes
    special_ids: frozenset[int]  # special tokens other than EOS: never allowed
    #: token id -> its bytes can start valid UTF-8 text (complete chars, maybe a truncated last
    #: one). SynCode's byte DFAs route unknown bytes through "anything else", so they would let
    #: a stray 0xF5 byte into a JSON string; text must stay decodable.
    utf8_clean: np.ndarray
    #: token id -> contains a tab. SynCode's store checks tokens with each tab replaced by four
    #: spaces (a Python-indentation shortcut), so its entries for these are wrong in any other
    #: grammar (a tab inside a JSON string); the masker drops them from the store's answer and
    #: decides them on their real bytes.
    tab_tokens: np.ndarray
    #: (terminal, DFA state) -> tokens that keep that DFA alive (see _token_tables)
    inside_lexeme: dict[tuple[str, object], np.ndarray]
    #: (terminal, DFA state) -> tokens that may span several lexemes, verified per step
    span_candidates: dict[tuple[str, object], np.ndarray]
    state_codes: dict[str, dict[object, int]]  # terminal -> DFA state -> int code
    ignore_whitespace: bool
    compile_seconds: float
    #: "basic" (SynCode's lexer and mask store) or "dynamic" (Earley-style lexing, see
    #: dynamic_lexing; chosen when terminals overlap, where the basic lexer is incomplete)
    lexing: str = "basic"
    dynamic: object = None  # dynamic_lexing.DynamicTables when lexing == "dynamic"
    span_filter: object = None  # span_filter.SpanFilter (basic lexing only)
    utf8_continuations: object = None  # utf8_table.Utf8Continuations


_cache: dict[CacheKey, CompiledGrammar] = {}
_cache_lock = threading.Lock()


def lark_text_of(grammar: Grammar) -> str:
    """The Lark text SynCode compiles: native Lark, or EBNF lowered by shim_adapters."""
    if grammar.format == "lark":
        return grammar.text
    if grammar.format == "ebnf":
        try:
            from shim_adapters.grammars.convert import ebnf_to_lark
        except ImportError:
            raise UnsupportedGrammarError(
                "the syncode backend compiles Lark; EBNF needs "
                "shim_adapters.grammars.convert.ebnf_to_lark, which this installation lacks",
                grammar_name=grammar.name) from None
        return ebnf_to_lark(grammar.text, grammar_name=grammar.name)
    raise UnsupportedGrammarError(
        f"the syncode backend takes Lark (or EBNF) grammars, not {grammar.format}; use the "
        "xgrammar or outlines backend for JSON schemas and regexes", grammar_name=grammar.name)


LEXING_MODES = ("auto", "basic", "dynamic")


def cache_key(grammar: Grammar, tokenizer, lark_text: str | None = None,
              lexing: str = "auto") -> CacheKey:
    """What a compiled mask store depends on: tokenizer content, grammar, SynCode version."""
    import hashlib

    text = lark_text if lark_text is not None else lark_text_of(grammar)
    return CacheKey(tokenizer_sha256=TokenizerIdentity.of(tokenizer).sha256,
                    grammar_sha256=hashlib.sha256(text.encode()).hexdigest(),
                    syncode_version=syncode_version(), mode=MASK_STORE_MODE,
                    vocab_len=len(tokenizer.get_vocab()), lexing=lexing)


def compile_grammar(grammar: Grammar, tokenizer, lexing: str = "auto") -> CompiledGrammar:
    """Compile (or fetch from the in-memory cache) ``grammar`` for ``tokenizer``.

    ``lexing``: "basic" (SynCode's own lexer and mask store), "dynamic" (Earley-style, every
    expected terminal at its longest match) or "auto": basic unless two terminals overlap.
    """
    if lexing not in LEXING_MODES:
        raise ValueError(f"lexing must be one of {LEXING_MODES}, not {lexing!r}")
    lark_text = lark_text_of(grammar)
    key = cache_key(grammar, tokenizer, lark_text, lexing)
    with _cache_lock:
        hit = _cache.get(key)
        if hit is not None:
            return hit
        compiled = _build(grammar, lark_text, tokenizer, key)
        _cache[key] = compiled
        return compiled


def clear_cache() -> None:
    with _cache_lock:
        _cache.clear()


def _build(grammar: Grammar, lark_text: str, tokenizer, key: CacheKey) -> CompiledGrammar:
    mods = syncode_modules()
    started = time.perf_counter()
    vocab = tokenizer.get_vocab()
    if sorted(vocab.values()) != list(range(len(vocab))):
        raise VocabMismatchError(
            f"tokenizer {TokenizerIdentity.of(tokenizer).name!r} has non-contiguous token ids; "
            "SynCode's mask store indexes tokens 0..len(vocab)-1")
    if tokenizer.eos_token_id is None:
        raise VocabMismatchError("the syncode backend needs a tokenizer with an EOS token")
    base_parser = _lalr_parser(grammar, lark_text, mods)
    if key.lexing != "basic":
        dynamic = _build_dynamic(grammar, lark_text, tokenizer, key, base_parser, mods,
                                 started, force=key.lexing == "dynamic")
        if dynamic is not None:
            return dynamic
    store_module = mods["syncode.mask_store.mask_store"]
    unlabelled = store_module.tqdm
    # SynCode's mask-store build (seconds to minutes at 50k+ tokens) shows an unlabelled bar:
    # name what is being built while it runs
    store_module.tqdm = functools.partial(
        unlabelled, desc=f"SynCode mask store for grammar {grammar.name!r} "
                         f"({len(vocab)} tokens)", unit="DFA state")
    try:
        store = store_module.MaskStore(
            base_parser.terminals, tokenizer, simplifications={}, indent=False,
            mode=MASK_STORE_MODE, ignore_terminals=base_parser.ignore_tokens,
            parse_table=base_parser.parser.parser._parse_table)
    except Exception as exc:  # interegular cannot build a DFA (lookarounds, backrefs, ...)
        raise UnsupportedGrammarError(f"SynCode cannot build terminal DFAs: {exc}",
                                      grammar_name=grammar.name,
                                      line=_line_of_terminal(lark_text, str(exc))) from exc
    finally:
        store_module.tqdm = unlabelled
    tables = GrammarTables.build(base_parser, store._fsms)
    byte_tok = store.byte_tokenizer
    token_bytes = [byte_tok.vocab_byte.get(i, b"") for i in range(len(vocab))]
    eos = tokenizer.eos_token_id
    special = _special_ids(tokenizer)
    inside, spans = _token_tables(tables, token_bytes, special | {eos})
    _make_lookups_read_only(store)
    utf8_clean = np.array([utf8_prefix_ok(b) for b in token_bytes], dtype=np.bool_)
    pool = np.zeros(len(token_bytes), dtype=np.bool_)
    for mask in spans.values():
        pool |= mask
    span_filter = SpanFilter(tables, token_bytes, pool, inside)
    utf8_continuations = Utf8Continuations(token_bytes)
    return CompiledGrammar(key=key, lark_text=lark_text, tables=tables, mask_store=store,
                           token_bytes=token_bytes, special_ids=special, utf8_clean=utf8_clean,
                           tab_tokens=np.array([b"\t" in b for b in token_bytes], dtype=np.bool_),
                           inside_lexeme=inside, span_candidates=spans,
                           state_codes=_state_codes(tables),
                           ignore_whitespace=store._ignore_whitespace,
                           compile_seconds=time.perf_counter() - started,
                           span_filter=span_filter, utf8_continuations=utf8_continuations)


def _build_dynamic(grammar: Grammar, lark_text: str, tokenizer, key: CacheKey, base_parser,
                   mods, started: float, force: bool) -> CompiledGrammar | None:
    """The dynamic-lexing compilation, or None when ``auto`` finds the basic lexer exact."""
    from .dynamic_lexing import DynamicTables, basic_lexer_is_exact

    try:
        fsm_set = mods["syncode.mask_store.fsm_set"].FSMSet(base_parser.terminals, {})
    except Exception as exc:  # interegular cannot build a DFA (lookarounds, backrefs, ...)
        raise UnsupportedGrammarError(f"SynCode cannot build terminal DFAs: {exc}",
                                      grammar_name=grammar.name,
                                      line=_line_of_terminal(lark_text, str(exc))) from exc
    tables = GrammarTables.build(base_parser, fsm_set)
    if not force and basic_lexer_is_exact(tables):
        return None
    vocab = tokenizer.get_vocab()
    byte_tok = mods["syncode.mask_store.byte_tokenizer"].ByteTokenizer(tokenizer)
    token_bytes = [byte_tok.vocab_byte.get(i, b"") for i in range(len(vocab))]
    eos = tokenizer.eos_token_id
    special = _special_ids(tokenizer)
    utf8_clean = np.array([utf8_prefix_ok(b) for b in token_bytes], dtype=np.bool_)
    dynamic = DynamicTables(tables, token_bytes, special | {eos})
    utf8_continuations = Utf8Continuations(token_bytes)
    return CompiledGrammar(
        key=key, lark_text=lark_text, tables=tables, mask_store=None, token_bytes=token_bytes,
        special_ids=special, utf8_clean=utf8_clean,
        tab_tokens=np.zeros(len(token_bytes), dtype=np.bool_), inside_lexeme={},
        span_candidates={}, state_codes=_state_codes(tables), ignore_whitespace=False,
        compile_seconds=time.perf_counter() - started, lexing="dynamic",
        dynamic=dynamic, utf8_continuations=utf8_continuations)


def _special_ids(tokenizer) -> frozenset[int]:
    """Ids never allowed in output: the named special tokens and every added token flagged
    special (Qwen2.5 names only <|im_end|>, yet flags 21 more; SynCode's byte table spells
    them as their text, which fits inside a JSON string), EOS excepted."""
    ids = {int(i) for i in tokenizer.all_special_ids}
    ids |= {int(i) for i, added in getattr(tokenizer, "added_tokens_decoder", {}).items()
            if getattr(added, "special", False)}
    return frozenset(ids - {tokenizer.eos_token_id})


def _lalr_parser(grammar: Grammar, lark_text: str, mods):
    """SynCode's LALR parser (basic lexer), with Lark's errors turned into GrammarError."""
    exceptions = mods["syncode.larkm.exceptions"]
    try:
        parser = mods["syncode.parsers"].create_base_parser(SimpleNamespace(ebnf=lark_text))
    except exceptions.UnexpectedInput as exc:
        raise GrammarError(f"syntax error in grammar: {_first_line(exc)}",
                           grammar_name=grammar.name, line=getattr(exc, "line", None),
                           column=getattr(exc, "column", None)) from exc
    except exceptions.LarkError as exc:
        message = str(exc)
        raise GrammarError(message.strip(), grammar_name=grammar.name,
                           line=_line_in_message(message) or _line_of_terminal(lark_text, message)
                           ) from exc
    return parser


def _token_tables(tables: GrammarTables, token_bytes: list[bytes], skip: frozenset[int]
                  ) -> tuple[dict[tuple[str, object], np.ndarray],
                             dict[tuple[str, object], np.ndarray]]:
    """Per (terminal, DFA state), two token sets SynCode's grammar_strict store gets wrong.

    ``inside``: tokens that keep the DFA alive to their end. SynCode files a token under "stays
    inside the terminal" only if ``consume_prefix`` (longest *accepted* prefix) leaves nothing,
    so from a final state a token ending in a live, non-final state counts as "finished +
    leftover" and is blocked: after JSON ``-48`` the token ``.`` is forbidden though
    ``-48.5`` is valid. These are added wherever the terminal is acceptable.

    ``spans``: tokens that can finish the lexeme (the DFA is final after some prefix) and whose
    rest lexes into further lexemes, possibly ending in a live prefix. SynCode only allows a
    token to reach into ONE next terminal (and none from an unfinished lexeme), so bv4's
    ``))`` or ``) (bvnot`` are never allowed. These are candidates that the masker verifies
    one by one with the parser (:meth:`FrontierParser.would_accept`).
    """
    ids = [i for i, b in enumerate(token_bytes) if b and i not in skip]
    lexable: dict[bytes, bool] = {}
    inside: dict[tuple[str, object], np.ndarray] = {}
    spans: dict[tuple[str, object], np.ndarray] = {}
    for name, fsm in tables.fsms.items():
        live, finals = tables.live_states[name], fsm.finals
        for state in fsm.transitions:
            if state not in live:
                continue
            in_mask = np.zeros(len(token_bytes), dtype=np.bool_)
            span_mask = np.zeros(len(token_bytes), dtype=np.bool_)
            for i in ids:
                data = token_bytes[i]
                cur = state
                cut_points = [0] if cur in finals else []
                for k, byte in enumerate(data):
                    cur = fsm.get_next_state(cur, byte)
                    if cur is None:
                        break
                    if cur in finals and k + 1 < len(data):
                        cut_points.append(k + 1)
                if cur is not None and cur in live:
                    in_mask[i] = True
                for k in cut_points:
                    rest = data[k:]
                    if rest not in lexable:
                        lexable[rest] = _lexes(tables, rest)
                    if lexable[rest]:
                        span_mask[i] = True
                        break
            if in_mask.any():
                inside[(name, state)] = in_mask
            if span_mask.any():
                spans[(name, state)] = span_mask
    return inside, spans


def _lexes(tables: GrammarTables, data: bytes) -> bool:
    """Whether ``data`` lexes into lexemes followed by a (possibly empty) live prefix."""
    from .frontier_parser import LexerState, UnexpectedCharacters

    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    state = LexerState(text)
    try:
        while state.line_ctr.char_pos < len(text):
            tables.lexer.next_token(state)
    except UnexpectedCharacters:
        rest = text[state.line_ctr.char_pos:].encode("utf-8")
        return bool(tables.advance_map(tables.initial_map(), rest)[0])
    except EOFError:
        pass
    return True


def _make_lookups_read_only(store) -> None:
    """Missing lookups read as "no tokens" instead of inserting into (or failing on) the
    shared dicts."""
    table = store._lookup_table
    default = table._get_default_mask()

    class _EmptyList(dict):
        def __missing__(self, key):
            return []

    class _EmptyMask(dict):
        def __missing__(self, key):
            return default

    table._fsm_state_and_next_terminal_to_tokens = _EmptyList(
        table._fsm_state_and_next_terminal_to_tokens)
    table._exact_lookup = _EmptyMask(table._exact_lookup)
    table._overapprox_lookup = _EmptyMask(table._overapprox_lookup)


def _state_codes(tables: GrammarTables) -> dict[str, dict[object, int]]:
    """DFA states as ints: interegular's int ids as they are; SynCode's string ids for
    mid-UTF-8-character states numbered after them."""
    codes: dict[str, dict[object, int]] = {}
    for name, fsm in tables.fsms.items():
        ints = [s for s in fsm.transitions if isinstance(s, int)]
        nxt = (max(ints) + 1) if ints else 0
        mapping: dict[object, int] = {}
        for state in fsm.transitions:
            if isinstance(state, int):
                mapping[state] = state
            else:
                mapping[state] = nxt
                nxt += 1
        codes[name] = mapping
    return codes


def _first_line(exc: Exception) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def _line_in_message(message: str) -> int | None:
    match = re.search(r"line (\d+)", message)
    return int(match.group(1)) if match else None


def _line_of_terminal(text: str, message: str) -> int | None:
    """The first grammar line mentioning a name quoted in ``message`` (Lark often omits lines)."""
    for name in re.findall(r"'([A-Za-z_][A-Za-z_0-9]*)'", message):
        pattern = re.compile(rf"(?<![A-Za-z_0-9]){re.escape(name)}(?![A-Za-z_0-9])")
        for number, line in enumerate(text.splitlines(), start=1):
            if pattern.search(line):
                return number
    return None
