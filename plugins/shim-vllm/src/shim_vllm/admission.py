"""Admission: a SHIM request that cannot run is refused before it reaches the engine (HTTP 400).

vLLM calls a processor class's ``validate_params(sampling_params)`` in the frontend process at
admission (V1 and V2 runners alike), with the request's parameters only. The checks that need
the engine (its tokenizer, logits width and served weights) get them from vLLM's
:class:`~vllm.v1.engine.input_processor.InputProcessor` that is admitting the request: both
runners call the validator from ``InputProcessor._validate_params``, so it is on the call stack
(:func:`admitting_input_processor`). With it, admission binds the artefact exactly as the engine
will (:class:`shim_vllm.binding.ControllerBindings`: manifest, weights size and sha256, the
engine's tokenizer by content, logits width, the served weights' digest against
``lm_revision``, the grammar's sha256 and its compilation) and caches the binding on the
artefact's content, so the next request naming the same unchanged artefact costs a few
``stat`` calls. Without it (``validate_params`` called outside vLLM's admission), only the
engine-free checks run (:func:`shim_vllm.binding.check_request`); the engine's own binding
checks the rest, and a failure there stops only that request (:mod:`shim_vllm.faults`).
"""

from __future__ import annotations

import sys

from vllm.sampling_params import SamplingParams
from vllm.v1.engine.input_processor import InputProcessor

from .binding import check_request
from .engine import engine_bindings
from .request_args import parse_request_args

#: How far up the stack the admitting InputProcessor may be (it is 2-3 frames up in vLLM 0.32).
MAX_DEPTH = 16

def admitting_input_processor() -> InputProcessor | None:
    """The vLLM InputProcessor whose admission of a request is running, if any."""
    frame = sys._getframe(1)
    for _ in range(MAX_DEPTH):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if isinstance(owner, InputProcessor):
            return owner
        frame = frame.f_back
    return None


def validate_shim_params(params: SamplingParams) -> None:
    """Raise ``ValueError`` (vLLM: HTTP 400) naming the problem if a SHIM request cannot run."""
    args = parse_request_args(params.extra_args)  # ShimRequestError is a ValueError
    if args is None:
        return
    processor = admitting_input_processor()
    try:
        if processor is None:
            check_request(args)
        else:
            engine_bindings(processor.model_config, processor.tokenizer).bind(args)
    except Exception as exc:  # the artefact, grammar or engine mismatch is the request's fault
        raise ValueError(f"SHIM request refused: {exc}") from exc
