"""A controller artefact bound to the engine's tokenizer: its masker and its correction.

The artefact's manifest names its grammar, backend and tokenizer. Binding compiles that grammar
with that backend for the *engine's* tokenizer and logits width, then loads the controller with
:func:`shim_adapters.artefact.load_controller`, which refuses (naming the field) an artefact
fitted for another tokenizer, vocabulary width, backend version or grammar. One binding serves
every request that names the same artefact; compiling happens once per engine process.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from shim_adapters.artefact import load_controller, read_manifest
from shim_adapters.correction import ShimAdjuster
from shim_adapters.errors import ManifestMismatchError
from shim_adapters.grammar import Grammar, load_grammar
from shim_adapters.plugins import get_backend
from shim_adapters.protocol import Masker
from shim_adapters.wrap import grammar_of_manifest

from .request_args import ShimRequestArgs


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

    Run at request validation, so that a bad request is refused before it reaches the engine.
    """
    manifest = read_manifest(args.controller)
    request_grammar(args, manifest)
    get_backend(str(manifest.get("backend")))


class ControllerBindings:
    """Bound controllers of one engine process, keyed by the request's artefact and grammar."""

    def __init__(self, tokenizer: object, vocab_size: int):
        self.tokenizer = tokenizer
        self.vocab_size = int(vocab_size)
        self._bound: dict[tuple[str, str | None], BoundController] = {}

    def bind(self, args: ShimRequestArgs) -> BoundController:
        key = args.binding_key
        found = self._bound.get(key)
        if found is None:
            found = self._bound[key] = self._load(args)
        return found

    def _load(self, args: ShimRequestArgs) -> BoundController:
        manifest = read_manifest(args.controller)
        grammar = request_grammar(args, manifest)
        backend = get_backend(str(manifest.get("backend")))
        masker = backend.compile(grammar, self.tokenizer, self.vocab_size)
        controller, manifest = load_controller(args.controller, masker)
        return BoundController(masker=masker, adjuster=ShimAdjuster(controller),
                               manifest=manifest)
