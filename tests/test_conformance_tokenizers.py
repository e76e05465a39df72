"""Any tokenizer a user has: tokenizer.json, a bare directory (EOS from the files or given),
SentencePiece; normalisers cause no false alarm; chat-template control tokens not flagged
special are a failure class of their own; the exhaustive reference equals per-token checks."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from shim_adapters.backends.registry import get_backend
from shim_adapters.conformance import run_conformance
from shim_adapters.conformance.faults import faulty_backend
from shim_adapters.conformance.prefix import prefix_checker
from shim_adapters.conformance.reference_mask import (
    DEAD,
    SKIPPED,
    UNDECIDED,
    VIABLE,
    reference_verdicts,
)
from shim_adapters.conformance.report import FAILURE_CLASSES
from shim_adapters.conformance.runner import resolve_tokenizer
from shim_adapters.mask.vocab import Vocabulary, decode_prefix
from shim_adapters.errors import ShimError
from shim_adapters.grammars.grammar import builtin_grammar
from shim_adapters.mask.tokenizers_offline import load_local_tokenizer, load_offline_tokenizer

SMALL = dict(gamma=False, uniform_walks=1, rare_walks=1, valid_strings=4, exhaustive_states=6)


def _gpt2_definition() -> dict:
    return json.loads(load_offline_tokenizer("gpt2").backend_tokenizer.to_str())


def _write(tmp_path, definition: dict, **files) -> None:
    (tmp_path / "tokenizer.json").write_text(json.dumps(definition))
    for name, data in files.items():
        (tmp_path / name).write_text(json.dumps(data))


def test_tokenizer_json_file_needs_an_eos_and_takes_it_from_the_command_line(tmp_path):
    _write(tmp_path, _gpt2_definition())
    with pytest.raises(ShimError, match="no EOS token.*--eos"):
        load_local_tokenizer(tmp_path / "tokenizer.json")
    tok = load_local_tokenizer(tmp_path / "tokenizer.json", eos="<|endoftext|>")
    assert tok.eos_token_id == 50256
    assert load_local_tokenizer(tmp_path / "tokenizer.json", eos="50256").eos_token_id == 50256
    with pytest.raises(ShimError, match="not in the vocabulary"):
        load_local_tokenizer(tmp_path / "tokenizer.json", eos="<|nope|>")


def test_bare_directory_reads_the_eos_from_its_files(tmp_path):
    _write(tmp_path, _gpt2_definition(), **{"generation_config.json": {"eos_token_id": 50256}})
    resolved = resolve_tokenizer(str(tmp_path))
    assert resolved.tokenizer.eos_token_id == 50256 and resolved.logits_width == 50257
    report = run_conformance("xgrammar", str(tmp_path), "binary5", "fast", **SMALL)
    assert report.exit_code == 0, report.to_markdown()


def test_sentencepiece_model_file_loads_with_its_bytes(tmp_path):
    from shim_adapters.mask.tokenizers_offline import _mistral_model_file

    tok = load_local_tokenizer(_mistral_model_file())
    ref = load_offline_tokenizer("mistral-v1")
    text = "naïve 中文 {\"k\": [1]}"
    assert tok.encode(text, add_special_tokens=False)[1:] == \
        ref.encode(text, add_special_tokens=False)[1:]
    vocab = Vocabulary(tok, len(tok))
    ids, _ = vocab.canonical(text)
    assert vocab.to_bytes(ids) == text.encode() and tok.eos_token == "</s>"


def test_a_normalising_tokenizer_is_fed_the_vocabulary_bytes_not_the_rewritten_text(tmp_path):
    definition = _gpt2_definition()
    definition["normalizer"] = {"type": "NFKC"}
    _write(tmp_path, definition)
    tok = load_local_tokenizer(tmp_path / "tokenizer.json", eos="<|endoftext|>")
    vocab = Vocabulary(tok, len(tok))
    text = "ﬁle ｆｕｌｌ ①"  # NFKC rewrites all three
    assert tok.decode(tok.encode(text)) != text
    ids, how = vocab.canonical(text)
    assert how == "vocab_bytes" and vocab.to_bytes(ids) == text.encode()


def _chat_tokenizer(tmp_path):
    definition = _gpt2_definition()
    n = len(load_offline_tokenizer("gpt2"))
    for i, content in enumerate(("<|im_start|>", "<|im_end|>", "<tool_call>")):
        definition["added_tokens"].append({"id": n + i, "content": content, "single_word": False,
                                           "lstrip": False, "rstrip": False,
                                           "normalized": False, "special": False})
    _write(tmp_path, definition, **{"tokenizer_config.json": {
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
        "chat_template": "{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>"
                         "{% endfor %}{% if tools %}<tool_call>{% endif %}"}})
    return n


def test_chat_template_control_tokens_not_flagged_special_are_their_own_failure_class(tmp_path):
    n = _chat_tokenizer(tmp_path)
    tok = resolve_tokenizer(str(tmp_path)).tokenizer
    assert Vocabulary(tok, len(tok)).control_ids == frozenset({n, n + 1, n + 2})
    healthy = run_conformance("xgrammar", str(tmp_path), "binary5", "fast", **SMALL)
    control = healthy.cells[0].checks["control_tokens"]
    assert control.passed > 0 and control.failed == 0 and healthy.exit_code == 0
    spec = faulty_backend(get_backend("xgrammar"), "allow_control")
    report = run_conformance(spec, str(tmp_path), "binary5", "fast", **SMALL)
    control = report.cells[0].checks["control_tokens"]
    assert control.failed > 0
    assert {r.token_text for r in control.failures} >= {"<|im_start|>", "<|im_end|>"}
    assert report.exit_code == FAILURE_CLASSES["control-tokens"][0]


@pytest.mark.parametrize("grammar,prefix", [
    ("json", '{"a": "x'), ("json", '[1, '), ("bv4", "(define-fun inv ((s (BitVec 4)) (t (B"),
    ("sql", "SELECT a FROM t WHERE "),
])
def test_trie_reference_equals_the_per_token_reference(grammar, prefix):
    tok = resolve_tokenizer("gpt2")
    vocab = Vocabulary(tok.tokenizer, tok.logits_width)
    checker = prefix_checker(builtin_grammar(grammar))
    verdicts = reference_verdicts(checker, prefix.encode(), vocab).verdicts
    assert not (verdicts == SKIPPED).any()
    rng = random.Random(1)
    sample = rng.sample([int(i) for i in vocab.text_ids], 400)
    for t in sample:
        data = prefix.encode() + vocab.token_bytes[t]
        try:
            text, tail = decode_prefix(data)
        except UnicodeDecodeError:
            assert verdicts[t] == DEAD, t
            continue
        if tail:  # ends inside a character: viable iff the text is and a witness completes it
            assert verdicts[t] in ((VIABLE, UNDECIDED) if checker.viable(text) else (DEAD,)), t
            continue
        assert verdicts[t] == (VIABLE if checker.viable(text) else DEAD), (t, vocab.text_of(t))


def test_partial_utf8_token_inside_a_string_is_viable_and_the_cap_reports_skips():
    tok = resolve_tokenizer("gpt2")
    vocab = Vocabulary(tok.tokenizer, tok.logits_width)
    checker = prefix_checker(builtin_grammar("json"))
    verdicts = reference_verdicts(checker, b'["', vocab).verdicts
    partial = [i for i in vocab.text_ids if vocab.token_bytes[int(i)][0] >= 0xC2
               and vocab.is_partial_utf8(int(i)) and len(vocab.token_bytes[int(i)]) == 1]
    assert partial and all(verdicts[i] == VIABLE for i in partial[:50])
    capped = reference_verdicts(checker, b'["', vocab, deadline=0.0).verdicts
    assert (capped == SKIPPED).sum() == len(vocab.text_ids)
    assert np.all(verdicts[len(tok.tokenizer):] < 0)  # padding is never text
