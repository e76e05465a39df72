"""SHIM on top of an existing ``outlines.Generator`` (outlines 1.3, transformers models).

``with_shim(generator, controller)`` returns a generator with the same ``__call__`` / ``batch``
/ ``stream`` signature and output type: outlines' own logits processor (outlines_core for regex
and JSON schema, llguidance for CFGs) still masks, and SHIM adds β·log γ̂ to the tokens it
allows. The new generator is ``Generator(model, processor=...)`` with a processor that wraps
the old one, as outlines documents for custom processors.

Where the features come from: states rebuilt through this plugin, one per row, over the same
grammar and tokenizer, fed the same tokens. llguidance exposes no parser state at all (the
plugin derives it with a shadow LALR parser), and outlines_core's guides walk an index built
over outlines' string vocabulary, whose ids need not match the plugin's byte-level index the
controller was trained on. The rebuilt states also check outlines' mask: a token outlines
allows but the controller's grammar forbids raises instead of being sampled. Where outlines'
llguidance tokenizer spells tokens with other bytes than they have (a GGUF-converted tokenizer
such as SmolLM2's), its masks are for other text; the wrapped generator then masks with the
plugin's llguidance tokenizer, built from the token bytes, and warns.

The grammar: for a CFG the processor holds its Lark text, which is checked against the
controller's manifest by sha256; for regex / JSON schema (outlines_core keeps only the compiled
index) pass ``grammar=`` or rely on the built-in the manifest names. Outlines' XGrammar backend
is not wrapped here: use ``xgrammar.contrib.hf`` with :mod:`shim_xgrammar.wrap`.
"""

from __future__ import annotations

from typing import Any, Iterator, List, Mapping

from outlines.generator import SteerableGenerator
from outlines.processors.base_logits_processor import OutlinesLogitsProcessor

from shim_adapters.errors import VocabMismatchError
from shim_adapters.grammars.grammar import Grammar
from shim_adapters.integrations.hf import (
    ControllerLike,
    IncompleteSample,
    ShimWarning,
    ShimWrapper,
    bind_controller,
    check_model,
    controller_manifest,
    grammar_of_manifest,
    refuse_beam_search,
)
from shim_adapters.mask.protocol import Masker

from .plugin import create_masker
from .vocabulary import llguidance_byte_mismatches


class ShimOutlinesProcessor(OutlinesLogitsProcessor):
    """An outlines processor: the wrapped processor's mask, then SHIM (torch tensors)."""

    def __init__(self, inner: OutlinesLogitsProcessor, masker: Masker, controller):
        if getattr(inner, "tensor_library_name", None) != "torch":
            raise ValueError(f"only torch (transformers) models are supported, got tensor "
                             f"library {getattr(inner, 'tensor_library_name', None)!r}")
        super().__init__("torch")
        self.inner = inner
        self.shim = ShimWrapper(masker, controller, backend=inner.process_logits)

    def reset(self) -> None:
        self.inner.reset()
        self.shim.reset()

    def process_logits(self, input_ids, logits):
        return self.shim(input_ids, logits)


class _LastIds:
    """A stopping criterion that never stops: it keeps the latest ids, including each row's
    last token, which no logits processor sees."""

    def __init__(self):
        self.ids = None

    def __call__(self, input_ids, scores, **kwargs):
        import torch

        self.ids = input_ids
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


class ShimGenerator(SteerableGenerator):
    """A SteerableGenerator that refuses beam search (rows would be reordered) and returns an
    :class:`~shim_adapters.integrations.hf.IncompleteSample` in place of any row cut off (by
    ``max_new_tokens``) before the grammar accepted: such text is never returned as output."""

    wrapped: SteerableGenerator

    def __call__(self, prompt: Any, **inference_kwargs) -> Any:
        refuse_beam_search(inference_kwargs, getattr(self.model, "model", None))
        tracker = self._track(inference_kwargs)
        return self._report(super().__call__(prompt, **inference_kwargs), tracker)

    def batch(self, prompts: List[Any], **inference_kwargs) -> List[Any]:
        refuse_beam_search(inference_kwargs, getattr(self.model, "model", None))
        tracker = self._track(inference_kwargs)
        return self._report(super().batch(prompts, **inference_kwargs), tracker)

    def stream(self, prompt: Any, **inference_kwargs) -> Iterator[Any]:
        refuse_beam_search(inference_kwargs, getattr(self.model, "model", None))
        return super().stream(prompt, **inference_kwargs)

    @staticmethod
    def _track(inference_kwargs: dict) -> _LastIds:
        from transformers import StoppingCriteriaList

        tracker = _LastIds()
        criteria = StoppingCriteriaList(inference_kwargs.get("stopping_criteria") or [])
        criteria.append(tracker)
        inference_kwargs["stopping_criteria"] = criteria
        return tracker

    def _report(self, result: Any, tracker: _LastIds) -> Any:
        """Outlines' outputs, each row cut off before acceptance replaced by its report, and
        each text outlines decoded differently from the tokens' own bytes replaced by those
        bytes' text: ``tokenizer.decode`` may clean up spaces (``clean_up_tokenization_spaces``
        turns ``id !=`` into ``id!=``), and the grammar constrained the tokens, not the
        cleaned-up text."""
        import warnings

        shim = self.logits_processor.shim
        if tracker.ids is None:  # generate made no step
            return result
        reports = shim.outputs(tracker.ids)
        flat = iter(range(len(reports)))
        rewritten: list[tuple[int, str, str]] = []

        def replace(item):
            if isinstance(item, list):
                return [replace(x) for x in item]
            row = next(flat)
            exact = reports[row]
            if isinstance(exact, IncompleteSample):
                return exact
            if isinstance(item, str) and item != exact:
                rewritten.append((row, item, exact))
                return exact
            return item

        out = replace(result)
        if rewritten:
            row, decoded, exact = rewritten[0]
            warnings.warn(f"outlines decoded {len(rewritten)} row(s) to other text than their "
                          f"tokens spell (row {row}: {decoded!r} for {exact!r}; the tokenizer's "
                          f"decode cleans up spaces): returned the tokens' text",
                          ShimWarning, stacklevel=3)
        return out


def _grammar_for(inner, found: Mapping[str, Any], grammar: Grammar | None) -> Grammar:
    from outlines.backends.llguidance import LLGuidanceLogitsProcessor
    from outlines.backends.outlines_core import OutlinesCoreLogitsProcessor

    if isinstance(inner, LLGuidanceLogitsProcessor):
        if grammar is None:
            # outlines hands the CFG's text to llguidance unchanged: that text is the grammar
            return Grammar(text=inner.grammar, format="lark",
                           name=str(found.get("grammar_name") or "<outlines CFG>"))
        return grammar
    if isinstance(inner, OutlinesCoreLogitsProcessor):
        return grammar_of_manifest(found, grammar)
    raise TypeError(f"cannot wrap outlines processor {type(inner).__name__}: supported are "
                    f"outlines_core (regex, JSON schema) and llguidance (CFG); for XGrammar use "
                    f"xgrammar.contrib.hf with shim_xgrammar.wrap.with_shim")


def _check_cfg_text(inner, masker: Masker, outlines_model=None) -> None:
    """The generator's grammar must be the controller's: the CFG text for llguidance; for
    outlines_core, its index must equal the one outlines builds from the masker's regex."""
    from outlines.backends.llguidance import LLGuidanceLogitsProcessor
    from outlines.backends.outlines_core import OutlinesCoreBackend, OutlinesCoreLogitsProcessor

    if isinstance(inner, OutlinesCoreLogitsProcessor) and outlines_model is not None:
        regex = getattr(masker, "regex", None)
        rebuilt = OutlinesCoreBackend(outlines_model).get_regex_logits_processor(regex).index
        if rebuilt != inner.index:
            raise ValueError(f"the generator's regex / JSON schema is not the grammar the "
                             f"controller was fitted for ({masker.grammar.name!r}, regex "
                             f"{regex[:80]!r}): their outlines_core indexes differ")
        return
    if not isinstance(inner, LLGuidanceLogitsProcessor):
        return
    import llguidance

    lark = getattr(masker, "lark_text", None)
    candidates = {lark, llguidance.grammar_from("lark", lark)} if lark else set()
    if inner.grammar not in candidates:
        raise ValueError(f"the generator's CFG is not the grammar the controller was fitted for "
                         f"({masker.grammar.name!r})")


def _with_true_token_bytes(inner, masker: Masker):
    """Outlines' llguidance processor over the masker's llguidance tokenizer where outlines'
    own one spells tokens with other bytes (see
    :func:`~shim_outlines.vocabulary.llguidance_byte_mismatches`: a GGUF-converted tokenizer
    such as SmolLM2's): its masks would be for other text, so the first step that followed one
    would refuse the token it allowed. Warns and names the tokens; the user's generator is
    left as it was."""
    import warnings

    from outlines.backends.llguidance import LLGuidanceLogitsProcessor

    if not isinstance(inner, LLGuidanceLogitsProcessor):
        return inner
    wrong = llguidance_byte_mismatches(inner.llg_tokenizer, masker.tokenizer, limit=3)
    if not wrong:
        return inner
    shown = ", ".join(f"{token_id}: {theirs!r} (bytes {ours!r})"
                      for token_id, ours, theirs in wrong)
    warnings.warn(f"outlines' llguidance tokenizer spells tokens with bytes they do not have "
                  f"({shown}; llguidance.hf.from_tokenizer misreads this tokenizer's decoder "
                  f"chain), so its masks are for other text: the wrapped generator masks with "
                  f"a llguidance tokenizer built from the token bytes instead",
                  ShimWarning, stacklevel=3)
    return LLGuidanceLogitsProcessor(inner.grammar, masker.ll_tokenizer,
                                     inner.tensor_library_name)


def _logits_width(outlines_model) -> int:
    hf = outlines_model.model
    out = hf.get_output_embeddings()
    return int(out.weight.shape[0]) if out is not None else int(hf.config.vocab_size)


def with_shim(generator: SteerableGenerator, controller: ControllerLike, *,
              grammar: Grammar | None = None, manifest: Mapping[str, Any] | None = None,
              lm=None) -> ShimGenerator:
    """Wrap an ``outlines.Generator`` so that SHIM re-weights the tokens it allows.

    ``generator`` must come from ``outlines.Generator(outlines.from_transformers(model,
    tokenizer), output_type)``. Raises ManifestMismatchError for a controller fitted for another
    backend, grammar, tokenizer or LM (the generator's model is checked against the manifest's
    ``lm_revision``, see :func:`shim_adapters.integrations.hf.check_model`); ValueError when the
    generator's grammar is not the controller's; TypeError for a generator without a supported
    processor. The wrapped generator returns an IncompleteSample for a row cut off before the
    grammar accepted.
    """
    from outlines.models.transformers import Transformers

    if not isinstance(generator, SteerableGenerator):
        raise TypeError(f"expected an outlines SteerableGenerator (outlines.Generator over a "
                        f"local model), got {type(generator).__name__}")
    inner = generator.logits_processor
    if inner is None:
        raise ValueError("the generator has no output type, so nothing is constrained and "
                         "there is no grammar for SHIM to correct")
    if isinstance(inner, ShimOutlinesProcessor):
        raise ValueError("this generator is already wrapped with SHIM")
    if not isinstance(generator.model, Transformers):
        raise TypeError(f"only outlines.from_transformers models are supported, got "
                        f"{type(generator.model).__name__}")
    found = controller_manifest(controller, manifest)
    tokenizer = generator.model.hf_tokenizer
    width = _logits_width(generator.model)
    if width < len(tokenizer):
        raise VocabMismatchError(f"the model's logits ({width}) are narrower than its tokenizer "
                                 f"({len(tokenizer)})")
    masker = create_masker(_grammar_for(inner, found, grammar), tokenizer, width)
    fitted = bind_controller(controller, masker, manifest=manifest, lm=lm)
    check_model(found, generator.model.model, lm)
    _check_cfg_text(inner, masker, generator.model)
    inner = _with_true_token_bytes(inner, masker)
    wrapped = ShimGenerator.from_processor(generator.model,
                                           ShimOutlinesProcessor(inner, masker, fitted))
    wrapped.wrapped = generator
    return wrapped


__all__ = ("ShimGenerator", "ShimOutlinesProcessor", "with_shim")
