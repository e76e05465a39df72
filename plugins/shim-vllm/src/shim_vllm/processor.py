"""SHIM as a vLLM V1 logits processor (``vllm.v1.sample.logits_processor.LogitsProcessor``).

Load it with ``vllm serve MODEL --logits-processors shim_vllm:VllmShimLogitsProcessor`` (or just
install this distribution: it registers the ``vllm.logits_processors`` entry point ``shim``).
A request opts in with ``SamplingParams(extra_args={"shim_controller": DIR, ...})`` (see
:mod:`shim_vllm.request_args`); every other request passes through untouched.

What it does about vLLM's own pipeline (vLLM 0.33, V1 engine):

- **Grammar bitmask first.** vLLM applies its structured-output bitmask before custom
  processors, and never exposes its matcher. This processor keeps its own ``MaskerState`` per
  request, advanced from the request's output tokens, and masks with it; so a SHIM request needs
  no ``structured_outputs``. If a request sets both, the row keeps the intersection of the two
  allowed sets (-inf stays -inf), and a row the intersection leaves empty fails closed with
  :class:`~shim_adapters.errors.DeadEndError`.
- **Temperature after.** vLLM divides the processed logits by T after custom processors, so
  by default log γ̂ is divided by T too, on purpose: temperature then tempers the corrected
  next-token distribution exactly as it tempers the LM's. ``shim_temperature="lm_only"``
  multiplies log γ̂ by T first, so it reaches the sampler unscaled. At T = 1 they agree.
- **Async scheduling.** vLLM fills in the previous step's sampled token just before sampling,
  after ``update_state``; so states advance in :meth:`apply`, not in :meth:`update_state`.

A dead end, a token the state forbids, or an artefact that does not match the engine's
tokenizer raises (naming the request's row and state); vLLM 0.33 has no per-request error path
for logits processors, so the engine step fails rather than emit an unconstrained token.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import (BatchUpdate, LogitsProcessor,
                                             MoveDirectionality)

from .binding import ControllerBindings, check_request
from .request_args import parse_request_args
from .rows import RequestRow, apply_rows

if TYPE_CHECKING:
    from vllm.config import VllmConfig


#: The engine whose SHIM rows an instance serves: id(vllm_config) -> (config, processor), weak.
_SERVING: dict[int, tuple[weakref.ref, weakref.ref]] = {}


def _first_for_engine(vllm_config: object, processor: object) -> bool:
    """True for the first instance built for this engine config; later ones stay passive.

    vLLM builds one instance from the installed entry point and another from
    ``--logits-processors`` when both name this class; two active instances would add
    β·log γ̂ twice.
    """
    key = id(vllm_config)
    found = _SERVING.get(key)
    if found is not None and found[0]() is vllm_config and found[1]() is not None:
        return False
    try:
        _SERVING[key] = (weakref.ref(vllm_config), weakref.ref(processor))
    except TypeError:  # a config that cannot be weakly referenced: no de-duplication
        pass
    return True


class VllmShimLogitsProcessor(LogitsProcessor):
    """Masks each SHIM request's row to its grammar and adds β·log γ̂ to the allowed tokens."""

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        """Refuse a malformed SHIM request before it reaches the engine (HTTP 400)."""
        args = parse_request_args(sampling_params.extra_args)
        if args is not None:
            try:
                check_request(args)
            except Exception as exc:  # an artefact or grammar problem is the request's fault
                raise ValueError(f"SHIM request refused: {exc}") from exc

    def __init__(self, vllm_config: "VllmConfig", device: torch.device,
                 is_pin_memory: bool) -> None:
        self._model_config = vllm_config.model_config
        self._bindings: ControllerBindings | None = None
        self.rows: dict[int, RequestRow] = {}
        #: False for a second instance in the same engine (entry point and --logits-processors)
        self.active = _first_for_engine(vllm_config, self)

    def is_argmax_invariant(self) -> bool:
        return False  # masking and γ̂ both change the argmax

    @property
    def bindings(self) -> ControllerBindings:
        """Created at the first SHIM request: servers without one never load the tokenizer."""
        if self._bindings is None:
            from vllm.tokenizers import cached_tokenizer_from_config

            tokenizer = cached_tokenizer_from_config(self._model_config)
            if tokenizer is None:
                raise ValueError("SHIM needs the engine's tokenizer, but the engine was "
                                 "started with skip_tokenizer_init")
            self._bindings = ControllerBindings(tokenizer, self._model_config.get_vocab_size())
        return self._bindings

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """Apply the batch's removed, added, then moved rows (vLLM's documented order)."""
        if batch_update is None or not self.active:
            return
        for index in batch_update.removed:
            self.rows.pop(index, None)
        for index, params, _prompt_ids, output_ids in batch_update.added:
            row = self._new_row(params, output_ids)
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

    def _new_row(self, params: SamplingParams, output_ids: list[int]) -> RequestRow | None:
        args = parse_request_args(params.extra_args)
        if args is None:
            return None
        bound = self.bindings.bind(args)
        return RequestRow(state=bound.masker.new_state(), bound=bound, output_ids=output_ids,
                          temperature=float(params.temperature),
                          temperature_mode=args.temperature_mode)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return apply_rows(logits, self.rows) if self.active else logits
