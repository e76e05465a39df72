"""SHIM as an SGLang custom logit processor (``sglang.srt.sampling.custom_logit_processor``).

Start the server with ``--enable-custom-logit-processor``; a request opts in by sending
``custom_logit_processor=SglangShimLogitProcessor.to_str()`` and
``sampling_params.custom_params={"shim_controller": DIR, ...}`` (the keys of
:mod:`shim_vllm.request_args`). SGLang serialises the class with dill *by reference* (module
and name), so the server must have this distribution installed; nothing user-supplied is
unpickled beyond that reference.

SGLang builds a fresh processor instance per batch and hands it the logits rows of the requests
that named it, with each request's ``custom_params`` plus ``"__req__"`` (a weak proxy to the
``Req``). Per-request state therefore lives in a module-level registry keyed by the request id;
a row whose request died (the proxy is gone) is dropped at the next call. States advance from
``req.output_ids``; if SGLang retracted the request and its output restarted, the state
restarts too. Masking and correction are :func:`shim_vllm.rows.apply_rows`, the same code and
arithmetic as the vLLM processor. Like vLLM, SGLang applies its grammar vocab mask before and
temperature after custom processors: the same ``shim_temperature`` modes apply.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
from sglang.srt.sampling.custom_logit_processor import CustomLogitProcessor

from shim_vllm.binding import ControllerBindings
from shim_vllm.request_args import ShimRequestError, parse_request_args
from shim_vllm.rows import RequestRow, apply_rows

REQ_KEY = "__req__"


class _Registry:
    """Process-wide: bound controllers per (tokenizer, logits width), rows per request id."""

    def __init__(self) -> None:
        self.bindings: dict[tuple[int, int], ControllerBindings] = {}
        self.rows: dict[str, tuple[Any, RequestRow]] = {}

    def bindings_for(self, tokenizer: object, width: int) -> ControllerBindings:
        key = (id(tokenizer), width)
        found = self.bindings.get(key)
        if found is None:
            found = self.bindings[key] = ControllerBindings(tokenizer, width)
        return found

    def sweep(self) -> None:
        for rid, (req, _) in list(self.rows.items()):
            try:
                finished = req.finished()
            except ReferenceError:  # the Req is gone
                finished = True
            if finished:
                del self.rows[rid]


REGISTRY = _Registry()


class SglangShimLogitProcessor(CustomLogitProcessor):
    """Masks each SHIM request's row to its grammar and adds β·log γ̂ to the allowed tokens."""

    def __call__(self, logits: torch.Tensor,
                 custom_param_list: Optional[List[Dict[str, Any]]] = None) -> torch.Tensor:
        if not custom_param_list:
            return logits
        REGISTRY.sweep()
        rows: dict[int, RequestRow] = {}
        seen: set[str] = set()
        for i, params in enumerate(custom_param_list):
            if not params:
                continue
            args = parse_request_args({k: v for k, v in params.items() if k != REQ_KEY})
            if args is None:
                continue
            req = params.get(REQ_KEY)
            if req is None:
                raise ShimRequestError("custom_params carry no '__req__': this SGLang build "
                                       "does not hand requests to custom logit processors")
            if req.rid in seen:
                raise ShimRequestError(f"request {req.rid} appears in several rows (speculative "
                                       f"decoding): SHIM needs one token per request per step")
            seen.add(req.rid)
            rows[i] = self._row(req, args, int(logits.shape[-1]))
        return apply_rows(logits, rows)

    @staticmethod
    def _row(req: Any, args, width: int) -> RequestRow:
        found = REGISTRY.rows.get(req.rid)
        if found is not None:
            row = found[1]
            row.output_ids = req.output_ids  # SGLang may replace the array (retraction)
            if len(row.output_ids) < len(row.state.token_ids):  # output restarted
                row.state = row.bound.masker.new_state()
            return row
        if req.tokenizer is None:
            raise ShimRequestError(f"request {req.rid}: SHIM needs the engine's tokenizer, but "
                                   f"the server runs with skip_tokenizer_init")
        bound = REGISTRY.bindings_for(req.tokenizer, width).bind(args)
        row = RequestRow(state=bound.masker.new_state(), bound=bound, output_ids=req.output_ids,
                         temperature=float(req.sampling_params.temperature),
                         temperature_mode=args.temperature_mode)
        REGISTRY.rows[req.rid] = (req, row)
        return row
