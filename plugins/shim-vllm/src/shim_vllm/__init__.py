"""SHIM in vLLM: a logits processor per model runner, configured per request through
``extra_args``.

``--logits-processors shim_vllm:VllmShimLogitsProcessor`` on vLLM's V1 model runner,
``--logits-processors shim_vllm:VllmShimLogitsProcessorV2`` on the V2 runner (the default on
GPUs since vLLM 0.32). No ``vllm.logits_processors`` entry point is registered: vLLM loads every
installed one into every engine, and each runner refuses the other's interface, so an entry
point for either class would stop the other runner from starting. The processor classes are
imported lazily so that the engine-neutral modules (:mod:`shim_vllm.request_args`,
:mod:`shim_vllm.binding`, :mod:`shim_vllm.scoring`, :mod:`shim_vllm.rows`,
:mod:`shim_vllm.slots`, :mod:`shim_vllm.faults`) import without vLLM.
"""

from __future__ import annotations

__version__ = "0.2.0"
__all__ = ["VllmShimLogitsProcessor", "VllmShimLogitsProcessorV2"]


def __getattr__(name: str):
    if name == "VllmShimLogitsProcessor":
        from .processor import VllmShimLogitsProcessor

        return VllmShimLogitsProcessor
    if name == "VllmShimLogitsProcessorV2":
        from .processor_v2 import VllmShimLogitsProcessorV2

        return VllmShimLogitsProcessorV2
    raise AttributeError(f"module 'shim_vllm' has no attribute {name!r}")
