"""What a processor knows about the vLLM engine it serves: its bindings and its EOS.

Both processors and admission bind artefacts against the same engine facts: the tokenizer (by
content), the logits width and the served weights' digest (:mod:`shim_vllm.lm_identity`).
:class:`ServedEngine` resolves them lazily, at the first SHIM request, so a server that never
sees one never loads the tokenizer or hashes the weights.
"""

from __future__ import annotations

import threading
from typing import Any

from vllm.tokenizers import cached_tokenizer_from_config

from .binding import ControllerBindings
from .lm_identity import weights_revision

#: Per process: (id(tokenizer), logits width, served weights digest) -> bindings. The tokenizer
#: object is kept alive by its ControllerBindings, so its id is not reused while the key lives.
_BINDINGS: dict[tuple[int, int, str], ControllerBindings] = {}
_LOCK = threading.Lock()


def engine_bindings(model_config: Any, tokenizer: object) -> ControllerBindings:
    """The bindings for an engine serving ``model_config`` with ``tokenizer`` (one per process
    and engine), LM identity checked by the served weights' digest."""
    if tokenizer is None:
        raise ValueError("SHIM needs the engine's tokenizer, but the engine was started with "
                         "skip_tokenizer_init")
    revision = weights_revision(model_config.model, getattr(model_config, "revision", None))
    key = (id(tokenizer), int(model_config.get_vocab_size()), revision)
    with _LOCK:
        found = _BINDINGS.get(key)
        if found is None:
            found = _BINDINGS[key] = ControllerBindings(tokenizer, key[1], revision)
    return found


def engine_eos_token_ids(model_config: Any, tokenizer: object | None) -> list[int]:
    """The engine's EOS ids (tokenizer first, then the model config's): the token a failed
    request is stopped with when its own parameters name none."""
    ids: list[int] = []
    for source in (getattr(tokenizer, "eos_token_id", None),
                   getattr(getattr(model_config, "hf_config", None), "eos_token_id", None)):
        for token in source if isinstance(source, (list, tuple)) else [source]:
            if token is not None and int(token) not in ids:
                ids.append(int(token))
    return ids


class ServedEngine:
    """The engine of one processor instance: its bindings and EOS ids, resolved on first use."""

    def __init__(self, model_config: Any):
        self.model_config = model_config
        self._bindings: ControllerBindings | None = None
        self._eos: list[int] | None = None

    @property
    def bindings(self) -> ControllerBindings:
        if self._bindings is None:
            self._bindings = engine_bindings(self.model_config,
                                             cached_tokenizer_from_config(self.model_config))
        return self._bindings

    @property
    def eos_token_ids(self) -> list[int]:
        if self._eos is None:
            try:
                tokenizer = cached_tokenizer_from_config(self.model_config)
            except Exception:  # the model config's EOS still serves
                tokenizer = None
            self._eos = engine_eos_token_ids(self.model_config, tokenizer)
        return self._eos
