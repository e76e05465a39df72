"""VllmShimLogitsProcessorV2 against vLLM's real V2 interface (LogitsProcRequestState,
LogitsContext, the V2 loader) and the shipped LM's tokenizer.

The V2 runner's per-slot buffers (``StagedWriteTensor`` for ``all_token_ids`` and
``total_len``, ``UvaBackedTensor`` for ``prompt_len``) write through Triton kernels on a GPU
(``StagedWriteTensor.apply_write``); here the engine's side is the smallest stand-in,
:class:`Engine`: it owns plain tensors with the attributes the processor reads (``.gpu``,
``.np``), fills them as the runner does (prompt then committed output; draft tokens only in
``ctx.input_ids``), and hands the processor a real ``LogitsContext`` per step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from vllm import SamplingParams
from vllm.exceptions import VLLMValidationError
from vllm.v1.worker.gpu.sample.logits_processor import (LogitsContext, LogitsProcessor,
                                                        LogitsProcRequestState)
from vllm.v1.worker.gpu.sample.logits_processor import loader as v2_loader

from shim_adapters.shim.correction import ShimLogitsProcessor
from shim_vllm.processor import VllmShimLogitsProcessor
from shim_vllm.processor_v2 import VllmShimLogitsProcessorV2
from shim_vllm.request_args import parse_request_args

MAX_REQS = 8
MAX_LEN = 96


@dataclass
class DeviceBuffer:
    """Stand-in for StagedWriteTensor: the device tensor the runner writes, as ``.gpu``."""

    gpu: torch.Tensor


@dataclass
class HostBuffer:
    """Stand-in for UvaBackedTensor: the host array that is its source of truth, as ``.np``."""

    np: np.ndarray


class Engine:
    """The V2 runner's per-slot token state for a few slots, and each step's LogitsContext."""

    def __init__(self, vocab_size: int, max_reqs: int = MAX_REQS):
        self.vocab_size = vocab_size
        self.all_token_ids = DeviceBuffer(torch.zeros(max_reqs, MAX_LEN, dtype=torch.int32))
        self.total_len = DeviceBuffer(torch.zeros(max_reqs, dtype=torch.int32))
        self.prompt_len = HostBuffer(np.zeros(max_reqs, dtype=np.int32))
        self.prefill_len = HostBuffer(np.zeros(max_reqs, dtype=np.int32))
        self.req_states = LogitsProcRequestState(
            device=torch.device("cpu"), max_num_reqs=max_reqs, vocab_size=vocab_size,
            all_token_ids=self.all_token_ids, prompt_len=self.prompt_len,
            prefill_len=self.prefill_len, total_len=self.total_len)

    def add(self, processor, slot: int, params: SamplingParams, prompt=(1, 2, 3),
            output=()) -> bool:
        """A request enters ``slot`` (resumed with ``output`` already generated)."""
        tokens = list(prompt) + list(output)
        self.prompt_len.np[slot] = len(prompt)
        self.prefill_len.np[slot] = len(tokens)
        self.total_len.gpu[slot] = len(tokens)
        self.all_token_ids.gpu[slot, :len(tokens)] = torch.tensor(tokens, dtype=torch.int32)
        return processor.add_request(slot, params)

    def commit(self, slot: int, *tokens: int) -> None:
        """The sampler committed ``tokens`` for the request in ``slot`` (post_update)."""
        n = int(self.total_len.gpu[slot])
        self.all_token_ids.gpu[slot, n:n + len(tokens)] = torch.tensor(tokens,
                                                                        dtype=torch.int32)
        self.total_len.gpu[slot] = n + len(tokens)

    def output(self, slot: int) -> list[int]:
        n, p = int(self.total_len.gpu[slot]), int(self.prompt_len.np[slot])
        return self.all_token_ids.gpu[slot, p:n].tolist()

    def ctx(self, batch: list[tuple[int, list[int]]]) -> LogitsContext:
        """A step over ``batch``: (slot, draft tokens) per request, in batch order."""
        rows, local, input_ids = [], [], []
        for slot, drafts in batch:
            last = self.all_token_ids.gpu[slot, int(self.total_len.gpu[slot]) - 1].item()
            for j, token in enumerate([last, *drafts]):
                rows.append(slot)
                local.append(j)
                input_ids.append(token)
        slots = [slot for slot, _ in batch]
        return LogitsContext(
            expanded_idx_mapping=torch.tensor(rows, dtype=torch.int32),
            idx_mapping=torch.tensor(slots, dtype=torch.int32),
            idx_mapping_np=np.array(slots, dtype=np.int32),
            expanded_local_pos=torch.tensor(local, dtype=torch.int32),
            input_ids=torch.tensor(input_ids, dtype=torch.int32),
            pos=torch.zeros(len(rows), dtype=torch.int32),
            seq_lens_upper_bound_np=np.zeros(len(slots), dtype=np.int32))


@pytest.fixture
def processor(vllm_config):
    engine = Engine(vllm_config.model_config.get_vocab_size())
    proc = VllmShimLogitsProcessorV2(vllm_config, engine.req_states)
    proc.runner = engine
    return proc


def shim_params(directory, temperature: float = 1.0, **extra) -> SamplingParams:
    return SamplingParams(temperature=temperature,
                          extra_args={"shim_controller": str(directory), **extra})


def bound_of(processor, directory):
    return processor.bindings.bind(parse_request_args({"shim_controller": str(directory)}))


def state_after(bound, prefix):
    state = bound.masker.new_state()
    for token in prefix:
        state.advance(token)
    return state


def valid_prefix(masker, length: int, seed: int) -> list[int]:
    """A prefix the grammar allows: random allowed non-EOS tokens (stops early if forced)."""
    rng = np.random.default_rng(seed)
    state = masker.new_state()
    out: list[int] = []
    for _ in range(length):
        allowed = [t for t in state.allowed_token_ids() if t not in masker.eos_token_ids]
        if not allowed:
            break
        token = int(rng.choice(allowed))
        state.advance(token)
        out.append(token)
    return out


def forbidden_after(bound, prefix) -> int:
    state = state_after(bound, prefix)
    return int(np.flatnonzero(~state.allowed_mask()[:len(bound.masker.tokenizer)])[0])


def expected(bound, prefixes, logits_rows):
    """The core's ShimLogitsProcessor on the same states and logits."""
    states = [state_after(bound, prefix) for prefix in prefixes]
    core = ShimLogitsProcessor(states, bound.adjuster.controller)
    return core(torch.zeros((len(states), 1), dtype=torch.long), logits_rows.clone())


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal rows up to a per-row constant (the core's processor may shift a row by one: the
    softmax removes it): the same -inf entries and the same log_softmax."""
    assert torch.equal(torch.isneginf(got), torch.isneginf(want))
    live = torch.isfinite(want).any(dim=-1)
    torch.testing.assert_close(torch.log_softmax(got[live], -1), torch.log_softmax(want[live], -1),
                               rtol=0, atol=1e-5)


# ---- the V2 interface and loader ------------------------------------------------------------
def test_it_implements_the_v2_interface_and_vllms_v2_loader_builds_it(vllm_config):
    assert issubclass(VllmShimLogitsProcessorV2, LogitsProcessor)
    classes = v2_loader._load_v2_logitsprocs(["shim_vllm:VllmShimLogitsProcessorV2"])
    assert classes[-1] is VllmShimLogitsProcessorV2
    # the installed distribution registers no entry point: vLLM's V2 loader refuses V1 ones
    assert not [c for c in v2_loader._load_v2_logitsprocs_plugins()
                if c.__module__.startswith("shim_vllm")]
    with pytest.raises(ValueError, match="not a subclass"):
        v2_loader._load_v2_logitsprocs(["shim_vllm:VllmShimLogitsProcessor"])
    validator = v2_loader.build_custom_logits_processors_params_validator(
        ("shim_vllm:VllmShimLogitsProcessorV2",))
    validator(SamplingParams())  # a plain request passes
    with pytest.raises(VLLMValidationError, match="shim_temperature"):  # HTTP 400
        validator(SamplingParams(extra_args={"shim_controller": "/x",
                                             "shim_temperature": "hot"}))
    assert issubclass(VllmShimLogitsProcessor, object)  # the V1 class stays importable


def test_plain_requests_are_declined_and_untouched(processor, binary5_dir):
    engine = processor.runner
    assert engine.add(processor, 0, SamplingParams()) is False
    assert engine.add(processor, 1, SamplingParams(extra_args={"other": 1})) is False
    logits = torch.randn(2, engine.vocab_size)
    assert processor.apply(logits.clone(), engine.ctx([(0, []), (1, [])])).equal(logits)
    assert engine.add(processor, 2, shim_params(binary5_dir)) is True
    out = processor.apply(torch.cat([logits, logits[:1]]),
                          engine.ctx([(0, []), (1, []), (2, [])]))
    assert out[:2].equal(logits) and torch.isneginf(out[2]).any()


# ---- rows, slots, committed tokens ------------------------------------------------------------
def test_rows_follow_slots_in_any_batch_order(processor, binary5_dir, bv4_dir):
    engine = processor.runner
    b5, bv = bound_of(processor, binary5_dir), bound_of(processor, bv4_dir)
    p5, pv = valid_prefix(b5.masker, 3, 0), valid_prefix(bv.masker, 5, 1)
    engine.add(processor, 6, shim_params(binary5_dir), output=p5[:1])  # resumed request
    engine.add(processor, 2, shim_params(bv4_dir))
    engine.add(processor, 4, SamplingParams())
    for token in pv:
        engine.commit(2, token)
    engine.commit(6, *p5[1:])
    torch.manual_seed(0)
    for order in ([6, 4, 2], [2, 6, 4], [4, 2, 6]):
        logits = torch.randn(3, engine.vocab_size)
        out = processor.apply(logits.clone(), engine.ctx([(s, []) for s in order]))
        for row, slot in enumerate(order):
            if slot == 4:
                assert out[row].equal(logits[row])
            else:
                bound, prefix = (b5, p5) if slot == 6 else (bv, pv)
                close(out[row:row + 1], expected(bound, [prefix], logits[row:row + 1]))


def test_a_recycled_slot_starts_from_its_new_request(processor, binary5_dir, bv4_dir):
    engine = processor.runner
    b5, bv = bound_of(processor, binary5_dir), bound_of(processor, bv4_dir)
    p5 = valid_prefix(b5.masker, 4, 2)
    engine.add(processor, 3, shim_params(binary5_dir))
    engine.commit(3, *p5)
    processor.apply(torch.randn(1, engine.vocab_size), engine.ctx([(3, [])]))
    assert list(processor.slots[3].state.token_ids) == p5
    # the request finished; a plain request takes the slot: untouched, no SHIM state left
    engine.add(processor, 3, SamplingParams(), prompt=(5, 6))
    logits = torch.randn(1, engine.vocab_size)
    assert processor.apply(logits.clone(), engine.ctx([(3, [])])).equal(logits)
    assert processor.slots[3] is None and not processor.is_shim[3]
    # then a SHIM request of another controller: a fresh state, not the old occupant's
    engine.add(processor, 3, shim_params(bv4_dir), prompt=(7,))
    logits = torch.randn(1, engine.vocab_size)
    out = processor.apply(logits.clone(), engine.ctx([(3, [])]))
    close(out, expected(bv, [[]], logits))
    assert processor.slots[3].bound is bv and processor.slots[3].state.step == 0


def test_the_engines_minus_inf_is_kept(processor, binary5_dir):
    """vLLM's grammar stage ran first: SHIM keeps the intersection, never re-inflates."""
    engine = processor.runner
    b5 = bound_of(processor, binary5_dir)
    engine.add(processor, 0, shim_params(binary5_dir))
    allowed = np.flatnonzero(b5.masker.new_state().allowed_mask())
    assert len(allowed) >= 2
    logits = torch.randn(1, engine.vocab_size)
    engine_masked = torch.from_numpy(allowed[:1])
    logits[0, engine_masked] = float("-inf")
    out = processor.apply(logits.clone(), engine.ctx([(0, [])]))
    assert torch.isneginf(out[0, engine_masked]).all()
    finite = torch.isfinite(out[0]).nonzero().flatten().tolist()
    assert finite == sorted(allowed[1:].tolist())
    close(out, expected(b5, [[]], logits))  # the core, on the engine's logits, agrees


# ---- speculative decoding: draft rows -----------------------------------------------------
def test_draft_rows_follow_their_draft_prefix(processor, binary5_dir, bv4_dir):
    engine = processor.runner
    b5, bv = bound_of(processor, binary5_dir), bound_of(processor, bv4_dir)
    p5, pv = valid_prefix(b5.masker, 4, 3), valid_prefix(bv.masker, 6, 4)
    engine.add(processor, 5, shim_params(binary5_dir))
    engine.add(processor, 1, shim_params(bv4_dir))
    engine.add(processor, 0, SamplingParams())
    engine.commit(5, p5[0])
    engine.commit(1, *pv[:2])
    batch = [(1, pv[2:5]), (0, [9, 9]), (5, p5[1:3])]  # 4 + 3 + 3 rows
    torch.manual_seed(1)
    logits = torch.randn(10, engine.vocab_size)
    out = processor.apply(logits.clone(), engine.ctx(batch))
    close(out[0:4], expected(bv, [pv[:2], pv[:3], pv[:4], pv[:5]], logits[0:4]))
    assert out[4:7].equal(logits[4:7])
    close(out[7:10], expected(b5, [p5[:1], p5[:2], p5[:3]], logits[7:10]))


def test_a_draft_that_leaves_the_grammar_masks_every_row_after_it(processor, binary5_dir):
    engine = processor.runner
    b5 = bound_of(processor, binary5_dir)
    prefix = valid_prefix(b5.masker, 3, 5)
    bad = forbidden_after(b5, prefix[:2])
    engine.add(processor, 2, shim_params(binary5_dir))
    engine.commit(2, prefix[0])
    logits = torch.randn(5, engine.vocab_size)
    out = processor.apply(logits.clone(), engine.ctx([(2, [prefix[1], bad, prefix[2], 7])]))
    close(out[0:2], expected(b5, [prefix[:1], prefix[:2]], logits[0:2]))
    assert torch.isneginf(out[1, bad])  # the row before the dead point masks the bad draft
    assert torch.isneginf(out[2:]).all()  # after it, nothing is allowed
    assert processor.slots[2].fault is None  # a dead draft is not a failed request
    # the rejection sampler accepted the good draft and resampled at the bad one
    engine.commit(2, prefix[1], prefix[2])
    logits = torch.randn(1, engine.vocab_size)
    close(processor.apply(logits.clone(), engine.ctx([(2, [])])),
          expected(b5, [prefix[:3]], logits))


def test_committed_drafts_adopt_the_draft_state_instead_of_advancing_again(processor,
                                                                           binary5_dir):
    engine = processor.runner
    b5 = bound_of(processor, binary5_dir)
    prefix = valid_prefix(b5.masker, 3, 6)
    after_two = state_after(b5, prefix[:2])
    resample = int([t for t in after_two.allowed_token_ids()
                    if t not in b5.masker.eos_token_ids and t != prefix[2]][0])
    engine.add(processor, 0, shim_params(binary5_dir))
    processor.apply(torch.randn(4, engine.vocab_size), engine.ctx([(0, prefix)]))
    chain = list(processor.slots[0].chain_states)
    assert [list(s.token_ids) for s in chain] == [prefix[:1], prefix[:2], prefix[:3]]
    engine.commit(0, prefix[0], prefix[1], resample)  # two drafts accepted, then a resample
    logits = torch.randn(1, engine.vocab_size)
    out = processor.apply(logits.clone(), engine.ctx([(0, [])]))
    committed = [prefix[0], prefix[1], resample]
    assert processor.slots[0].state is chain[1]  # adopted, then advanced by the resample only
    assert list(processor.slots[0].state.token_ids) == committed
    close(out, expected(b5, [committed], logits))


def test_finished_requests_allow_only_eos_on_every_row(processor, binary5_dir):
    engine = processor.runner
    b5 = bound_of(processor, binary5_dir)
    state = b5.masker.new_state()
    tokens = []
    while not state.eos_allowed():
        token = int([t for t in state.allowed_token_ids()
                     if t not in b5.masker.eos_token_ids][0])
        state.advance(token)
        tokens.append(token)
    eos = min(b5.masker.eos_token_ids)
    engine.add(processor, 1, shim_params(binary5_dir))
    engine.commit(1, *tokens)
    out = processor.apply(torch.randn(3, engine.vocab_size), engine.ctx([(1, [eos, 5])]))
    assert torch.isfinite(out[1]).nonzero().flatten().tolist() == [eos]
    assert torch.isfinite(out[2]).nonzero().flatten().tolist() == [eos]


# ---- faults stay inside one request ----------------------------------------------------------
def test_a_forbidden_committed_token_stops_that_request_only(processor, binary5_dir, caplog):
    engine = processor.runner
    b5 = bound_of(processor, binary5_dir)
    good = valid_prefix(b5.masker, 2, 7)
    engine.add(processor, 0, shim_params(binary5_dir))
    engine.add(processor, 1, shim_params(binary5_dir))
    engine.commit(0, forbidden_after(b5, []))
    engine.commit(1, *good)
    logits = torch.randn(2, engine.vocab_size)
    with caplog.at_level(logging.ERROR, logger="shim_vllm"):
        out = processor.apply(logits.clone(), engine.ctx([(0, []), (1, [])]))
    eos = processor.slots[0].stop_token_id
    assert eos is not None and torch.isfinite(out[0]).nonzero().flatten().tolist() == [eos]
    close(out[1:], expected(b5, [good], logits[1:]))
    assert "slot 0" in caplog.text and "ForbiddenTokenError" in caplog.text
    # later steps keep stopping it; the slot's next request starts clean
    out = processor.apply(torch.randn(1, engine.vocab_size), engine.ctx([(0, [])]))
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [eos]
    engine.add(processor, 0, shim_params(binary5_dir))
    assert processor.slots[0].fault is None


def test_an_artefact_damaged_after_admission_stops_only_its_request(processor, binary5_dir,
                                                                    tmp_path, caplog):
    import shutil

    engine = processor.runner
    damaged = tmp_path / "damaged"
    shutil.copytree(binary5_dir, damaged)
    VllmShimLogitsProcessorV2.validate_params(shim_params(damaged))  # admitted intact
    weights = damaged / "controller.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x01
    weights.write_bytes(bytes(data))
    with caplog.at_level(logging.ERROR, logger="shim_vllm"):
        assert engine.add(processor, 4, shim_params(damaged)) is True
        engine.add(processor, 5, shim_params(binary5_dir))
        logits = torch.randn(2, engine.vocab_size)
        out = processor.apply(logits.clone(), engine.ctx([(4, []), (5, [])]))
    assert "sha256" in caplog.text and "slot 4" in caplog.text
    eos = processor.slots[4].stop_token_id
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [eos]
    close(out[1:], expected(bound_of(processor, binary5_dir), [[]], logits[1:]))


def test_a_controller_that_raises_stops_only_its_requests(processor, binary5_dir, bv4_dir,
                                                          monkeypatch):
    engine = processor.runner
    b5, bv = bound_of(processor, binary5_dir), bound_of(processor, bv4_dir)
    engine.add(processor, 0, shim_params(binary5_dir))
    engine.add(processor, 1, shim_params(bv4_dir))

    def broken(states, allowed):
        raise RuntimeError("controller exploded")

    monkeypatch.setattr(b5.adjuster, "log_gamma", broken)
    logits = torch.randn(2, engine.vocab_size)
    out = processor.apply(logits.clone(), engine.ctx([(0, []), (1, [])]))
    assert torch.isfinite(out[0]).sum() == 1 and processor.slots[0].fault is not None
    assert "controller exploded" in processor.slots[0].fault.error
    close(out[1:], expected(bv, [[]], logits[1:]))


def test_a_step_failure_stops_the_steps_shim_requests_not_the_engine(processor, binary5_dir,
                                                                      monkeypatch):
    engine = processor.runner
    engine.add(processor, 0, shim_params(binary5_dir))
    engine.add(processor, 1, SamplingParams())

    def broken(slots):
        raise RuntimeError("device gather failed")

    monkeypatch.setattr(processor, "_sync", broken)
    logits = torch.randn(2, engine.vocab_size)
    out = processor.apply(logits.clone(), engine.ctx([(0, []), (1, [])]))
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [processor.slots[0].stop_token_id]
    assert out[1].equal(logits[1])
    assert "device gather failed" in processor.slots[0].fault.error
