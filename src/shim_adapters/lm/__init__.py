"""The LM layer: loading a model, prompting it and sampling from it under a mask.

:mod:`.loading` (the shipped LM, Hugging Face directories, GGUF), :mod:`.prompting` (chat
templates, where one-line answers end), :mod:`.sampling` (the one batched sampling engine used
by fitting, evaluation and ``shim sample``), :mod:`.generation` (the masked transformers
``LogitsProcessor``, fail-closed dead ends) and :mod:`.views` (views of a model the sampling
engine needs: stop tokens folded, shared-prefix attention).

Layer: imports the mask layer and below; knows nothing of SHIM's controllers.
"""

from shim_adapters.lm.loading import (
                                      DEFAULT_IDENTIFIER,
                                      DEFAULT_SPECS,
                                      LoadedLM,
                                      default_lm_path,
                                      eos_token_ids,
                                      load_lm,
)

__all__ = ["DEFAULT_IDENTIFIER", "DEFAULT_SPECS", "LoadedLM", "default_lm_path", "eos_token_ids",
           "load_lm"]
