"""SHIM on top of XGrammar's own ``xgrammar.contrib.hf.LogitsProcessor``.

``with_shim(xgr_processor, controller, tokenizer=tok)`` returns a processor with the same call
signature: the tokens allowed are those of the processor's own compiled grammar, and SHIM adds
β·log γ̂ to them.

How: ``with_shim`` checks, once, that every compiled grammar of the processor is the one the
controller was fitted on (printed rules and tokenizer info equal to the masker's; the
controller's features name Earley items by rule id, so anything else is refused). Each row's
state is then the plugin's :class:`~shim_xgrammar.masker.XGrammarState` over an XGrammar
``GrammarMatcher`` of the processor's own ``CompiledGrammar`` for that row: the mask is
XGrammar's fill of that grammar, with the masker's fix-ups (control tokens, logit padding, EOS
exactly where the matcher completes, the byte guards of ``byte_guards.py``), and the features
are read from the matcher that masks. The processor itself is not called: it would advance a
second set of matchers of the same grammar on the same tokens, which earlier versions of this
wrapper did (and compared the two masks word by word) at 1.04-1.21x the end-to-end time of
XGrammar's processor alone with the shipped LM (``benchmarks/gamma_mask_cost.md``).

XGrammar's processor is single-use (it keeps its matchers after ``generate``), so a processor
that has already run is refused; ``reset()`` starts fresh matchers over the same compiled
grammars.
"""

from __future__ import annotations

import warnings
from typing import Any, Mapping, Sequence

from shim_adapters.grammars.grammar import Grammar
from shim_adapters.integrations.hf import (
    ControllerLike,
    ShimWarning,
    ShimWrapper,
    bind_controller,
    controller_manifest,
    grammar_of_manifest,
)

from .masker import XGrammarMasker, XGrammarState


class ShimXGrammarProcessor(ShimWrapper):
    """SHIM over the tokens XGrammar's processor's compiled grammar allows (see the module
    docstring): one XGrammar matcher per row, of the processor's own compiled grammar."""

    def __init__(self, xgr_processor, masker: XGrammarMasker, controller, *,
                 batch_size: int | None = None):
        super().__init__(masker, controller, batch_size=batch_size)
        self.inner = xgr_processor
        self._compiled = list(xgr_processor.compiled_grammars)
        controls = sorted(masker._special_ids - set(
            masker.compiled.tokenizer_info.special_token_ids))
        if controls:  # the policy: masked, announced once, never emitted as text
            shown = ", ".join(f"{t} ({masker.token_text(t)!r})" for t in controls[:8])
            warnings.warn(
                f"XGrammar's processor treats {len(controls)} control token(s) of this "
                f"tokenizer as text ({shown}{', ...' if len(controls) > 8 else ''}) and would "
                f"allow them wherever that text fits (e.g. inside a JSON string); the wrapper "
                f"masks them (control tokens are never emitted as text)", ShimWarning,
                stacklevel=3)

    def _create_states(self, rows: int) -> list[XGrammarState]:
        compiled = self._compiled
        if len(compiled) not in (1, rows):
            raise RuntimeError(f"XGrammar's processor holds {len(compiled)} compiled grammars "
                               f"for {rows} rows")
        new_matcher = self.masker._xgr.GrammarMatcher
        return [XGrammarState(self.masker, new_matcher(compiled[row if len(compiled) > 1 else 0]),
                              [], False) for row in range(rows)]


def _check_same_compilation(xgr_processor, masker: XGrammarMasker) -> None:
    expected = str(masker.compiled.grammar)
    for i, compiled in enumerate(xgr_processor.compiled_grammars):
        if str(compiled.grammar) != expected:
            raise ValueError(
                f"compiled grammar #{i} of the XGrammar processor is not the grammar the "
                f"controller was fitted for ({masker.grammar.name!r}): its rules differ, so the "
                f"controller's features (Earley items by rule id) would not mean the same")
        info, mine = compiled.tokenizer_info, masker.compiled.tokenizer_info
        if (info.vocab_size != mine.vocab_size
                or sorted(info.stop_token_ids) != sorted(mine.stop_token_ids)
                or info.dump_metadata() != mine.dump_metadata()
                or list(info.decoded_vocab) != masker.decoded_vocab):
            raise ValueError(
                f"compiled grammar #{i} of the XGrammar processor was compiled for another "
                f"tokenizer (vocab_size {info.vocab_size}, stop ids {info.stop_token_ids}) than "
                f"the one given (vocab_size {mine.vocab_size}, stop ids {mine.stop_token_ids})")


def with_shim(xgr_processor, controller: ControllerLike, *, tokenizer,
              grammar: Grammar | None = None, manifest: Mapping[str, Any] | None = None, lm=None,
              batch_size: int | None = None) -> ShimXGrammarProcessor:
    """Wrap ``xgrammar.contrib.hf.LogitsProcessor`` so that SHIM re-weights its allowed tokens.

    ``tokenizer``: the Hugging Face tokenizer the processor's grammar was compiled for (XGrammar
    keeps only a ``TokenizerInfo``; the controller is keyed on the tokenizer's content hash).
    ``grammar``: the Grammar the controller was fitted on (default: the built-in its manifest
    names). ``batch_size`` (prompts x num_return_sequences) makes beam search fail at the first
    call; without it, at the first reordering of rows. Raises ManifestMismatchError for a
    controller fitted for another backend, grammar or tokenizer, and ValueError for a processor
    compiled from another grammar or tokenizer.
    """
    from xgrammar.contrib.hf import LogitsProcessor

    if type(xgr_processor) is not LogitsProcessor:  # a subclass's own __call__ would not run
        raise TypeError(f"expected xgrammar.contrib.hf.LogitsProcessor itself, got "
                        f"{type(xgr_processor).__name__}: the wrapper masks with the "
                        f"processor's compiled grammars and does not call the processor")
    if xgr_processor.matchers:
        raise ValueError("this XGrammar processor has already been used by a generate call "
                         "(it is single-use); wrap a fresh one")
    found = controller_manifest(controller, manifest)
    info = xgr_processor.compiled_grammars[0].tokenizer_info
    masker = XGrammarMasker(grammar_of_manifest(found, grammar), tokenizer,
                            vocab_size=info.vocab_size, stop_token_ids=list(info.stop_token_ids),
                            **XGrammarMasker.feature_options(found))
    fitted = bind_controller(controller, masker, manifest=manifest, lm=lm)
    _check_same_compilation(xgr_processor, masker)
    if batch_size is None and len(xgr_processor.compiled_grammars) > 1:
        batch_size = len(xgr_processor.compiled_grammars)  # one grammar per row
    return ShimXGrammarProcessor(xgr_processor, masker, fitted, batch_size=batch_size)


__all__: Sequence[str] = ("ShimXGrammarProcessor", "with_shim")
