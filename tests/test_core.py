"""The core without any backend library: grammars, references, plugin manager, errors."""

from __future__ import annotations

import pytest

from shim_adapters import FeatureStatus, GrammarError, builtin_grammar, load_grammar
from shim_adapters.backends.hookspecs import hookimpl
from shim_adapters.backends.registry import (
    backends,
    get_backend,
    register_plugin,
    unregister_plugin,
)
from shim_adapters.backends.spec import BackendSpec
from shim_adapters.errors import BackendNotFoundError
from shim_adapters.grammars.grammar import BUILTIN_GRAMMARS, Grammar
from shim_adapters.grammars.reference import reference_acceptor

BV_HEAD = "(define-fun inv ((s (BitVec 4)) (t (BitVec 4))) (BitVec 4) "

VALID = {
    "bv4": [BV_HEAD + "s)", BV_HEAD + "(bvand (bvnot t) #x7))"],
    "binary5": ["00100", "11111"],
    "json": ['{"a": [1, -2.5e3, "x\\n"], "b": null}', "[]", ' {"k" : true} '],
    "sql": ["SELECT * FROM users;",
            "SELECT name, COUNT(*) FROM users WHERE age > 3 AND name = 'bo' ORDER BY name DESC LIMIT 5;"],
}
INVALID = {
    "bv4": [BV_HEAD + "(bvand s))", BV_HEAD + "(bvmul s t))", BV_HEAD + "#x3)"],
    "binary5": ["00000", "1011", "101110"],
    "json": ['{"a": 1,}', "{'a': 1}", '{"a": [1, 2}', "NaN"],
    "sql": ["SELECT FROM users;", "select * from users;", "SELECT * FROM users"],
}


@pytest.mark.parametrize("name", sorted(BUILTIN_GRAMMARS))
def test_builtin_grammars_and_reference(name):
    grammar = builtin_grammar(name)
    assert grammar.format == "lark" and grammar.default_prompt
    acceptor = reference_acceptor(grammar)
    assert all(acceptor.accepts(s) for s in VALID[name])
    assert not any(acceptor.accepts(s) for s in INVALID[name])


def test_grammar_hash_depends_on_text_and_format():
    a = Grammar('start: "a"', "lark")
    assert a.sha256 == Grammar('start: "a"', "lark", name="other").sha256
    assert a.sha256 != Grammar('start: "b"', "lark").sha256
    assert a.sha256 != Grammar('start: "a"', "regex").sha256


def test_bad_grammar_inputs_are_named(tmp_path):
    with pytest.raises(GrammarError, match="no built-in grammar named 'nope'"):
        builtin_grammar("nope")
    with pytest.raises(GrammarError, match="no such file"):
        load_grammar(tmp_path / "missing.lark")
    odd = tmp_path / "g.txt"
    odd.write_text('start: "a"')
    with pytest.raises(GrammarError, match="suffix '.txt'"):
        load_grammar(odd)
    with pytest.raises(GrammarError, match="empty"):
        Grammar("  \n", "lark")
    with pytest.raises(GrammarError, match="unknown grammar format"):
        Grammar('start: "a"', "peg")


def test_malformed_lark_grammar_error_names_the_line(tmp_path):
    path = tmp_path / "broken.lark"
    path.write_text('start: item+\nitem: "a"\n     | ("b"\nother: "(" start\n')
    with pytest.raises(GrammarError) as info:
        reference_acceptor(load_grammar(path))
    assert info.value.line == 3
    assert "broken.lark, line 3" in str(info.value)
    path.write_text('start: item\nitem: "a"\nx: undefined_rule\n')
    with pytest.raises(GrammarError, match="undefined_rule") as info:
        reference_acceptor(load_grammar(path))
    assert info.value.line == 3


class _Plugin:
    def __init__(self, name, status):
        self.name, self.status = name, status

    @hookimpl
    def register_backends(self, register):
        register(BackendSpec(name=self.name, version="0", grammar_formats=("lark",),
                             feature_status=self.status, create_masker=lambda *a, **k: None))


ALL_MISSING = {n: FeatureStatus.MISSING for n in ("parser_state", "lexer_state", "partial_lexeme")}


def test_plugin_registered_directly_is_listed_and_duplicates_refused():
    first, second = _Plugin("dummy-x", ALL_MISSING), _Plugin("dummy-x", ALL_MISSING)
    register_plugin(first)
    try:
        assert get_backend("dummy-x").version == "0"
        register_plugin(second)
        with pytest.raises(ValueError, match="two plugins register a backend named 'dummy-x'"):
            backends()
        unregister_plugin(second)
    finally:
        unregister_plugin(first)
    with pytest.raises(BackendNotFoundError, match="no backend named 'dummy-x'"):
        get_backend("dummy-x")


def test_backend_spec_requires_every_feature_status():
    with pytest.raises(ValueError, match="must declare a status"):
        BackendSpec(name="x", version="0", grammar_formats=(), create_masker=lambda: None,
                    feature_status={"parser_state": FeatureStatus.EXACT})
    with pytest.raises(ValueError, match="unknown features"):
        BackendSpec(name="x", version="0", grammar_formats=(), create_masker=lambda: None,
                    feature_status={**ALL_MISSING, "depth": FeatureStatus.EXACT})


def test_core_imports_no_backend_library():
    import subprocess
    import sys

    code = ("import sys, shim_adapters, shim_adapters.cli, shim_adapters.lm.generation, "
            "shim_adapters.grammars.reference, shim_adapters.backends.registry;"
            "bad=[m for m in ('syncode','xgrammar','outlines','outlines_core','llguidance') "
            "if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
