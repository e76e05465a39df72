"""A controller artefact bound to the engine: its masker and its correction, checked once.

The artefact's manifest names its grammar, backend and tokenizer. Binding checks, cheapest
first: the manifest is intact (:func:`~shim_adapters.shim.artefact.read_manifest`), the LM the
engine serves is the one it was fitted on (:mod:`shim_vllm.lm_identity`, when the engine's
weights digest is known), the request's grammar is the manifest's, the backend is installed;
then compiles that grammar with that backend for the *engine's* tokenizer and logits width and
loads the controller with :func:`~shim_adapters.shim.artefact.load_controller`, which refuses
(naming the field) another tokenizer, logits width, backend version or grammar, and a weights
file whose size or sha256 is not the manifest's. A binding is cached on the artefact's content
(:mod:`shim_vllm.artefact_content`): every request naming the same, unchanged artefact shares
one compiled masker and one loaded controller, and an edited artefact is bound (checked) anew.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Mapping

from shim_adapters.backends.registry import get_backend
from shim_adapters.errors import ManifestMismatchError
from shim_adapters.grammars.grammar import Grammar, load_grammar
from shim_adapters.integrations.hf import grammar_of_manifest
from shim_adapters.mask.protocol import Masker
from shim_adapters.shim.artefact import load_controller, read_manifest
from shim_adapters.shim.correction import ShimAdjuster

from .artefact_content import content_key
from .lm_identity import check_lm_revision
from .request_args import ShimRequestArgs

#: Distinct artefact contents kept bound per engine; the least recently used is dropped (an
#: artefact edited over and over leaves no trail of stale bindings).
MAX_BINDINGS = 64


@dataclass(frozen=True)
class BoundController:
    """One artefact ready to serve: the masker that makes per-request states, the correction."""

    masker: Masker
    adjuster: ShimAdjuster
    manifest: Mapping[str, Any]


def request_grammar(args: ShimRequestArgs, manifest: Mapping[str, Any]) -> Grammar:
    """The grammar a request's controller was fitted on, checked against its manifest."""
    given = load_grammar(args.grammar) if args.grammar is not None else None
    grammar = grammar_of_manifest(manifest, given)
    if grammar.sha256 != manifest.get("grammar_sha256"):
        raise ManifestMismatchError("grammar_sha256", grammar.sha256,
                                    manifest.get("grammar_sha256"),
                                    str(args.controller / "manifest.json"))
    return grammar


def check_request(args: ShimRequestArgs) -> None:
    """What can be checked without the engine: artefact intact, grammar found, backend installed.

    The fallback where the engine's tokenizer is unknown; the engine's own binding then checks
    the rest (and a failure there stays inside the request).
    """
    manifest = read_manifest(args.controller)
    request_grammar(args, manifest)
    get_backend(str(manifest.get("backend")))


class ControllerBindings:
    """Bound controllers of one engine: its tokenizer, logits width and (optionally) LM digest.

    ``lm_revision``: the served weights' digest (:func:`shim_vllm.lm_identity.weights_revision`);
    None skips the LM check (an engine that cannot tell which weights it serves).
    Thread-safe: vLLM's frontend validates requests from a thread pool.
    """

    def __init__(self, tokenizer: object, vocab_size: int, lm_revision: str | None = None):
        self.tokenizer = tokenizer
        self.vocab_size = int(vocab_size)
        self.lm_revision = lm_revision
        self._bound: OrderedDict[tuple[str, str | None, str], BoundController] = OrderedDict()
        self._lock = threading.Lock()

    def bind(self, args: ShimRequestArgs) -> BoundController:
        """The request's bound controller; raises (naming the problem) if the artefact does not
        fit this engine."""
        key = (*args.binding_key, content_key(args))
        with self._lock:
            found = self._bound.get(key)
            if found is not None:
                self._bound.move_to_end(key)
                return found
        bound = self._load(args)
        with self._lock:
            self._bound[key] = bound
            while len(self._bound) > MAX_BINDINGS:
                self._bound.popitem(last=False)
        return bound

    def _load(self, args: ShimRequestArgs) -> BoundController:
        manifest = read_manifest(args.controller)
        if self.lm_revision is not None:
            check_lm_revision(manifest, self.lm_revision, str(args.controller / "manifest.json"))
        grammar = request_grammar(args, manifest)
        backend = get_backend(str(manifest.get("backend")))
        masker = backend.compile(grammar, self.tokenizer, self.vocab_size)
        controller, manifest = load_controller(args.controller, masker)
        return BoundController(masker=masker, adjuster=ShimAdjuster(controller),
                               manifest=manifest)
