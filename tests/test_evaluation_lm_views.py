"""The evaluation's LM views change cost, never probabilities: checked against the stock path."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from shim_adapters.evaluation.scoring import step_logprobs
from shim_adapters.lm.sampling import prefill, sample
from shim_adapters.lm.views import gqa_without_copies, newline_token_ids, stop_folded


@pytest.fixture()
def gqa_lm(shipped_lm):
    """A small grouped-query Llama (random weights, fixed seed) with the shipped tokenizer:
    the attention layout of SmolLM2 at a size a test can run."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=shipped_lm.vocab_size, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, attn_implementation="sdpa")
    model = LlamaForCausalLM(config).eval()
    return dataclasses.replace(shipped_lm, model=model, identifier="tiny-gqa-llama")


def test_shared_prefix_attention_matches_stock_attention(gqa_lm):
    prompt = "Write a SQL query:\n"
    stock = prefill(gqa_lm, prompt)
    batch = sample(stock, 4, max_new_tokens=6, generator=torch.Generator().manual_seed(0))
    before = step_logprobs(stock, batch.token_ids)
    assert gqa_without_copies(gqa_lm)
    fast = prefill(gqa_lm, prompt)
    after = step_logprobs(fast, batch.token_ids)
    torch.testing.assert_close(after, before, atol=1e-4, rtol=1e-4)
    again = sample(fast, 4, max_new_tokens=6, generator=torch.Generator().manual_seed(0))
    assert again.token_ids == batch.token_ids
    np.testing.assert_allclose(np.concatenate(again.lm_logprobs),
                               np.concatenate(batch.lm_logprobs), atol=1e-4)


def test_stop_folding_moves_newline_mass_onto_eos(shipped_lm):
    prompt = "Write a short sentence:\n"
    plain = prefill(shipped_lm, prompt)
    folded_lm = stop_folded(shipped_lm, shipped_lm.eos_token_ids)
    folded = prefill(folded_lm, prompt)
    p = torch.log_softmax(plain.last_logits, -1)
    q = torch.log_softmax(folded.last_logits, -1)
    stops = newline_token_ids(shipped_lm.tokenizer)
    assert stops  # the BPE vocabulary has newline tokens
    eos = folded_lm.eos_token_ids[0]
    assert float(q.exp().sum()) == pytest.approx(1.0, abs=1e-5)
    assert float(q[eos]) == pytest.approx(float(torch.logsumexp(p[stops + [eos]], 0)), abs=1e-5)
    assert torch.isinf(q[[s for s in stops if s != eos]]).all()
    others = torch.ones_like(p, dtype=torch.bool)
    others[stops + [eos]] = False
    torch.testing.assert_close(q[others], p[others])


