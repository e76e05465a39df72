"""SHIM in vLLM's V1 engine: a logits processor configured per request through ``extra_args``.

``vllm serve MODEL --logits-processors shim_vllm:VllmShimLogitsProcessor`` (or install this
distribution: it registers the ``vllm.logits_processors`` entry point ``shim``). The processor
class is imported lazily so that the engine-neutral parts (:mod:`shim_vllm.request_args`,
:mod:`shim_vllm.binding`, :mod:`shim_vllm.rows`) import without vLLM.
"""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["VllmShimLogitsProcessor"]


def __getattr__(name: str):
    if name == "VllmShimLogitsProcessor":
        from .processor import VllmShimLogitsProcessor

        return VllmShimLogitsProcessor
    raise AttributeError(f"module 'shim_vllm' has no attribute {name!r}")
