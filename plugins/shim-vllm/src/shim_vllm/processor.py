"""SHIM as a logits processor of vLLM's V1 model runner (``vllm.v1.sample.logits_processor``).

Load it with ``--logits-processors shim_vllm:VllmShimLogitsProcessor`` on an engine that runs
the V1 model runner (``VLLM_USE_V2_MODEL_RUNNER=0``, or where vLLM falls back to it); the V2
runner takes :class:`shim_vllm.processor_v2.VllmShimLogitsProcessorV2`. A request opts in with
``SamplingParams(extra_args={"shim_controller": DIR, ...})`` (see
:mod:`shim_vllm.request_args`); every other request passes through untouched.

What it does about vLLM's own pipeline (V1 runner):

- **Grammar bitmask first.** vLLM applies its structured-output bitmask before custom
  processors, and never exposes its matcher. This processor keeps its own ``MaskerState`` per
  request, advanced from the request's output tokens, and masks with it; so a SHIM request needs
  no ``structured_outputs``. If a request sets both, the row keeps the intersection of the two
  allowed sets (-inf stays -inf).
- **Temperature after.** vLLM divides the processed logits by T after custom processors, so
  by default log γ̂ is divided by T too, on purpose: temperature then tempers the corrected
  next-token distribution exactly as it tempers the LM's. ``shim_temperature="lm_only"``
  multiplies log γ̂ by T first, so it reaches the sampler unscaled. At T = 1 they agree.
- **Async scheduling.** vLLM fills in the previous step's sampled token just before sampling,
  after ``update_state``; so states advance in :meth:`apply`, not in :meth:`update_state`.
- **Faults.** ``validate_params`` refuses at admission what can be checked
  (:mod:`shim_vllm.admission`). A request that still fails in the engine (binding, a token the
  state forbids, a dead end, the controller) is stopped alone with EOS and logged
  (:mod:`shim_vllm.faults`); the engine and the other requests go on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import (BatchUpdate, LogitsProcessor,
                                             MoveDirectionality)

from .admission import validate_shim_params
from .binding import ControllerBindings
from .engine import ServedEngine
from .faults import RequestFault, report, stop_row, stop_token_of
from .request_args import parse_request_args
from .rows import RequestRow, apply_rows_failing_closed

if TYPE_CHECKING:
    from vllm.config import VllmConfig


class VllmShimLogitsProcessor(LogitsProcessor):
    """Masks each SHIM request's row to its grammar and adds β·log γ̂ to the allowed tokens."""

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        """Refuse a SHIM request that cannot run before it reaches the engine (HTTP 400)."""
        validate_shim_params(sampling_params)

    def __init__(self, vllm_config: "VllmConfig", device: torch.device,
                 is_pin_memory: bool) -> None:
        self.engine = ServedEngine(vllm_config.model_config)
        self.rows: dict[int, RequestRow] = {}

    def is_argmax_invariant(self) -> bool:
        return False  # masking and γ̂ both change the argmax

    @property
    def bindings(self) -> ControllerBindings:
        """The engine's bindings (tokenizer and weights resolved at the first SHIM request)."""
        return self.engine.bindings

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """Apply the batch's removed, added, then moved rows (vLLM's documented order)."""
        if batch_update is None:
            return
        for index in batch_update.removed:
            self.rows.pop(index, None)
        for index, params, _prompt_ids, output_ids in batch_update.added:
            row = self._new_row(index, params, output_ids)
            if row is None:
                self.rows.pop(index, None)  # a plain request took over this slot
            else:
                self.rows[index] = row
        for a, b, direction in batch_update.moved:
            row_a = self.rows.pop(a, None)
            row_b = self.rows.pop(b, None)
            if row_a is not None:
                self.rows[b] = row_a
            if direction == MoveDirectionality.SWAP and row_b is not None:
                self.rows[a] = row_b

    def _new_row(self, index: int, params: SamplingParams, output_ids: list[int]
                 ) -> RequestRow | None:
        try:
            args = parse_request_args(params.extra_args)
        except ValueError as exc:  # admission refuses these; a direct engine caller may not
            return self._failed_row(index, params, output_ids, exc, "<malformed extra_args>")
        if args is None:
            return None
        try:
            bound = self.bindings.bind(args)
        except Exception as exc:  # the artefact changed since admission, or was never checked
            return self._failed_row(index, params, output_ids, exc, args.controller)
        width = self.engine.model_config.get_vocab_size()
        return RequestRow(state=bound.masker.new_state(), bound=bound, output_ids=output_ids,
                          temperature=float(params.temperature),
                          temperature_mode=args.temperature_mode,
                          stop_token_id=stop_token_of(
                              [params.eos_token_id, *sorted(bound.masker.eos_token_ids),
                               *sorted(params.all_stop_token_ids)], width),
                          controller=str(args.controller))

    def _failed_row(self, index: int, params: SamplingParams, output_ids: list[int],
                    exc: BaseException, controller: object) -> RequestRow:
        fault = RequestFault.of(exc, controller)
        report(fault, f"batch row {index}")
        width = self.engine.model_config.get_vocab_size()
        return RequestRow(state=None, bound=None, output_ids=output_ids, fault=fault,
                          stop_token_id=stop_token_of(
                              [params.eos_token_id, *sorted(params.all_stop_token_ids),
                               *self.engine.eos_token_ids], width),
                          controller=str(controller))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        try:
            return apply_rows_failing_closed(logits, self.rows)
        except Exception as exc:  # not one request's fault: stop this step's SHIM requests only
            for index, row in self.rows.items():
                row.fail(exc, f"batch row {index} (whole step)")
                stop_row(logits, index, row.stop_token_id)
            return logits
