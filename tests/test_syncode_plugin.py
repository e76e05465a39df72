"""The SynCode backend plugin (plugins/shim-syncode) against real tokenizers and grammars.

Tokenizers are small byte-level BPEs trained here on text of each built-in grammar's language
(real `tokenizers` models, so tokens span terminals the way an LM's tokens do).
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from importlib.metadata import entry_points

import numpy as np
import pytest

from shim_adapters.backends.registry import get_backend
from shim_adapters.errors import ForbiddenTokenError, GrammarError, UnsupportedGrammarError
from shim_adapters.grammars.grammar import Grammar, builtin_grammar
from shim_adapters.grammars.reference import reference_acceptor
from shim_adapters.mask.protocol import FEATURE_NAMES, FeatureStatus
from shim_adapters.mask.tokenizer_identity import TokenizerIdentity

pytest.importorskip("shim_syncode")


# ---- real test tokenizers -----------------------------------------------------------------
def _bv4_texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)

    def expr(depth: int) -> str:
        r = rng.random()
        if depth > 3 or r < 0.3:
            return rng.choice(["s", "t", "#x0", "#x8", "#x7"])
        if r < 0.5:
            return f"({rng.choice(['bvneg', 'bvnot'])} {expr(depth + 1)})"
        op = rng.choice(["bvadd", "bvsub", "bvand", "bvlshr", "bvor", "bvshl"])
        return f"({op} {expr(depth + 1)} {expr(depth + 1)})"

    head = "(define-fun inv ((s (BitVec 4)) (t (BitVec 4))) (BitVec 4) "
    return [head + expr(0) + ")" for _ in range(n)]


def _json_texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)

    def value(depth: int):
        r = rng.random()
        if depth > 2 or r < 0.3:
            return rng.choice([1, -48.5, "ab", "x y", True, False, None, 12, "q\u00e9"])
        if r < 0.6:
            return [value(depth + 1) for _ in range(rng.randint(0, 3))]
        return {rng.choice("abcxyz"): value(depth + 1) for _ in range(rng.randint(0, 3))}

    return [json.dumps(value(0), indent=rng.choice([None, 1]), ensure_ascii=False)
            for _ in range(n)]


def _sql_texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    where = ["", " WHERE age > 3", " WHERE x = 'a' AND y <= 2"]
    return [f"SELECT {rng.choice(['*', 'name', 'COUNT(*)', 'a, b'])} FROM "
            f"{rng.choice(['users', 't_x'])}{rng.choice(where)}"
            f"{rng.choice(['', ' ORDER BY a DESC'])}{rng.choice(['', ' LIMIT 5'])};"
            for _ in range(n)]


def _binary_texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice("01") for _ in range(5)) for _ in range(n)]


def _train_tokenizer(texts: list[str], vocab_size: int, extra_specials=()):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size,
                                  special_tokens=["<|endoftext|>", *extra_specials],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    kwargs = {"pad_token": extra_specials[0]} if extra_specials else {}
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   bos_token="<|endoftext|>", **kwargs)


_TEXTS = {"bv4": _bv4_texts, "json": _json_texts, "sql": _sql_texts, "binary5": _binary_texts}


@pytest.fixture(scope="module")
def tokenizers():
    return {name: _train_tokenizer(make(1500), 400 if name != "binary5" else 270,
                                   extra_specials=("<pad>",) if name == "json" else ())
            for name, make in _TEXTS.items()}


@pytest.fixture(scope="module")
def backend():
    return get_backend("syncode")


def _masker(backend, tokenizers, name, pad=0):
    tok = tokenizers[name]
    return backend.compile(builtin_grammar(name), tok, vocab_size=len(tok) + pad)


def _advance_text(state, tokenizer, text: str) -> None:
    for token_id in tokenizer(text)["input_ids"]:
        state.advance(token_id)


def _char_ids(tokenizer, text: str) -> list[int]:
    """One token per character (byte-level single-character tokens)."""
    from tokenizers.pre_tokenizers import ByteLevel  # noqa: F401

    ids = []
    for ch in text:
        (token,) = tokenizer.convert_ids_to_tokens(tokenizer(ch)["input_ids"])
        ids.append(tokenizer.convert_tokens_to_ids(token))
    return ids


def _greedy_ids(masker, target: str) -> list[int]:
    """Token ids writing ``target``, each the longest allowed token that continues it."""
    by_bytes = {b: i for i, b in enumerate(masker.compiled.token_bytes) if b}
    state, ids, data, pos = masker.new_state(), [], target.encode(), 0
    while pos < len(data):
        mask = state.allowed_mask()
        size = max(n for n in range(1, 17) if by_bytes.get(data[pos:pos + n]) is not None
                   and mask[by_bytes[data[pos:pos + n]]])
        ids.append(by_bytes[data[pos:pos + size]])
        state.advance(ids[-1])
        pos += size
    return ids


# ---- registration -------------------------------------------------------------------------
def test_registered_through_entry_point(backend):
    names = {ep.name: ep.value for ep in entry_points(group="shim_adapters")}
    assert names.get("syncode") == "shim_syncode.plugin"
    assert backend.name == "syncode"
    assert backend.version == "0.4.16"
    assert "lark" in backend.grammar_formats
    assert set(backend.feature_status) == set(FEATURE_NAMES)
    assert all(status is FeatureStatus.EXACT for status in backend.feature_status.values())


# ---- soundness on random walks --------------------------------------------------------------
@pytest.mark.parametrize("name", ["bv4", "binary5", "json", "sql"])
def test_random_walks_stay_in_the_language(backend, tokenizers, name):
    """Every completed walk parses with the reference; EOS is offered exactly when it does;
    no walk reaches a state with nothing allowed."""
    masker = _masker(backend, tokenizers, name, pad=13)
    ref = reference_acceptor(builtin_grammar(name))
    tok = tokenizers[name]
    rng = random.Random(7)
    finished = 0
    for _ in range(12):
        state = masker.new_state()
        for _ in range(80):
            mask = state.allowed_mask()
            assert mask.shape == (len(tok) + 13,)
            assert not mask[len(tok):].any()
            text = state.text()
            assert state.eos_allowed() == ref.accepts(text), (text, state.describe())
            assert mask[tok.eos_token_id] == state.eos_allowed()
            allowed = np.flatnonzero(mask)
            assert len(allowed) > 0, f"dead end: {state.describe()}"
            if state.eos_allowed() and rng.random() < 0.5:
                choice = tok.eos_token_id
            else:
                choice = int(rng.choice(allowed))
            state.advance(choice)
            if state.is_finished:
                finished += 1
                assert ref.accepts(state.text()), state.text()
                assert not state.allowed_mask().any()
                break
    assert finished >= 6


# ---- protocol details -----------------------------------------------------------------------
def test_forbidden_token_error_names_token_step_and_state(backend, tokenizers):
    tok = tokenizers["bv4"]
    masker = _masker(backend, tokenizers, "bv4", pad=5)
    state = masker.new_state()
    state.advance(_char_ids(tok, "(")[0])
    bad = _char_ids(tok, ")")[0]
    assert not state.allowed_mask()[bad]
    with pytest.raises(ForbiddenTokenError) as info:
        state.advance(bad)
    message = str(info.value)
    assert info.value.token_id == bad and info.value.step == 1
    assert "')'" in message and "step 1" in message
    assert "parser_state=" in message and "partial_lexeme='('" in message
    assert state.token_ids == (_char_ids(tok, "(")[0],)  # nothing was accepted
    with pytest.raises(ForbiddenTokenError, match="padding id"):
        state.advance(len(tok) + 2)


def test_eos_and_finish(backend, tokenizers):
    tok = tokenizers["binary5"]
    masker = _masker(backend, tokenizers, "binary5")
    state = masker.new_state()
    for i, token_id in enumerate(_char_ids(tok, "10111")):
        assert not state.eos_allowed()
        assert not state.allowed_mask()[tok.eos_token_id]
        state.advance(token_id)
    assert state.eos_allowed() and state.allowed_mask()[tok.eos_token_id]
    assert not state.allowed_mask()[_char_ids(tok, "1")[0]]  # the string is complete
    state.advance(tok.eos_token_id)
    assert state.is_finished and state.token_ids[-1] == tok.eos_token_id
    assert state.text() == "10111"
    assert not state.allowed_mask().any() and not state.eos_allowed()
    with pytest.raises(ForbiddenTokenError):
        state.advance(tok.eos_token_id)


def test_fork_is_independent(backend, tokenizers):
    tok = tokenizers["json"]
    masker = _masker(backend, tokenizers, "json")
    state = masker.new_state()
    for token_id in _char_ids(tok, '[1, "a'):
        state.advance(token_id)
    twin = state.fork()
    before = (state.token_ids, state.allowed_mask(), state.features())
    for token_id in _char_ids(tok, 'b"]'):
        twin.advance(token_id)
    assert (state.token_ids, state.features()) == (before[0], before[2])
    assert np.array_equal(state.allowed_mask(), before[1])
    for token_id in _char_ids(tok, '", 2]'):
        state.advance(token_id)
    assert twin.text() == '[1, "ab"]' and twin.eos_allowed()
    assert state.text() == '[1, "a", 2]' and state.eos_allowed()


def test_special_tokens_other_than_eos_never_allowed(backend, tokenizers):
    tok = tokenizers["json"]
    pad = tok.pad_token_id
    masker = _masker(backend, tokenizers, "json")
    state = masker.new_state()
    for token_id in _char_ids(tok, '"x'):  # inside a string "<pad>" would fit the grammar
        state.advance(token_id)
        assert not state.allowed_mask()[pad]
    assert state.allowed_mask()[_char_ids(tok, "<")[0]]


def test_added_tokens_flagged_special_are_never_allowed_even_when_unnamed(backend):
    """Found by the conformance full matrix (qwen2.5 x json): Qwen2.5's tokenizer names only
    <|im_end|> among its special ids, but flags 21 more added tokens special (<|endoftext|>,
    <|im_start|>, <tool_call>...); SynCode read them as their text inside JSON strings."""
    tok = _train_tokenizer(_json_texts(1500), 400, extra_specials=("<pad>", "<|tool|>"))
    tool = tok.convert_tokens_to_ids("<|tool|>")
    assert tool not in tok.all_special_ids and tok.added_tokens_decoder[tool].special
    state = backend.compile(builtin_grammar("json"), tok, vocab_size=len(tok)).new_state()
    for token_id in _char_ids(tok, '"x'):  # inside a string "<|tool|>" would fit the grammar
        state.advance(token_id)
        assert not state.allowed_mask()[tool]


def test_token_ending_mid_lexeme_after_a_final_state(backend, tokenizers):
    """SynCode's grammar_strict store forbids `.` after JSON `-48`; the plugin allows it."""
    tok = tokenizers["json"]
    masker = _masker(backend, tokenizers, "json")
    state = masker.new_state()
    for token_id in _char_ids(tok, "[-48"):
        state.advance(token_id)
    for token_id in _char_ids(tok, ".5]"):
        assert state.allowed_mask()[token_id]
        state.advance(token_id)
    assert state.eos_allowed()


def test_no_tab_or_broken_utf8_inside_json_strings(backend, tokenizers):
    """SynCode's store checks tokens with tabs read as four spaces, and its byte DFAs pass any
    unknown byte; a JSON string admits neither a raw tab nor a stray 0xF5 byte."""
    tok = tokenizers["json"]
    masker = _masker(backend, tokenizers, "json")
    state = masker.new_state()
    for token_id in _char_ids(tok, '["a'):
        state.advance(token_id)
    tab = _char_ids(tok, "\t")[0]
    stray = tok.convert_tokens_to_ids("\u00f5")  # byte-level symbol of the byte 0xF5
    store_mask = masker.compiled.mask_store.get_accept_mask(state._parser.result).numpy()
    assert store_mask[tab] and store_mask[stray]  # SynCode 0.4.16's own lookup allows both
    mask = state.allowed_mask()
    assert not mask[tab] and not mask[stray]
    assert mask[_char_ids(tok, " ")[0]]


def test_features_match_syncode_incremental_parser(backend, tokenizers):
    """parser_state, lexer_state and partial_lexeme equal what SynCode's own IncrementalParser
    and MaskStore.get_fsm_states give for the same text (where SynCode's remainder is valid)."""
    from shim_syncode._syncode_import import syncode_modules

    mods = syncode_modules()
    tok = tokenizers["json"]
    masker = _masker(backend, tokenizers, "json")
    compiled = masker.compiled
    codes = compiled.state_codes
    from shim_syncode.frontier_parser import canonical_state_numbers

    base = mods["syncode.parsers"].create_base_parser(type("G", (), {"ebnf": compiled.lark_text}))
    theirs = mods["syncode.parsers.incremental_parser"].IncrementalParser(base)
    table = base.parser.parser._parse_table
    names = canonical_state_numbers(table.states, table.start_states["start"])
    target = "[" + ", ".join(_json_texts(8, seed=5)) + "]"
    state = masker.new_state()
    compared = 0
    for token_id in _greedy_ids(masker, target) + [None]:
        result = theirs.get_acceptable_next_terminals(state.text())
        result.remainder = result.remainder.encode()
        if compiled.mask_store.is_valid_prefix(result):
            feats = state.features()
            stack = theirs.interactive.parser_state.state_stack
            assert feats.parser_state == tuple(str(names[s]) for s in reversed(stack))
            assert feats.partial_lexeme == result.remainder.decode()
            live = {(s.terminal, codes[s.terminal][s.state_id])
                    for s in compiled.mask_store.get_fsm_states(result)
                    if s.state_id in compiled.tables.live_states[s.terminal]}
            assert feats.lexer_state == frozenset(live)
            compared += 1
        if token_id is not None:
            state.advance(token_id)
    assert compared >= 20


# ---- the pitfalls of docs/design.md ------------------------------------------------------
def test_cache_key_distinguishes_tokenizers_of_same_class_and_size(backend, tmp_path,
                                                                 monkeypatch):
    from shim_syncode.compiled import cache_key

    a = _train_tokenizer(_json_texts(800, seed=1), 300)
    b = _train_tokenizer(_sql_texts(800, seed=1), 300)
    assert type(a) is type(b) and a.vocab_size == b.vocab_size == len(a) == len(b)
    grammar = builtin_grammar("json")
    # SynCode's own cache file name: same for both tokenizers (its collision).
    syncode_name = [f"{type(t).__name__}/grammar_strict_{t.vocab_size}" for t in (a, b)]
    assert syncode_name[0] == syncode_name[1]
    assert cache_key(grammar, a) != cache_key(grammar, b)
    assert cache_key(grammar, a).tokenizer_sha256 == TokenizerIdentity.of(a).sha256
    monkeypatch.chdir(tmp_path)
    masker_a, masker_b = backend.compile(grammar, a), backend.compile(grammar, b)
    assert masker_a.compiled is not masker_b.compiled
    assert backend.compile(grammar, a).compiled is masker_a.compiled  # cache hit
    assert list(tmp_path.iterdir()) == []  # SynCode's on-disk cache/ is never written
    allowed = [[t.convert_ids_to_tokens(int(i))
                for i in np.flatnonzero(m.new_state().allowed_mask())]
               for t, m in ((a, masker_a), (b, masker_b))]
    assert allowed[0] != allowed[1]


def test_importing_the_plugin_leaves_root_logging_alone():
    code = (
        "import logging, sys\n"
        "root = logging.getLogger()\n"
        "h = logging.StreamHandler(sys.stderr)\n"
        "root.addHandler(h); root.setLevel(logging.ERROR)\n"
        "before = (list(root.handlers), root.level)\n"
        "import shim_syncode.masker\n"
        "assert 'syncode' in sys.modules\n"
        "after = (list(root.handlers), root.level)\n"
        "print(before == after, after[1], len(after[0]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", str(40), "1"]


def test_grammar_mask_mode_is_refused(backend, tokenizers):
    with pytest.raises(ValueError, match="grammar_mask"):
        backend.compile(builtin_grammar("binary5"), tokenizers["binary5"], mode="grammar_mask")


# ---- grammar errors and formats ---------------------------------------------------------------
def test_malformed_grammar_names_the_line(backend, tokenizers):
    bad = Grammar('start: item+\nitem: "a" | "b"\nitem2: ("c" \n', "lark", name="bad.lark")
    with pytest.raises(GrammarError) as info:
        backend.compile(bad, tokenizers["binary5"])
    assert info.value.line in (3, 4) and "bad.lark, line" in str(info.value)
    undefined = Grammar('start: item\n\nitem: "a" other\n', "lark", name="undef.lark")
    with pytest.raises(GrammarError) as info:
        backend.compile(undefined, tokenizers["binary5"])
    assert info.value.line == 3


@pytest.mark.parametrize("fmt,text", [("json_schema", '{"type": "string"}'), ("regex", "a+")])
def test_non_cfg_formats_are_refused(backend, tokenizers, fmt, text):
    with pytest.raises(UnsupportedGrammarError, match="syncode backend"):
        backend.compile(Grammar(text, fmt), tokenizers["binary5"])


def test_ebnf_is_converted_or_refused_clearly(backend, tokenizers):
    ebnf = Grammar('root ::= "1" "0"*\n', "ebnf", name="tiny.ebnf")
    try:
        from shim_adapters.grammars.convert import ebnf_to_lark  # noqa: F401
    except ImportError:
        with pytest.raises(UnsupportedGrammarError, match="ebnf_to_lark"):
            backend.compile(ebnf, tokenizers["binary5"])
    else:
        state = backend.compile(ebnf, tokenizers["binary5"]).new_state()
        state.advance(_char_ids(tokenizers["binary5"], "1")[0])
        assert state.eos_allowed()


# ---- tokens spanning several terminals ------------------------------------------------------
def test_tokens_spanning_three_terminals_are_allowed(backend, tokenizers):
    """SynCode 0.4.16's grammar_strict store lets a token reach into at most ONE next terminal
    (none from an unfinished lexeme): bv4 ``))`` after ``(bvnot s`` is masked there although
    the text parses. The plugin verifies such tokens with the parser and allows them.
    (bv4's ``(`` overlaps ``(define-fun``, so ``lexing='auto'`` picks dynamic lexing, which
    does not use SynCode's store: this test pins the basic path.)"""
    tok = tokenizers["bv4"]
    masker = backend.compile(builtin_grammar("bv4"), tok, vocab_size=len(tok), lexing="basic")
    assert masker.compiled.lexing == "basic"
    prefix = "(define-fun inv ((s (BitVec 4)) (t (BitVec 4))) (BitVec 4) (bvneg (bvnot s"
    assert reference_acceptor(builtin_grammar("bv4")).accepts(prefix + ")))")
    state = masker.new_state()
    for token_id in _char_ids(tok, prefix):
        state.advance(token_id)
    double = tok.convert_tokens_to_ids("))")
    assert double is not None and double != tok.unk_token_id
    store_mask = masker.compiled.mask_store.get_accept_mask(state._parser.result).numpy()
    assert not store_mask[double]  # SynCode's own lookup: blocked
    mask = state.allowed_mask()
    assert mask[double]
    state.advance(double)
    assert not mask[tok.convert_tokens_to_ids(")")] or state.allowed_mask()[
        tok.convert_tokens_to_ids(")")]
    state.advance(tok.convert_tokens_to_ids(")"))
    assert state.eos_allowed()


@pytest.mark.parametrize("name", ["bv4", "json", "sql"])
def test_canonical_tokenizations_are_allowed(backend, tokenizers, name):
    """An LM's own tokenization of valid text is never blocked (tokens span terminals)."""
    tok = tokenizers[name]
    masker = _masker(backend, tokenizers, name)
    ref = reference_acceptor(builtin_grammar(name))
    for text in _TEXTS[name](15, seed=11):
        assert ref.accepts(text)
        state = masker.new_state()
        for token_id in tok(text)["input_ids"]:
            assert state.allowed_mask()[token_id], (tok.convert_ids_to_tokens(token_id),
                                                    state.describe())
            state.advance(token_id)
        assert state.eos_allowed(), state.describe()


# ---- Spider: overlapping terminals need Earley-style (dynamic) lexing --------------------------
SPIDER_GRAMMAR = "spider/grammar.lark"  # under --benchmark-data (see conftest.py)

#: LM outputs the masker refused while the reference accepts them (basic lexing reads
#: ``COUNT(`` as CNAME + "(" and so never as the AGGREGATION terminal), plus texts where
#: Earley's per-terminal longest match differs from a basic lexer's single tokenisation.
SPIDER_VALID = (
    " SELECT COUNT(Singer_ID) FROM concert",
    " SELECT count(Singer_Id_Music) FROM concert_singer Dan_nife",
    " SELECT count(singer_id) FROM concert_song_name",
    " SELECT COUNT(*), song_name, song_release_num FROM concert",
    " SELECT COUNT(Singer_ID) FROM stadium",
    " SELECT sum(   a) FROM t",
    "SELECTION FROM t",  # SELECT + ION
    "SELECT a FROMt",  # FROM + t
    "SELECT COUNT(DISTINCTx) FROM t",  # AGGREGATION "COUNT(DISTINCT" + x
    "SELECT CAST(a AS int) FROM t",
    "SELECT DISTINCT a FROM t LEFT  JOIN u ON a = b",
    "select Name, avg(age) from singer where country = 'France' group by name;",
    "SELECT a FROM t -- trailing comment",
    "SELECT T1.name FROM stadium AS T1 JOIN concert AS T2 ON T1.id = T2.sid "
    "ORDER BY T1.capacity DESC LIMIT 3",
)
#: Texts the reference rejects only because each terminal takes its longest match.
SPIDER_INVALID = (
    "SELECT COUNT(DISTINCT) FROM t",  # AGGREGATION must take "COUNT(DISTINCT"
    "SELECT CAST(a AS integerx) FROM t",  # TYPENAME must take "integer"
    "SELECT count (a) FROM t",
    "SELECT a FROM",
)


@pytest.fixture(scope="module")
def spider(benchmark_data):
    from shim_adapters.lm.loading import load_lm

    path = benchmark_data / SPIDER_GRAMMAR
    assert path.is_file(), f"{path}: the Spider grammar is missing from the benchmark data"
    grammar = Grammar(text=path.read_text(), format="lark", name="spider")
    tok = load_lm(None).tokenizer
    masker = get_backend("syncode").compile(grammar, tok, vocab_size=len(tok) + 7)
    return grammar, tok, masker


def _accepts_tokens(masker, tok, text: str) -> bool:
    state = masker.new_state()
    for token_id in tok(text, add_special_tokens=False)["input_ids"]:
        if not state.allowed_mask()[token_id]:
            return False
        state.advance(token_id)
    return state.eos_allowed() and bool(state.allowed_mask()[tok.eos_token_id])


def _assert_mask_matches_advance(masker, state) -> int:
    """Every token: allowed by the mask exactly when a fork can advance over it."""
    mask = state.allowed_mask()
    compiled = masker.compiled
    checked = 0
    for token_id, data in enumerate(compiled.token_bytes):
        if (not data or token_id in compiled.special_ids or token_id == masker.tokenizer.eos_token_id
                or not compiled.utf8_clean[token_id] or state._parser.pending_bytes):
            continue
        other = state.fork()
        try:
            other.advance(token_id)
            advanced = True
        except ForbiddenTokenError:
            advanced = False
        assert advanced == bool(mask[token_id]), (masker.token_text(token_id), state.describe())
        assert bool(mask[token_id]) == state._parser.would_accept(data)
        checked += 1
    return checked


@pytest.mark.benchmark_data
def test_spider_picks_dynamic_lexing(spider):
    _, _, masker = spider
    assert masker.compiled.lexing == "dynamic"
    assert masker.compiled.mask_store is None


@pytest.mark.benchmark_data
@pytest.mark.parametrize("text", SPIDER_VALID)
def test_spider_reference_valid_outputs_are_accepted(spider, text):
    grammar, tok, masker = spider
    assert reference_acceptor(grammar).accepts(text)
    assert _accepts_tokens(masker, tok, text), text


@pytest.mark.benchmark_data
@pytest.mark.parametrize("text", SPIDER_INVALID)
def test_spider_reference_invalid_outputs_are_refused(spider, text):
    grammar, tok, masker = spider
    assert not reference_acceptor(grammar).accepts(text)
    assert not _accepts_tokens(masker, tok, text), text


@pytest.mark.parametrize("prefix", [" SELECT sum(", " SELECT COUNT(", " SELECT a FROM t",
                                    "SELECT COUNT(DIS", " SELECT a FROM t LEFT ", ""])
@pytest.mark.benchmark_data
def test_spider_mask_and_advance_agree(spider, prefix):
    """The mask allows a token exactly when advance() takes it (after ' SELECT sum(' the
    basic path allowed three spaces that advance() then rejected)."""
    _, tok, masker = spider
    state = masker.new_state()
    for token_id in tok(prefix, add_special_tokens=False)["input_ids"]:
        state.advance(token_id)
    assert _assert_mask_matches_advance(masker, state) > 500


@pytest.mark.benchmark_data
def test_spider_random_walks_are_sound(spider):
    """Walks over allowed tokens: EOS only where the reference accepts; never stuck."""
    grammar, tok, masker = spider
    ref = reference_acceptor(grammar)
    rng = random.Random(3)
    finished = 0
    for _ in range(40):
        state = masker.new_state()
        for step in range(30):
            mask = state.allowed_mask()
            allowed = np.flatnonzero(mask)
            assert len(allowed), state.describe()
            if mask[tok.eos_token_id] and (step > 12 or rng.random() < 0.3):
                assert ref.accepts(state.text()), state.text()
                finished += 1
                break
            short = [int(a) for a in allowed if a != tok.eos_token_id
                     and len(masker.compiled.token_bytes[a]) <= 3]
            state.advance(rng.choice(short) if short and rng.random() < 0.8
                          else int(rng.choice(allowed)))
            if state.is_finished:
                assert ref.accepts(state.text()), state.text()
                finished += 1
                break
    assert finished >= 5


@pytest.mark.slow
@pytest.mark.benchmark_data
def test_spider_smollm2_outputs_are_accepted(benchmark_data):
    """The reported refusals with SmolLM2's own tokenizer (49k tokens: ~30 s to load and
    compile, so only with -m slow), and three spaces after ' SELECT sum(' (token 333), which
    the basic path allowed and then rejected in advance()."""
    from shim_adapters.lm.loading import load_lm

    grammar = Grammar(text=(benchmark_data / SPIDER_GRAMMAR).read_text(), format="lark",
                      name="spider")
    lm = load_lm("smollm2")
    tok = lm.tokenizer
    masker = get_backend("syncode").compile(grammar, tok, vocab_size=lm.vocab_size)
    for text in SPIDER_VALID[:6]:
        assert _accepts_tokens(masker, tok, text), text
    for text in SPIDER_INVALID:
        assert not _accepts_tokens(masker, tok, text), text
    state = masker.new_state()
    for token_id in tok(" SELECT sum(", add_special_tokens=False)["input_ids"]:
        state.advance(token_id)
    three = tok.convert_tokens_to_ids("\u0120\u0120\u0120")
    assert tok.decode([three]) == "   "
    assert state.allowed_mask()[three]
    state.advance(three)
    assert state._parser.would_accept(b"a) FROM t")


def test_mask_store_build_shows_a_labelled_progress_bar(shipped_lm, capsys):
    """SynCode's own bar is unlabelled; ours names the grammar and the vocabulary size, and
    SynCode's module is left as it was."""
    from shim_syncode._syncode_import import syncode_modules
    from shim_syncode.compiled import compile_grammar

    module = syncode_modules()["syncode.mask_store.mask_store"]
    before = module.tqdm
    grammar = Grammar('start: "p" NUM\nNUM: /[0-9]+/\n', "lark", name="progress-probe")
    compile_grammar(grammar, shipped_lm.tokenizer, lexing="basic")
    err = capsys.readouterr().err
    assert f"SynCode mask store for grammar 'progress-probe' ({len(shipped_lm.tokenizer)} " \
           f"tokens)" in err
    assert module.tqdm is before


# ---- the bulk mask equals the per-token reference --------------------------------------------
def _compare_on_walks(masker, walks: int, steps: int, seed: int) -> tuple[int, int, int]:
    """Masked random walks; at every state the bulk mask must equal the per-token reference.
    Returns (states, parser checks that failed in the reference, and in the bulk path)."""
    from shim_syncode import frontier_parser
    from shim_syncode.reference_mask import reference_mask

    checks = {"n": 0}
    original = frontier_parser.FrontierParser.would_accept

    def counting(self, data):
        accepted = original(self, data)
        checks["n"] += not accepted
        return accepted

    rng = np.random.default_rng(seed)
    eos = list(masker.eos_token_ids)
    states = ref_checks = new_checks = 0
    for _ in range(walks):
        state = masker.new_state()
        for _ in range(steps):
            frontier_parser.FrontierParser.would_accept = counting
            try:
                checks["n"] = 0
                expected = reference_mask(state)
                ref_checks += checks["n"]
                checks["n"] = 0
                got = state._compute_mask()
                new_checks += checks["n"]
            finally:
                frontier_parser.FrontierParser.would_accept = original
            differing = np.flatnonzero(got != expected)
            assert not len(differing), (
                f"bulk and per-token masks differ on "
                f"{[masker.compiled.token_bytes[i] for i in differing[:8]]} after "
                f"{state.text()!r}: {state.describe()}")
            states += 1
            expected[eos] = False
            allowed = np.flatnonzero(expected)
            if not len(allowed):
                break
            state.advance(int(rng.choice(allowed)))
    return states, ref_checks, new_checks


@pytest.mark.parametrize("name,lexing", [("json", "auto"), ("sql", "basic"), ("bv4", "basic"),
                                         ("binary5", "auto"), ("sql", "auto"), ("bv4", "auto")])
def test_bulk_mask_equals_per_token_reference(backend, tokenizers, name, lexing):
    """Token for token on every state of many walks, pending UTF-8 states included; with
    basic lexing the span filter must also spare nearly all of the reference's failing parser
    checks (it rules out in bulk what the parser would refuse)."""
    from shim_syncode.masker import compile_masker

    masker = compile_masker(builtin_grammar(name), tokenizers[name],
                            vocab_size=len(tokenizers[name]) + 3, memoize_masks=False,
                            lexing=lexing)
    walks = 5 if name == "json" else 8  # json's per-token reference is the slow part
    states, ref_failed, new_failed = _compare_on_walks(masker, walks=walks, steps=50, seed=3)
    assert states >= 30
    if masker.compiled.lexing == "basic" and name != "binary5":
        assert ref_failed > 100 and new_failed < ref_failed / 10, (ref_failed, new_failed)


@pytest.mark.slow
@pytest.mark.parametrize("name,lexing", [("json", "auto"), ("sql", "basic"), ("bv4", "basic")])
@pytest.mark.parametrize("tokenizer_name", ["gpt2", "mistral-v1"])
def test_bulk_mask_equals_per_token_reference_large_vocab(tokenizer_name, name, lexing):
    """The same with real 50k / 32k tokenizers (GPT-2's byte-level BPE; Mistral's
    SentencePiece with byte fallback, whose byte tokens leave UTF-8 characters pending)."""
    from shim_syncode.masker import compile_masker

    from shim_adapters.mask.tokenizers_offline import load_offline_tokenizer

    tok = load_offline_tokenizer(tokenizer_name)
    masker = compile_masker(builtin_grammar(name), tok, memoize_masks=False, lexing=lexing)
    states, ref_failed, new_failed = _compare_on_walks(masker, walks=6, steps=40, seed=5)
    assert states >= 40
    assert new_failed <= ref_failed


def test_utf8_table_equals_utf8_prefix_ok():
    """After every pending partial character (each lead byte, continuation bytes at the edges
    of their ranges), on tokens made of every byte at every position that matters."""
    from shim_syncode.utf8_table import Utf8Continuations

    from shim_adapters.mask.utf8 import utf8_prefix_ok

    edges = sorted({0x00, 0x41, 0x7F, 0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF, 0xC0, 0xC2, 0xDF,
                    0xE0, 0xED, 0xEF, 0xF0, 0xF4, 0xF5, 0xFF})
    tokens = [b""] + [bytes([b]) for b in range(256)]
    tokens += [bytes([a, b]) for a in edges for b in edges]
    tokens += [bytes([a, b, c]) + tail for a in edges for b in edges for c in (0x80, 0xBF, 0x41)
               for tail in (b"", b"x", b"\xc3\xa9", b"\xc3")]
    table = Utf8Continuations(tokens)
    pendings = [bytes([lead]) for lead in range(0xC2, 0xF5)]
    pendings += [bytes([lead, c]) for lead in (0xE0, 0xE1, 0xED, 0xF0, 0xF1, 0xF4)
                 for c in (0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF)]
    pendings += [bytes([lead, c, 0x80]) for lead in (0xF0, 0xF3, 0xF4) for c in (0x80, 0x90)]
    checked = 0
    for pending in [b""] + pendings:
        if not utf8_prefix_ok(pending):
            assert table.after(pending) is None, pending
            continue
        expected = np.array([utf8_prefix_ok(pending + t) for t in tokens])
        got = table.after(pending)
        assert got is not None and np.array_equal(got, expected), pending
        checked += 1
    assert checked > 40
    assert table.after(b"\x80") is None and table.after(b"\xc3\xa9") is None
