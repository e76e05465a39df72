"""Masked generation through transformers with the shipped LM and the docs/ example plugin."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import LogitsProcessorList

from shim_adapters.backends.registry import get_backend
from shim_adapters.errors import DeadEndError, ForbiddenTokenError, VocabMismatchError
from shim_adapters.grammars.grammar import Grammar, builtin_grammar
from shim_adapters.lm.generation import FAITHFUL_SAMPLING, MaskedLogitsProcessor, generate_masked

BINARY5 = Grammar("|".join(["10111", "10001", "10010", "11001", "10011", "11110", "10101",
                            "11111", "11101", "00100", "11100", "11010", "10110", "00010",
                            "11011", "10100", "11000"]), "regex", name="binary5-choices")


@pytest.fixture(scope="module")
def choices_masker(shipped_lm, example_plugin):
    return get_backend("choices").compile(BINARY5, shipped_lm.tokenizer, shipped_lm.vocab_size)


def test_masked_samples_are_all_in_the_language(shipped_lm, choices_masker):
    prompt = builtin_grammar("binary5").default_prompt
    out = generate_masked(shipped_lm.model, shipped_lm.tokenizer, choices_masker, prompt, 32,
                          max_new_tokens=12, seed=0)
    assert all(out.complete)
    assert set(out.texts) <= set(BINARY5.text.split("|"))
    assert len(set(out.texts)) > 3  # sampling, not a forced single answer


def test_padding_ids_are_masked_and_eos_only_when_accepting(shipped_lm, choices_masker):
    state = choices_masker.new_state()
    mask = state.allowed_mask()
    assert mask.shape == (shipped_lm.vocab_size,)
    assert shipped_lm.vocab_size > len(shipped_lm.tokenizer), "shipped LM must pad its logits"
    assert not mask[len(shipped_lm.tokenizer):].any()
    eos = min(choices_masker.eos_token_ids)
    assert not mask[eos]
    for ch in "00100":
        state.advance(shipped_lm.tokenizer.convert_tokens_to_ids(ch))
    assert state.allowed_mask()[eos] and state.eos_allowed()


def test_forbidden_token_error_names_token_step_and_state(shipped_lm, choices_masker):
    state = choices_masker.new_state()
    state.advance(shipped_lm.tokenizer.convert_tokens_to_ids("0"))
    bad = shipped_lm.tokenizer.convert_tokens_to_ids("1")  # "01..." is not in the language
    with pytest.raises(ForbiddenTokenError) as info:
        state.advance(bad)
    message = str(info.value)
    assert f"token {bad} ('1')" in message and "step 1" in message
    assert "backend=choices" in message and "text='0'" in message


def test_dead_end_fails_closed_with_the_state(shipped_lm, example_plugin):
    # "0\x07" cannot be spelled by the shipped tokenizer after "0" -> no token, not accepting.
    tok = shipped_lm.tokenizer
    grammar = Grammar("0\u0007|1", "regex", name="unspellable")
    masker = get_backend("choices").compile(grammar, tok, shipped_lm.vocab_size)
    # Drop every token containing the bell character so the second step is a dead end.
    masker.token_strings = [None if s and "\u0007" in s else s for s in masker.token_strings]
    processor = MaskedLogitsProcessor([masker.new_state()])
    zero = tok.convert_tokens_to_ids("0")
    scores = torch.zeros(1, shipped_lm.vocab_size)
    processor(torch.tensor([[5]]), scores.clone())
    with pytest.raises(DeadEndError) as info:
        processor(torch.tensor([[5, zero]]), scores.clone())
    assert "step 1" in str(info.value) and "text='0'" in str(info.value)
    assert "refusing to continue unconstrained" in str(info.value)


def test_processor_in_model_generate_and_width_check(shipped_lm, choices_masker):
    tok = shipped_lm.tokenizer
    prompt = tok(["Generate a binary string of length 5:\n"] * 4, return_tensors="pt")
    states = [choices_masker.new_state() for _ in range(4)]
    processor = MaskedLogitsProcessor(states)
    eos = min(choices_masker.eos_token_ids)
    torch.manual_seed(1)
    shipped_lm.model.generate(**prompt, logits_processor=LogitsProcessorList([processor]),
                              max_new_tokens=10, eos_token_id=eos, pad_token_id=eos,
                              **FAITHFUL_SAMPLING)
    # Every row reached a string of the language (the final EOS is consumed by generate's end).
    assert all(s.text() in BINARY5.text.split("|") for s in states)
    narrow = MaskedLogitsProcessor([choices_masker.new_state()])
    with pytest.raises(VocabMismatchError, match="width"):
        narrow(torch.tensor([[1]]), torch.zeros(1, shipped_lm.vocab_size - 1))
    with pytest.raises(ValueError, match="beam search"):
        narrow(torch.tensor([[1], [1]]), torch.zeros(2, shipped_lm.vocab_size))


def test_masked_distribution_matches_the_mask(shipped_lm, choices_masker):
    state = choices_masker.new_state()
    processor = MaskedLogitsProcessor([state])
    scores = torch.randn(1, shipped_lm.vocab_size)
    out = processor(torch.tensor([[1, 2]]), scores)
    probs = torch.softmax(out, -1)[0].numpy()
    mask = state.allowed_mask()
    assert np.allclose(probs.sum(), 1.0) and probs[~mask].sum() == 0.0
