"""SglangShimLogitProcessor through SGLang's own serialisation, Req and custom-processor call."""

from __future__ import annotations

import gc
from array import array

import numpy as np
import pytest
import torch
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.sampling.custom_logit_processor import CustomLogitProcessor
from sglang.srt.sampling.sampling_params import SamplingParams
from shim_sglang.processor import REGISTRY, SglangShimLogitProcessor

from shim_adapters.errors import ForbiddenTokenError
from shim_adapters.shim.correction import ShimLogitsProcessor

SERIALISED = SglangShimLogitProcessor.to_str()


def make_req(rid, tokenizer, custom_params, temperature=1.0):
    params = SamplingParams(temperature=temperature, max_new_tokens=16,
                            custom_params=custom_params)
    req = Req(rid, "prompt", array("q", [1, 2, 3]), params, custom_logit_processor=SERIALISED)
    req.tokenizer = tokenizer  # what SGLang's scheduler does for every request
    return req


def call(reqs, logits):
    """What sglang.srt.layers.sampler.apply_custom_logit_processor does for one processor."""
    processor = CustomLogitProcessor.from_str(SERIALISED)  # dill by reference, like SGLang
    assert isinstance(processor, SglangShimLogitProcessor)
    return processor(logits, [r.sampling_params.custom_params for r in reqs])


def valid_prefix(masker, length, seed):
    rng = np.random.default_rng(seed)
    state = masker.new_state()
    out = []
    for _ in range(length):
        allowed = [t for t in state.allowed_token_ids() if t not in masker.eos_token_ids]
        if not allowed:
            break
        out.append(int(rng.choice(allowed)))
        state.advance(out[-1])
    return out


@pytest.fixture(autouse=True)
def fresh_registry():
    REGISTRY.rows.clear()
    yield
    REGISTRY.rows.clear()


def test_requests_follow_their_output_and_match_the_core(lm, binary5_dir, bv4_dir):
    tok = lm.tokenizer
    reqs = [make_req("a", tok, {"shim_controller": str(binary5_dir)}),
            make_req("plain", tok, None),
            make_req("b", tok, {"shim_controller": str(bv4_dir)})]
    logits = torch.randn(3, lm.vocab_size)
    out = call(reqs, logits.clone())
    assert torch.equal(out[1], logits[1])
    bound_a, bound_b = REGISTRY.rows["a"][1].bound, REGISTRY.rows["b"][1].bound
    # the engine appends sampled tokens to req.output_ids; the states follow
    for token in valid_prefix(bound_a.masker, 3, 0):
        reqs[0].output_ids.append(token)
    for token in valid_prefix(bound_b.masker, 4, 1):
        reqs[2].output_ids.append(token)
    logits = torch.randn(3, lm.vocab_size)
    out = call(reqs, logits.clone())
    for row, req, bound in ((0, reqs[0], bound_a), (2, reqs[2], bound_b)):
        state = bound.masker.new_state()
        for token in req.output_ids:
            state.advance(token)
        core = ShimLogitsProcessor([state], bound.adjuster.controller)
        want = core(torch.zeros((1, 1), dtype=torch.long), logits[row:row + 1].clone())
        torch.testing.assert_close(out[row:row + 1], want, rtol=0, atol=1e-6)
    assert torch.equal(out[1], logits[1])


def test_finished_or_dead_requests_are_dropped(lm, binary5_dir):
    req = make_req("gone", lm.tokenizer, {"shim_controller": str(binary5_dir)})
    call([req], torch.randn(1, lm.vocab_size))
    assert "gone" in REGISTRY.rows
    del req
    gc.collect()
    other = make_req("next", lm.tokenizer, {"shim_controller": str(binary5_dir)})
    call([other], torch.randn(1, lm.vocab_size))
    assert sorted(REGISTRY.rows) == ["next"]


def test_forbidden_token_is_refused(lm, binary5_dir):
    req = make_req("f", lm.tokenizer, {"shim_controller": str(binary5_dir)})
    call([req], torch.randn(1, lm.vocab_size))
    masker = REGISTRY.rows["f"][1].bound.masker
    forbidden = int(np.flatnonzero(~masker.new_state().allowed_mask()[:len(lm.tokenizer)])[0])
    req.output_ids.append(forbidden)
    with pytest.raises(ForbiddenTokenError, match=f"token {forbidden}"):
        call([req], torch.randn(1, lm.vocab_size))


def test_retracted_request_restarts_its_state(lm, binary5_dir):
    req = make_req("r", lm.tokenizer, {"shim_controller": str(binary5_dir)})
    call([req], torch.randn(1, lm.vocab_size))
    masker = REGISTRY.rows["r"][1].bound.masker
    for token in valid_prefix(masker, 3, 2):
        req.output_ids.append(token)
    call([req], torch.randn(1, lm.vocab_size))
    assert len(REGISTRY.rows["r"][1].state.token_ids) == 3
    req.output_ids = array("q")  # what Req.reset_for_retract does
    logits = torch.randn(1, lm.vocab_size)
    out = call([req], logits.clone())
    assert len(REGISTRY.rows["r"][1].state.token_ids) == 0
    fresh = masker.new_state().allowed_mask()
    assert torch.isfinite(out[0]).numpy().tolist() == fresh.tolist()


def test_through_sglangs_own_apply_custom_logit_processor(lm, binary5_dir, bv4_dir):
    """SGLang's sampler groups rows by processor string and writes the result back."""
    from sglang.srt.layers.sampler import apply_custom_logit_processor
    from sglang.srt.sampling.sampling_batch_info import (
        ProcessorEntry,
        SamplingBatchInfo,
        _rows_to_device_indices,
    )

    tok = lm.tokenizer
    reqs = [make_req("x", tok, {"shim_controller": str(binary5_dir)}),
            make_req("y", tok, None),
            make_req("z", tok, {"shim_controller": str(bv4_dir)}, temperature=0.5)]
    reqs[1].custom_logit_processor = None  # a request that did not name the processor
    rows = [i for i, r in enumerate(reqs) if r.custom_logit_processor is not None]
    n = len(reqs)
    info = SamplingBatchInfo(
        temperatures=torch.tensor([[r.sampling_params.temperature] for r in reqs]),
        top_ps=torch.ones(n), top_ks=torch.full((n,), -1), min_ps=torch.zeros(n),
        is_all_greedy=False, is_any_greedy=False, need_top_p_sampling=False,
        need_top_k_sampling=False, need_min_p_sampling=False, vocab_size=lm.vocab_size,
        device="cpu", has_custom_logit_processor=True,
        custom_params=[r.sampling_params.custom_params for r in reqs],
        custom_logit_processor={hash(SERIALISED): ProcessorEntry(
            processor=CustomLogitProcessor.from_str(SERIALISED), rows=rows,
            indices=_rows_to_device_indices(rows, "cpu", False))})
    logits = torch.randn(n, lm.vocab_size)
    before = logits.clone()
    apply_custom_logit_processor(logits, info)
    assert torch.equal(logits[1], before[1])
    for row, rid in ((0, "x"), (2, "z")):
        row_state = REGISTRY.rows[rid][1]
        allowed = torch.from_numpy(row_state.bound.masker.new_state().allowed_mask())
        assert torch.equal(torch.isfinite(logits[row]), allowed)
        assert not torch.equal(logits[row][allowed], before[row][allowed])  # corrected
    assert REGISTRY.rows["z"][1].temperature == 0.5
