"""SHIM on top of SynCode's own ``SyncodeLogitsProcessor``.

``with_shim(syncode_processor, controller)`` returns a processor with the same call signature:
SynCode still masks, and SHIM adds β·log γ̂ to the tokens SynCode allows.

Where the features come from: states rebuilt through this plugin, one
:class:`~shim_syncode.masker.SyncodeMaskerState` per row over the same Lark grammar and
tokenizer, fed the same tokens. SynCode's processor keeps no per-row parser state to read: one
``IncrementalParser`` serves every row and re-lexes each row's whole output per step, so after
its call the parser holds the last row's state only. The rebuilt states give the readout the
controller was trained with (LALR stack, terminal DFA states, remainder), and they double as a
sound second check of SynCode's mask: a token SynCode allows but the grammar forbids (SynCode
falls back to unconstrained decoding when its parse fails) raises instead of being sampled.

Refused at wrap time: ``mode='grammar_mask'`` (over-approximates, i.e. allows invalid tokens,
and then stops constraining) and ``parse_output_only=False`` (parses the prompt as part of the
output). The grammar is read from the processor itself (its Lark text) and checked against the
controller's manifest by sha256.
"""

from __future__ import annotations

import warnings
from typing import Any, Mapping

import torch

from shim_adapters.grammars.grammar import Grammar
from shim_adapters.integrations.hf import (
    ControllerLike,
    ShimWarning,
    ShimWrapper,
    bind_controller,
    controller_manifest,
)

from .masker import SyncodeMasker


class ShimSyncodeProcessor(ShimWrapper):
    """SynCode's processor, then SHIM over the tokens it allows."""

    def __init__(self, syncode_processor, masker: SyncodeMasker, controller, *,
                 batch_size: int | None = None):
        super().__init__(masker, controller, batch_size=batch_size, backend=self._call_inner)
        self.inner = syncode_processor
        self._warned_tabs: set[int] = set()

    def _call_inner(self, input_ids: torch.LongTensor, scores: torch.FloatTensor
                    ) -> torch.FloatTensor:
        return self.inner(input_ids, scores)

    def _reset_backend(self) -> None:
        self.inner.reset()

    def _mask_known_overreach(self, extra: torch.Tensor) -> None:
        """SynCode's store checks tokens with each tab read as four spaces (an indentation
        shortcut), so it allows a raw tab inside a JSON string; the plugin decides tab tokens
        on their real bytes. Those are masked with one warning, never sampled."""
        tabs = torch.from_numpy(self.masker.compiled.tab_tokens).to(extra.device)
        n = len(tabs)
        hit = extra[:, :n] & tabs
        if not bool(hit.any()):
            return
        extra[:, :n] &= ~tabs
        ids = sorted(set(torch.nonzero(hit)[:, 1].tolist()) - self._warned_tabs)
        if ids:
            self._warned_tabs.update(ids)
            shown = ", ".join(f"{t} ({self.masker.token_text(t)!r})" for t in ids[:8])
            warnings.warn(f"SynCode's processor allows tab token(s) {shown} that the grammar "
                          f"forbids (its mask store reads a tab as four spaces); they are "
                          f"masked", ShimWarning, stacklevel=4)


def _processor_grammar(syncode_processor, manifest: Mapping[str, Any]) -> Grammar:
    engine = syncode_processor.grammar_engine
    text = engine.grammar.ebnf
    if not isinstance(text, str) or not text.strip():
        raise ValueError("the SynCode processor's grammar has no Lark text (grammar.ebnf)")
    return Grammar(text=text, format="lark", name=str(manifest.get("grammar_name") or
                                                      engine.grammar.name))


def with_shim(syncode_processor, controller: ControllerLike, *,
              manifest: Mapping[str, Any] | None = None, lm=None, vocab_size: int | None = None,
              batch_size: int | None = None) -> ShimSyncodeProcessor:
    """Wrap ``syncode.SyncodeLogitsProcessor`` so that SHIM re-weights its allowed tokens.

    ``vocab_size``: the model's logit width (default: the one in the controller's manifest;
    checked against the logits at the first call). ``batch_size`` (prompts x
    num_return_sequences) makes beam search fail at the first call; without it, at the first
    reordering of rows. Raises ManifestMismatchError for a controller fitted for another
    backend, grammar or tokenizer; ValueError for grammar_mask mode or parse_output_only=False.
    """
    from ._syncode_import import syncode_modules

    syncode_modules()  # import SynCode with the host's logging preserved
    from syncode.grammar_mask.logits_processor import SyncodeLogitsProcessor

    if not isinstance(syncode_processor, SyncodeLogitsProcessor):
        raise TypeError(f"expected syncode's SyncodeLogitsProcessor, got "
                        f"{type(syncode_processor).__name__}")
    engine = syncode_processor.grammar_engine
    mode = getattr(engine.dfa_mask_store, "_mode", None)
    if mode != "grammar_strict":
        raise ValueError(f"SyncodeLogitsProcessor(mode={mode!r}) is not supported: grammar_mask "
                         f"allows invalid tokens and then stops constraining; build it with "
                         f"mode='grammar_strict'")
    if not engine.parse_output_only:
        raise ValueError("SyncodeLogitsProcessor(parse_output_only=False) parses the prompt as "
                         "part of the output; build it with parse_output_only=True")
    found = controller_manifest(controller, manifest)
    width = int(vocab_size if vocab_size is not None else found["vocab_size"])
    masker = SyncodeMasker(_processor_grammar(syncode_processor, found),
                           syncode_processor.tokenizer, width)
    fitted = bind_controller(controller, masker, manifest=manifest, lm=lm)
    return ShimSyncodeProcessor(syncode_processor, masker, fitted, batch_size=batch_size)


__all__ = ("ShimSyncodeProcessor", "with_shim")
