"""VllmShimLogitsProcessor (V1 model runner) against vLLM's real classes and the shipped LM's
tokenizer."""

from __future__ import annotations

import json
import logging
import shutil

import numpy as np
import pytest
import torch
import shim_vllm.processor as processor_module
from shim_vllm.binding import ControllerBindings
from shim_vllm.processor import VllmShimLogitsProcessor
from shim_vllm.request_args import ShimRequestError, parse_request_args
from shim_vllm.rows import RequestRow, apply_rows
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import (
    BatchUpdate,
    BatchUpdateBuilder,
    MoveDirectionality,
    build_logitsprocs,
)

from shim_adapters.errors import ForbiddenTokenError, ManifestMismatchError
from shim_adapters.shim.correction import ShimLogitsProcessor

CPU = torch.device("cpu")


@pytest.fixture
def processor(vllm_config):
    return VllmShimLogitsProcessor(vllm_config, CPU, False)


def shim_params(directory, temperature: float = 1.0, **extra) -> SamplingParams:
    return SamplingParams(temperature=temperature,
                          extra_args={"shim_controller": str(directory), **extra})


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


def add(processor, batch_size, *entries) -> None:
    """One engine step's BatchUpdate with the given (index, params, output_ids) additions."""
    builder = BatchUpdateBuilder()
    for index, params, output_ids in entries:
        builder.added.append((index, params, [1, 2, 3], output_ids))
    processor.update_state(builder.get_and_reset(batch_size))


def expected_rows(bound, prefixes, logits_rows):
    """The core's ShimLogitsProcessor on the same states and logits."""
    states = []
    for prefix in prefixes:
        state = bound.masker.new_state()
        for token in prefix:
            state.advance(token)
        states.append(state)
    core = ShimLogitsProcessor(states, bound.adjuster.controller)
    return core(torch.zeros((len(states), 1), dtype=torch.long), logits_rows.clone())


def same_distribution(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal rows up to a per-row constant (the core's processor may shift a row by one: the
    softmax removes it): the same -inf entries and the same log_softmax."""
    assert torch.equal(torch.isneginf(got), torch.isneginf(want))
    live = torch.isfinite(want).any(dim=-1)
    torch.testing.assert_close(torch.log_softmax(got[live], -1), torch.log_softmax(want[live], -1),
                               rtol=0, atol=1e-5)


# ---- request arguments -------------------------------------------------------------------------
def test_requests_without_shim_args_are_not_shim_requests():
    assert parse_request_args(None) is None
    assert parse_request_args({}) is None
    assert parse_request_args({"kv_transfer_params": {"x": 1}}) is None
    with pytest.raises(ShimRequestError, match="shim_controller"):
        parse_request_args({"shim_grammar": "g.lark"})
    with pytest.raises(ShimRequestError, match="shim_betaa"):
        parse_request_args({"shim_controller": "/x", "shim_betaa": 1})
    with pytest.raises(ShimRequestError, match="lm_only"):
        parse_request_args({"shim_controller": "/x", "shim_temperature": "cold"})


def test_validate_params_refuses_bad_artefacts_before_the_engine(binary5_dir, tmp_path):
    VllmShimLogitsProcessor.validate_params(shim_params(binary5_dir))  # intact: accepted
    VllmShimLogitsProcessor.validate_params(SamplingParams())  # plain request: accepted
    with pytest.raises(ValueError, match="no manifest.json"):
        VllmShimLogitsProcessor.validate_params(shim_params(tmp_path / "missing"))
    edited = tmp_path / "edited"
    shutil.copytree(binary5_dir, edited)
    manifest = json.loads((edited / "manifest.json").read_text())
    manifest["grammar_name"] = "bv4"
    (edited / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="manifest_sha256"):
        VllmShimLogitsProcessor.validate_params(shim_params(edited))
    other = tmp_path / "other.lark"
    other.write_text('start: "0" | "1"\n')
    with pytest.raises(ValueError, match="grammar_sha256"):
        VllmShimLogitsProcessor.validate_params(shim_params(binary5_dir,
                                                            shim_grammar=str(other)))


# ---- loading through vLLM's own machinery ---------------------------------------------------
def test_vllm_builds_it_from_the_fqcn(vllm_config, monkeypatch, binary5_dir):
    from importlib.metadata import entry_points

    from vllm.utils import torch_utils

    # without a GPU vLLM's platform is "unspecified" and claims pinned memory, which vLLM's
    # built-in MinTokens processor then fails to allocate; the CPU platform would say False
    monkeypatch.setattr(torch_utils, "PIN_MEMORY", False)

    # no entry point: vLLM would load it into every engine, and the V2 runner refuses V1 ones
    assert not [ep for ep in entry_points(group="vllm.logits_processors")
                if ep.value.startswith("shim_vllm")]
    procs = build_logitsprocs(vllm_config, CPU, False, False,
                              ["shim_vllm:VllmShimLogitsProcessor"])
    ours = [p for p in procs.non_argmax_invariant if isinstance(p, VllmShimLogitsProcessor)]
    assert len(ours) == 1
    assert not any(isinstance(p, VllmShimLogitsProcessor) for p in procs.argmax_invariant)
    # run the batch as vLLM does: every processor sees the update, then applies in order
    builder = BatchUpdateBuilder()
    builder.added.append((0, shim_params(binary5_dir), [1], []))
    builder.added.append((1, SamplingParams(), [1], []))
    update = builder.get_and_reset(2)
    for proc in procs.all:
        proc.update_state(update)
    logits = torch.randn(2, ours[0].bindings.vocab_size)
    out = logits.clone()
    for proc in procs.non_argmax_invariant:
        out = proc.apply(out)
    want = expected_rows(ours[0].rows[0].bound, [[]], logits[:1])
    same_distribution(out[:1], want)
    assert torch.equal(out[1], logits[1])


# ---- the batch: plain rows untouched, add / remove / move / swap ------------------------------
def test_plain_requests_pass_through_untouched(processor, binary5_dir):
    add(processor, 3, (0, SamplingParams(), []), (1, SamplingParams(extra_args={"a": 1}), []),
        (2, shim_params(binary5_dir), []))
    logits = torch.randn(3, processor.bindings.vocab_size)
    before = logits.clone()
    out = processor.apply(logits)
    assert torch.equal(out[:2], before[:2])
    assert torch.isneginf(out[2]).sum() > 0 and not torch.equal(out[2], before[2])
    assert sorted(processor.rows) == [2]


def test_add_remove_move_swap_follow_the_requests(processor, binary5_dir, bv4_dir):
    """After each update every row holds its own request's state, checked by its scores."""
    b5, bv = processor.bindings.bind(parse_request_args(shim_params(binary5_dir).extra_args)), \
        processor.bindings.bind(parse_request_args(shim_params(bv4_dir).extra_args))
    requests = {  # request -> (params, its live output list, binding)
        "a": (shim_params(binary5_dir), valid_prefix(b5.masker, 2, 0), b5),
        "b": (shim_params(bv4_dir), valid_prefix(bv.masker, 3, 1), bv),
        "c": (SamplingParams(), [5, 6], None),
        "d": (shim_params(binary5_dir), valid_prefix(b5.masker, 0, 2), b5),
        "e": (shim_params(bv4_dir), valid_prefix(bv.masker, 5, 3), bv),
    }
    slots: dict[int, str] = {}

    def check(batch_size: int) -> None:
        logits = torch.randn(batch_size, processor.bindings.vocab_size)
        out = processor.apply(logits.clone())
        assert sorted(processor.rows) == sorted(i for i, r in slots.items()
                                                if requests[r][2] is not None)
        for i in range(batch_size):
            name = slots.get(i)
            if name is None or requests[name][2] is None:
                assert torch.equal(out[i], logits[i]), f"row {i} ({name}) was touched"
                continue
            _, output_ids, bound = requests[name]
            assert processor.rows[i].output_ids is output_ids
            want = expected_rows(bound, [list(output_ids)], logits[i:i + 1])
            same_distribution(out[i:i + 1], want)

    def step(batch_size, removed=(), added=(), moved=()):
        builder = BatchUpdateBuilder()
        for i in removed:
            builder.removed_append(i)
            slots.pop(i)
        for i, name in added:
            params, output_ids, _ = requests[name]
            builder.added.append((i, params, [1, 2], output_ids))
            slots[i] = name
        for a, b, direction in moved:
            builder.moved.append((a, b, direction))
            name_a, name_b = slots.pop(a, None), slots.pop(b, None)
            if name_a is not None:
                slots[b] = name_a
            if direction == MoveDirectionality.SWAP and name_b is not None:
                slots[a] = name_b
        update = builder.get_and_reset(batch_size)
        assert isinstance(update, BatchUpdate)
        processor.update_state(update)
        check(batch_size)

    step(3, added=[(0, "a"), (1, "b"), (2, "c")])
    # the engine appends each request's sampled token to its own list between steps
    requests["a"][1].extend(valid_prefix(b5.masker, 3, 0)[2:3])
    processor.update_state(None)
    check(3)
    step(3, moved=[(0, 2, MoveDirectionality.SWAP)])  # a <-> c
    step(3, removed=[1], added=[(1, "d")])  # b leaves, d takes its slot
    step(2, removed=[0], moved=[(2, 0, MoveDirectionality.UNIDIRECTIONAL)])  # condense a -> 0
    step(3, added=[(2, "e")], moved=[(0, 1, MoveDirectionality.SWAP)])
    step(3, removed=[0, 2], added=[(0, "c")])  # a plain request replaces a SHIM row


def test_mixed_batch_equals_the_core_processor(processor, binary5_dir, bv4_dir):
    """Two controllers, several progress points each, in one apply: same scores as the core."""
    args5 = shim_params(binary5_dir)
    argsv = shim_params(bv4_dir)
    b5 = processor.bindings.bind(parse_request_args(args5.extra_args))
    bv = processor.bindings.bind(parse_request_args(argsv.extra_args))
    prefixes5 = [valid_prefix(b5.masker, n, seed) for seed, n in enumerate((0, 1, 3, 4))]
    prefixesv = [valid_prefix(bv.masker, n, 10 + seed) for seed, n in enumerate((0, 2, 6, 9))]
    layout = [("5", 0), ("v", 0), ("plain", None), ("5", 1), ("v", 1), ("5", 2), ("v", 2),
              ("5", 3), ("v", 3)]
    entries = []
    for i, (kind, k) in enumerate(layout):
        if kind == "plain":
            entries.append((i, SamplingParams(), []))
        else:
            entries.append((i, args5 if kind == "5" else argsv,
                            list((prefixes5 if kind == "5" else prefixesv)[k])))
    add(processor, len(layout), *entries)
    torch.manual_seed(0)
    logits = torch.randn(len(layout), processor.bindings.vocab_size)
    out = processor.apply(logits.clone())
    rows5 = [i for i, (kind, _) in enumerate(layout) if kind == "5"]
    rowsv = [i for i, (kind, _) in enumerate(layout) if kind == "v"]
    same_distribution(out[rows5], expected_rows(b5, prefixes5, logits[rows5]))
    same_distribution(out[rowsv], expected_rows(bv, prefixesv, logits[rowsv]))
    assert torch.equal(out[2], logits[2])
    # the correction is really there: masking alone gives other scores on some row
    masked = logits[rows5].masked_fill(torch.isneginf(out[rows5]), float("-inf"))
    assert not torch.allclose(masked, out[rows5])


# ---- temperature ----------------------------------------------------------------------------
def test_lm_only_mode_pre_multiplies_log_gamma_by_temperature(processor, binary5_dir):
    add(processor, 2, (0, shim_params(binary5_dir, temperature=0.5), []),
        (1, shim_params(binary5_dir, temperature=0.5, shim_temperature="lm_only"), []))
    logits = torch.randn(1, processor.bindings.vocab_size).repeat(2, 1)
    out = processor.apply(logits.clone())
    allowed = ~torch.isneginf(out[0])
    corr_default = (out[0] - logits[0])[allowed]
    corr_lm_only = (out[1] - logits[1])[allowed]
    assert corr_default.abs().max() > 0
    torch.testing.assert_close(corr_lm_only, corr_default * 0.5, rtol=1e-6, atol=1e-6)


# ---- failing closed, one request at a time ---------------------------------------------------
def only_token(row: torch.Tensor) -> list[int]:
    return torch.isfinite(row).nonzero().flatten().tolist()


def test_forbidden_token_stops_that_request_only(processor, binary5_dir, caplog):
    bound = processor.bindings.bind(parse_request_args(shim_params(binary5_dir).extra_args))
    state = bound.masker.new_state()
    forbidden = int(np.flatnonzero(~state.allowed_mask()[:len(bound.masker.tokenizer)])[0])
    add(processor, 3, (0, shim_params(binary5_dir), [forbidden]),
        (1, shim_params(binary5_dir), []), (2, SamplingParams(), []))
    logits = torch.randn(3, processor.bindings.vocab_size)
    with caplog.at_level(logging.ERROR, logger="shim_vllm"):
        out = processor.apply(logits.clone())
    eos = processor.rows[0].stop_token_id
    assert eos in bound.masker.eos_token_ids and only_token(out[0]) == [eos]
    assert f"token {forbidden}" in caplog.text and "batch row 0" in caplog.text
    same_distribution(out[1:2], expected_rows(bound, [[]], logits[1:2]))
    assert torch.equal(out[2], logits[2])
    # the core's strict path (SGLang's) still raises, naming the token
    with pytest.raises(ForbiddenTokenError, match=f"token {forbidden}"):
        apply_rows(logits.clone(), {0: RequestRow(state=bound.masker.new_state(), bound=bound,
                                                  output_ids=[forbidden])})


def test_dead_end_when_the_engines_mask_leaves_nothing(processor, binary5_dir, caplog):
    """vLLM's bitmask ran first and forbids every token SHIM's grammar allows."""
    add(processor, 2, (0, SamplingParams(), []), (1, shim_params(binary5_dir), []))
    bound = processor.rows[1].bound
    allowed = torch.from_numpy(bound.masker.new_state().allowed_mask())
    logits = torch.randn(2, processor.bindings.vocab_size)
    logits[1, allowed] = float("-inf")
    with caplog.at_level(logging.ERROR, logger="shim_vllm"):
        out = processor.apply(logits.clone())
    assert "DeadEndError" in caplog.text and "batch row 1" in caplog.text
    assert only_token(out[1]) == [processor.rows[1].stop_token_id]
    assert torch.equal(out[0], logits[0])


def test_async_placeholder_stops_that_request(processor, binary5_dir):
    add(processor, 1, (0, shim_params(binary5_dir), [-1]))
    out = processor.apply(torch.randn(1, processor.bindings.vocab_size))
    assert "placeholder" in processor.rows[0].fault.error
    assert only_token(out[0]) == [processor.rows[0].stop_token_id]


def test_an_artefact_damaged_after_admission_stops_only_its_request(processor, binary5_dir,
                                                                    tmp_path, caplog):
    damaged = tmp_path / "damaged"
    shutil.copytree(binary5_dir, damaged)
    VllmShimLogitsProcessor.validate_params(shim_params(damaged))  # admitted intact
    weights = damaged / "controller.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 3] ^= 0x40
    weights.write_bytes(bytes(data))
    with caplog.at_level(logging.ERROR, logger="shim_vllm"):
        add(processor, 2, (0, shim_params(damaged), []), (1, shim_params(binary5_dir), []))
        logits = torch.randn(2, processor.bindings.vocab_size)
        out = processor.apply(logits.clone())
    assert "sha256" in caplog.text and "batch row 0" in caplog.text
    assert only_token(out[0]) == [processor.rows[0].stop_token_id]
    same_distribution(out[1:], expected_rows(processor.rows[1].bound, [[]], logits[1:]))


def test_a_step_failure_stops_the_steps_shim_requests_not_the_engine(processor, binary5_dir,
                                                                      monkeypatch):
    add(processor, 2, (0, shim_params(binary5_dir), []), (1, SamplingParams(), []))

    def broken(logits, rows):
        raise RuntimeError("scoring failed")

    monkeypatch.setattr(processor_module, "apply_rows_failing_closed", broken)
    logits = torch.randn(2, processor.bindings.vocab_size)
    out = processor.apply(logits.clone())
    assert only_token(out[0]) == [processor.rows[0].stop_token_id]
    assert torch.equal(out[1], logits[1])
    assert "scoring failed" in processor.rows[0].fault.error


def test_finished_row_allows_only_eos(processor, binary5_dir):
    bound = processor.bindings.bind(parse_request_args(shim_params(binary5_dir).extra_args))
    state = bound.masker.new_state()
    tokens = []
    while not state.eos_allowed():
        token = int([t for t in state.allowed_token_ids()
                     if t not in bound.masker.eos_token_ids][0])
        state.advance(token)
        tokens.append(token)
    eos = min(bound.masker.eos_token_ids)
    add(processor, 1, (0, shim_params(binary5_dir), tokens + [eos, eos]))
    out = processor.apply(torch.randn(1, processor.bindings.vocab_size))
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [eos]


# ---- the artefact is checked against the engine's tokenizer -----------------------------------
def test_artefact_for_another_tokenizer_or_width_is_refused(processor, binary5_dir):
    args = parse_request_args(shim_params(binary5_dir).extra_args)
    engine_tok = processor.bindings.tokenizer
    wider = ControllerBindings(engine_tok, processor.bindings.vocab_size + 64)
    with pytest.raises(ManifestMismatchError, match="vocab_size"):
        wider.bind(args)
    from transformers import AutoTokenizer

    other = AutoTokenizer.from_pretrained(engine_tok.name_or_path, local_files_only=True)
    other.add_tokens(["<shim-extra-token>"])
    with pytest.raises(ManifestMismatchError, match="tokenizer_sha256"):
        ControllerBindings(other, processor.bindings.vocab_size).bind(args)


def test_vllms_sampler_divides_the_corrected_logits_by_temperature(processor, binary5_dir):
    """Through vLLM's own Sampler: processed logprobs are log_softmax((logits + log γ̂)/T) by
    default and log_softmax(logits/T + log γ̂) with shim_temperature="lm_only"."""
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.sample.sampler import Sampler

    T = 0.5
    add(processor, 3, (0, shim_params(binary5_dir, temperature=T), []),
        (1, shim_params(binary5_dir, temperature=T, shim_temperature="lm_only"), []),
        (2, SamplingParams(temperature=T), []))
    width = processor.bindings.vocab_size
    n = 3
    metadata = SamplingMetadata(
        temperature=torch.full((n,), T), all_greedy=False, all_random=True, top_p=None,
        top_k=None, generators={}, max_num_logprobs=width, no_penalties=True,
        prompt_token_ids=None, frequency_penalties=torch.zeros(n),
        presence_penalties=torch.zeros(n), repetition_penalties=torch.ones(n),
        output_token_ids=[[], [], []], allowed_token_ids_mask=None, bad_words_token_ids={},
        logitsprocs=LogitsProcessors([processor]))
    torch.manual_seed(0)
    logits = torch.randn(n, width)
    out = Sampler(logprobs_mode="processed_logprobs")(logits.clone(), metadata)
    tensors = out.logprobs_tensors
    got = torch.empty(n, width).scatter_(1, tensors.logprob_token_ids[:, 1:],
                                         tensors.logprobs[:, 1:])
    corrected = expected_rows(processor.rows[0].bound, [[], []], logits[:2])
    masked = logits[:2].masked_fill(torch.isneginf(corrected), float("-inf"))
    log_gamma = torch.where(torch.isneginf(corrected), 0.0, corrected - masked)
    want = torch.stack([torch.log_softmax(corrected[0] / T, -1),
                        torch.log_softmax(masked[1] / T + log_gamma[1], -1),
                        torch.log_softmax(logits[2] / T, -1)])
    assert torch.equal(torch.isneginf(got), torch.isneginf(want))
    finite = torch.isfinite(want)
    torch.testing.assert_close(got[finite], want[finite], rtol=1e-5, atol=1e-5)
    assert log_gamma.abs().max() > 0
