"""The cross-process compile cache: keyed on everything a compiled grammar depends on, text
entries checked on read, shared between processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from shim_adapters.grammars.grammar import Grammar, builtin_grammar
from shim_adapters.mask.compile_cache import CompileCache, cache_key


def schema(obj) -> Grammar:
    return Grammar(text=json.dumps(obj), format="json_schema", name="s")


BASE = dict(backend="xgrammar", backend_version="0.2.9", tokenizer_sha256="t" * 64,
            vocab_size=1088)


def key(grammar, **changes):
    return cache_key(grammar, **{**BASE, **changes})["sha256"]


def test_key_ignores_keyword_order_and_whitespace_but_not_property_order():
    a = schema({"type": "object", "required": ["x"], "properties": {"x": {}, "y": {}}})
    b = Grammar(text='{"properties": {"x": {}, "y": {}},\n "required": ["x"], "type": "object"}',
                format="json_schema")
    swapped = schema({"type": "object", "required": ["x"], "properties": {"y": {}, "x": {}}})
    assert key(a) == key(b)
    assert key(a) != key(swapped)  # backends emit properties in schema order


def test_key_changes_with_backend_version_tokenizer_width_and_options():
    g = builtin_grammar("sql")
    base = key(g)
    assert len({base, key(g, backend_version="0.3.0"), key(g, tokenizer_sha256="u" * 64),
                key(g, vocab_size=1089), key(g, backend="outlines"),
                cache_key(g, **BASE, options={"stop_token_ids": [1]})["sha256"]}) == 6


def test_corrupt_or_mismatched_entries_are_misses(tmp_path):
    cache = CompileCache(tmp_path)
    k = cache_key(builtin_grammar("sql"), **BASE)
    cache.put(k, "payload")
    assert cache.get(k) == "payload"
    path = next(tmp_path.rglob("*.json"))
    entry = json.loads(path.read_text())
    entry["payload"] = "tampered"
    path.write_text(json.dumps(entry))
    assert cache.get(k) is None
    path.write_text("{not json")
    assert cache.get(k) is None
    assert cache.get_or_build(k, lambda: "rebuilt", str, str) == "rebuilt"


CHILD = """
import hashlib, torch
torch.set_num_threads(1)
from shim_adapters.mask.compile_cache import default_cache
from shim_adapters.grammars.grammar import builtin_grammar
from shim_adapters.lm.loading import load_lm
from shim_adapters.backends.registry import get_backend
lm = load_lm(None)
m = get_backend("xgrammar").compile(builtin_grammar("sql"), lm.tokenizer, lm.vocab_size)
s = m.new_state()
digest = hashlib.sha256()
for t in lm.tokenizer.encode("SELECT a FROM t;", add_special_tokens=False):
    digest.update(s.allowed_mask().tobytes()); s.advance(t)
print(default_cache().hits, default_cache().misses, digest.hexdigest(), s.eos_allowed())
"""


def test_second_process_reads_the_first_ones_compile(tmp_path):
    env = {**os.environ, "SHIM_CACHE_DIR": str(tmp_path), "SHIM_CACHE_MIN_SECONDS": "0"}
    runs = [subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True,
                           text=True, check=True).stdout.split() for _ in range(2)]
    assert runs[0][:2] == ["0", "1"] and runs[1][:2] == ["1", "0"]
    assert runs[0][2:] == runs[1][2:] and runs[1][3] == "True"  # the same masks, step by step
    assert len(list((tmp_path / "xgrammar").glob("*.json"))) == 1


@pytest.mark.parametrize("value", ["off", ""])
def test_cache_can_be_switched_off(monkeypatch, value):
    from shim_adapters.mask.compile_cache import cache_dir

    monkeypatch.setenv("SHIM_CACHE_DIR", value)
    assert cache_dir() is None and CompileCache().get(cache_key(builtin_grammar("sql"),
                                                                **BASE)) is None


def test_an_entry_the_backend_calls_too_big_is_built_but_not_stored(tmp_path, monkeypatch):
    monkeypatch.setenv("SHIM_CACHE_MIN_SECONDS", "0")
    cache = CompileCache(tmp_path)
    key = cache_key(builtin_grammar("sql"), "xgrammar", "0", "tok", 8, {})
    built = cache.get_or_build(key, lambda: "big", str, str, worth_storing=lambda r: False)
    assert built == "big" and cache.get(key) is None
    cache.get_or_build(key, lambda: "small", str, str, worth_storing=lambda r: True)
    assert cache.get(key) == "small"


def test_xgrammar_keeps_large_compiled_grammars_out_of_the_cache(tmp_path, monkeypatch):
    import shim_xgrammar.masker as xgr_masker

    from shim_adapters.backends.registry import get_backend
    from shim_adapters.lm.loading import load_lm

    lm = load_lm(None)
    monkeypatch.setenv("SHIM_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("SHIM_CACHE_MIN_SECONDS", "0")
    stored = lambda: list(tmp_path.rglob("*.json"))  # noqa: E731
    monkeypatch.setattr(xgr_masker, "MAX_CACHED_GRAMMAR_BYTES", 0)  # every grammar is "large"
    get_backend("xgrammar").compile(builtin_grammar("sql"), lm.tokenizer, lm.vocab_size)
    assert stored() == []
    monkeypatch.setattr(xgr_masker, "MAX_CACHED_GRAMMAR_BYTES", 2**20)
    get_backend("xgrammar").compile(builtin_grammar("sql"), lm.tokenizer, lm.vocab_size)
    assert len(stored()) == 1


def test_an_oversized_entry_is_neither_written_nor_read(tmp_path, monkeypatch):
    import shim_adapters.mask.compile_cache as cc

    cache = CompileCache(tmp_path)
    key = cache_key(builtin_grammar("sql"), "xgrammar", "0", "tok", 8, {})
    cache.put(key, "x" * 100)
    assert cache.get(key) == "x" * 100
    monkeypatch.setattr(cc, "MAX_ENTRY_BYTES", 50)
    assert cache.get(key) is None and not list(tmp_path.rglob("*.json"))  # dropped
    cache.put(key, "x" * 100)
    assert not list(tmp_path.rglob("*.json"))
