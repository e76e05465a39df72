"""SHIM as a logits processor of vLLM's V2 model runner
(``vllm.v1.worker.gpu.sample.logits_processor.LogitsProcessor``).

Load it with ``--logits-processors shim_vllm:VllmShimLogitsProcessorV2`` on an engine that runs
the V2 model runner (vLLM's default on GPUs since 0.32; ``VLLM_USE_V2_MODEL_RUNNER=1`` forces
it); the V1 runner takes :class:`shim_vllm.processor.VllmShimLogitsProcessor`. Requests opt in
exactly as there (``extra_args``, :mod:`shim_vllm.request_args`).

How it meets the V2 interface:

- **Slots.** ``add_request(slot, params)`` (re)initialises the slot entirely: a recycled slot
  never sees its previous occupant's state. Plain requests return False (vLLM then skips
  processing for batches without SHIM requests).
- **Rows are not requests.** Each logits row's slot is ``ctx.expanded_idx_mapping[row]``; when
  there are as many rows as requests (no drafts) it is ``ctx.idx_mapping_np[row]``, read
  without a device sync.
- **Committed tokens** are ``req_states.all_token_ids[slot, prompt_len:total_len]``: the
  slot's state advances from them at each ``apply`` (a resumed request's partial output too).
- **Speculative decoding.** A request's rows are contiguous; row j (``ctx.expanded_local_pos``)
  follows the draft tokens ``ctx.input_ids`` of its rows 1..j. Row j is masked and corrected by
  the slot's state forked and advanced along those drafts (:meth:`SlotState.draft_states`); a
  draft the grammar forbids is masked on the row before it, and every row after it allows
  nothing (the rejection sampler stops at that draft, so those rows are never sampled).
- **vLLM's grammar stage ran first**: SHIM keeps the intersection; a -inf token stays -inf.
  Temperature comes after, as in V1 (``shim_temperature``).
- **Faults.** Admission as in V1 (:mod:`shim_vllm.admission`); in the engine a failing request
  is stopped alone with EOS and logged (:mod:`shim_vllm.faults`).

Buffers: ``req_states.total_len`` and ``all_token_ids`` are device tensors (a V2
``StagedWriteTensor``'s ``.gpu``, which needs a GPU or vLLM's CPU runner to build); this class
reads only their ``.gpu`` tensor and ``prompt_len.np``, so anything with those attributes
serves in tests.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch
from vllm.sampling_params import SamplingParams
from vllm.v1.worker.gpu.sample.logits_processor.interface import (
    LogitsContext, LogitsProcessor, LogitsProcRequestState)

from shim_adapters.errors import DeadEndError

from .admission import validate_shim_params
from .binding import ControllerBindings
from .engine import ServedEngine
from .faults import RequestFault, report, stop_row, stop_token_of
from .request_args import parse_request_args
from .scoring import Target, score_rows
from .slots import SlotState

if TYPE_CHECKING:
    from vllm.config import VllmConfig


class VllmShimLogitsProcessorV2(LogitsProcessor):
    """Masks each SHIM request's rows (draft rows included) to its grammar and adds β·log γ̂."""

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        """Refuse a SHIM request that cannot run before it reaches the engine (HTTP 400)."""
        validate_shim_params(sampling_params)

    def __init__(self, vllm_config: "VllmConfig", req_states: LogitsProcRequestState) -> None:
        self.req_states = req_states
        self.engine = ServedEngine(vllm_config.model_config)
        self.slots: list[SlotState | None] = [None] * req_states.max_num_reqs
        #: slot -> holds a SHIM request (host array: the skip test needs no device sync)
        self.is_shim = np.zeros(req_states.max_num_reqs, dtype=bool)

    @property
    def bindings(self) -> ControllerBindings:
        """The engine's bindings (tokenizer and weights resolved at the first SHIM request)."""
        return self.engine.bindings

    # ---- requests ---------------------------------------------------------------------------
    def add_request(self, req_idx: int, sampling_params: SamplingParams) -> bool:
        self.slots[req_idx] = None
        self.is_shim[req_idx] = False
        width = int(self.req_states.vocab_size)
        where = f"slot {req_idx}"
        try:
            args = parse_request_args(sampling_params.extra_args)
        except ValueError as exc:  # admission refuses these; a direct engine caller may not
            self._fail_slot(req_idx, sampling_params, exc, "<malformed extra_args>", where)
            return True
        if args is None:
            return False
        try:
            bound = self.bindings.bind(args)
        except Exception as exc:  # the artefact changed since admission, or was never checked
            self._fail_slot(req_idx, sampling_params, exc, args.controller, where)
            return True
        self.slots[req_idx] = SlotState(
            state=bound.masker.new_state(), bound=bound,
            temperature=float(sampling_params.temperature),
            temperature_mode=args.temperature_mode,
            stop_token_id=stop_token_of([sampling_params.eos_token_id,
                                         *sorted(bound.masker.eos_token_ids),
                                         *sorted(sampling_params.all_stop_token_ids)], width),
            controller=str(args.controller))
        self.is_shim[req_idx] = True
        return True

    def _fail_slot(self, slot: int, params: SamplingParams, exc: BaseException,
                   controller: object, where: str) -> None:
        fault = RequestFault.of(exc, controller)
        report(fault, where)
        self.slots[slot] = SlotState(
            state=None, bound=None, fault=fault, controller=str(controller),
            stop_token_id=stop_token_of([params.eos_token_id, *sorted(params.all_stop_token_ids),
                                         *self.engine.eos_token_ids],
                                        int(self.req_states.vocab_size)))
        self.is_shim[slot] = True

    # ---- one step ---------------------------------------------------------------------------
    def apply(self, logits: torch.Tensor, ctx: LogitsContext) -> torch.Tensor:
        batch_slots = ctx.idx_mapping_np
        if not self.is_shim[batch_slots].any():
            return logits
        try:
            return self._apply(logits, ctx)
        except Exception as exc:  # not one request's fault: stop this step's SHIM requests only
            row_slots = (batch_slots.tolist() if int(logits.shape[0]) == len(batch_slots)
                         else ctx.expanded_idx_mapping.tolist())
            for row, slot in enumerate(row_slots):
                if self.is_shim[slot]:
                    self.slots[slot].fail(exc, f"slot {slot} (row {row}, whole step)")
                    stop_row(logits, row, self.slots[slot].stop_token_id)
            return logits

    def _apply(self, logits: torch.Tensor, ctx: LogitsContext) -> torch.Tensor:
        batch_slots = ctx.idx_mapping_np
        num_rows = int(logits.shape[0])
        if num_rows == len(batch_slots):  # one row per request, in batch order: no drafts
            row_slots = batch_slots.tolist()
            local_pos = input_ids = None
        else:
            row_slots = ctx.expanded_idx_mapping.tolist()
            local_pos = ctx.expanded_local_pos.tolist()
            input_ids = ctx.input_ids.tolist()
        self._sync(sorted({s for s in row_slots if self.is_shim[s]}))

        targets: list[Target] = []
        draft_row: list[bool] = []
        chains: dict[int, list] = {}
        for row, slot in enumerate(row_slots):
            entry = self.slots[slot] if self.is_shim[slot] else None
            if entry is None or entry.fault is not None:
                continue
            j = 0 if local_pos is None else local_pos[row]
            if j == 0:
                state = entry.state
            else:
                chain = chains.get(slot)
                if chain is None:
                    first = row - j
                    last = first
                    while last + 1 < num_rows and row_slots[last + 1] == slot and \
                            local_pos[last + 1] == last + 1 - first:
                        last += 1
                    chain = chains[slot] = entry.draft_states(input_ids[first + 1:last + 1])
                state = chain[j - 1]
            targets.append(Target(row, state, entry.bound, entry.gamma_scale))
            draft_row.append(j > 0)

        for pos, exc in score_rows(logits, targets).items():
            row = targets[pos].row
            if draft_row[pos] and isinstance(exc, DeadEndError):
                logits[row].fill_(float("-inf"))  # a dead draft prefix: nothing allowed
            else:
                self.slots[row_slots[row]].fail(exc, f"slot {row_slots[row]} (row {row})")
        for row, slot in enumerate(row_slots):
            entry = self.slots[slot] if self.is_shim[slot] else None
            if entry is not None and entry.fault is not None:
                stop_row(logits, row, entry.stop_token_id)
        return logits

    def _sync(self, slots: Sequence[int]) -> None:
        """Advance each live SHIM slot's state to its committed output (one gather of the new
        token ids for all of them)."""
        live = [s for s in slots if self.slots[s].fault is None]
        if not live:
            return
        rs = self.req_states
        device = rs.total_len.gpu.device
        index = torch.as_tensor(live, device=device, dtype=torch.long)
        prompts = rs.prompt_len.np[live].tolist()
        lengths = [int(t) - int(p) for t, p in zip(rs.total_len.gpu[index].tolist(), prompts)]
        entries = [self.slots[s] for s in live]
        for entry, n in zip(entries, lengths):
            if n < entry.consumed:  # the output restarted
                entry.restart()
        counts = [n - entry.consumed for entry, n in zip(entries, lengths)]
        widest = max(counts)
        if widest <= 0:
            return
        columns = (torch.as_tensor([p + e.consumed for p, e in zip(prompts, entries)],
                                   device=device, dtype=torch.long)[:, None]
                   + torch.arange(widest, device=device))
        columns.clamp_(max=rs.all_token_ids.gpu.shape[1] - 1)
        tokens = rs.all_token_ids.gpu[index[:, None], columns].tolist()
        for slot, entry, count, row in zip(live, entries, counts, tokens):
            try:
                entry.commit(row[:count])
            except Exception as exc:  # a committed token the grammar forbids: this request only
                entry.fail(exc, f"slot {slot}")
