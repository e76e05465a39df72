"""Fault injection: wrap a real masker with one known defect, to prove the checks catch it.

A conformance or contract run that passes on a healthy backend says little unless the same
run fails on a broken one. :func:`faulty_backend` returns a BackendSpec whose maskers are a
real backend's maskers with exactly one defect injected; the test suites run the checks on it
and require the defect to be reported (with its minimised repro).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

import numpy as np

from shim_adapters.backends.spec import BackendSpec
from shim_adapters.conformance.generate import valid_strings
from shim_adapters.errors import ForbiddenTokenError
from shim_adapters.grammars.grammar import builtin_grammar
from shim_adapters.mask.protocol import Masker, MaskerState, StateFeatures, Tokenizations
from shim_adapters.mask.vocab import Vocabulary

#: The defects that can be injected.
FAULTS = {
    "padding_allowed": "the last padding id is always allowed",
    "eos_always": "EOS is always allowed (and in the mask)",
    "unsound_token": "one token the grammar never allows at the start is allowed there",
    "refuse_token": "the most frequent allowed token is refused everywhere after the start",
    "no_raise": "advance() silently accepts forbidden tokens",
    "shared_fork": "fork() returns the same state",
    "features_none": "features() returns None for features declared present",
    "short_mask": "the mask is one entry shorter than the logits width",
    "sticky_refusal": "a refused token still advances the step counter",
    "refuse_last_allowed": "at every state the highest-id allowed text token is refused "
                           "(valid strings' canonical tokens rarely need it)",
    "unsound_late": "after the first token, the highest-id text token the grammar refuses is "
                    "allowed at every state",
    "allow_control": "the tokenizer's chat-template control tokens are always allowed",
    "crash_late": "allowed_mask() raises after two tokens",
    "stuck_late": "after two tokens nothing is allowed, not even EOS (a dead end the grammar "
                  "does not have)",
    "drops_schema": "a JSON schema is compiled as plain JSON (the schema's constraints dropped, "
                    "JSON syntax kept)",
    "declares_any_tokenization": "declares tokenizations=any whatever the backend does (a "
                                 "wrong declaration on a canonical-in-forced-text backend)",
    "drops_schema_bounds": "a JSON schema is compiled without its bounds (minLength, maxLength, "
                           "minimum, maximum, minItems, maxItems; types and keys kept)",
    # State-dependent defects a user's masker may have (the acceptance of the suite):
    "refuse_at_depth": "from the fifth token on, the highest-id allowed text token is refused",
    "unsound_rare": "at every fourth state (steps 3, 7, 11, ...) the highest-id text token the "
                    "grammar refuses is allowed",
    "eos_early": "EOS is allowed at step 3 (once, wherever the text is)",
    "refuse_partial_utf8": "tokens whose bytes are not whole UTF-8 characters are refused",
    "dead_end_deep": "from the fifth token on nothing is allowed, not even EOS",
    "special_in_string": "inside a string or a word (the text so far ends inside a JSON "
                         "string, or in a letter) the tokenizer's special and added tokens "
                         "are allowed",
    "refuse_escape": "inside a JSON string, tokens with a backslash are refused",
}

#: The JSON-schema keywords ``drops_schema_bounds`` removes.
SCHEMA_BOUNDS = ("minLength", "maxLength", "minimum", "maximum", "exclusiveMinimum",
                 "exclusiveMaximum", "minItems", "maxItems")


class FaultyState(MaskerState):
    def __init__(self, masker: "FaultyMasker", inner: MaskerState):
        self.masker = masker
        self.inner = inner

    # -- mask ----------------------------------------------------------------------------
    def allowed_mask(self) -> np.ndarray:
        mask = self.inner.allowed_mask().copy()
        fault = self.masker.fault
        if self.inner.is_finished:
            return mask
        if fault == "padding_allowed":
            mask[-1] = True
        elif fault == "eos_always":
            for e in self.masker.eos_token_ids:
                mask[e] = True
        elif fault == "unsound_token" and self.inner.step == 0:
            mask[self.masker.bad_token] = True
        elif fault == "refuse_token" and self.inner.step > 0:
            mask[self.masker.refused_token] = False
        elif fault == "short_mask":
            return mask[:-1]
        elif fault == "refuse_last_allowed":
            text = np.flatnonzero(mask[:self.masker.n_text] & self.masker.text_mask)
            if len(text):
                mask[text[-1]] = False
        elif fault == "unsound_late" and self.inner.step > 0:
            refused = np.flatnonzero(~mask[:self.masker.n_text] & self.masker.text_mask)
            if len(refused):
                mask[refused[-1]] = True
        elif fault == "allow_control":
            mask[self.masker.control_ids] = True
        elif fault == "crash_late" and self.inner.step >= 2:
            raise RuntimeError("injected crash in allowed_mask()")
        elif fault == "stuck_late" and self.inner.step >= 2:
            mask[:] = False
        elif fault == "refuse_at_depth" and self.inner.step >= 5:
            text = np.flatnonzero(mask[:self.masker.n_text] & self.masker.text_mask)
            if len(text):
                mask[text[-1]] = False
        elif fault == "unsound_rare" and self.inner.step % 4 == 3:
            refused = np.flatnonzero(~mask[:self.masker.n_text] & self.masker.text_mask)
            if len(refused):
                mask[refused[-1]] = True
        elif fault == "eos_early" and self.inner.step == 3:
            for e in self.masker.eos_token_ids:
                mask[e] = True
        elif fault == "refuse_partial_utf8":
            mask[self.masker.partial_ids] = False
        elif fault == "dead_end_deep" and self.inner.step >= 5:
            mask[:] = False
        elif fault == "special_in_string" and self._in_word_or_string():
            mask[self.masker.special_and_added] = True
        elif fault == "refuse_escape" and self._in_json_string():
            mask[self.masker.backslash_ids] = False
        return mask

    def _text(self) -> bytes:
        return self.masker.vocab.to_bytes(self.inner.token_ids) or b""

    def _in_json_string(self) -> bool:
        inside = escaped = False
        for b in self._text():
            if escaped:
                escaped = False
            elif inside and b == 0x5C:
                escaped = True
            elif b == 0x22:
                inside = not inside
        return inside

    def _in_word_or_string(self) -> bool:
        text = self._text()
        return self._in_json_string() or bool(text) and (chr(text[-1]).isalpha()
                                                         or text[-1] >= 0x80)

    def eos_allowed(self) -> bool:
        if self.masker.fault == "eos_always" and not self.inner.is_finished:
            return True
        if self.masker.fault == "eos_early" and self.inner.step == 3 and \
                not self.inner.is_finished:
            return True
        if self.masker.fault == "special_in_string" and not self.inner.is_finished and \
                any(e in self.masker.special_and_added for e in self.masker.eos_token_ids) \
                and self._in_word_or_string():
            return True
        if self.masker.fault == "stuck_late" and self.inner.step >= 2:
            return False
        if self.masker.fault == "dead_end_deep" and self.inner.step >= 5:
            return False
        return self.inner.eos_allowed()

    def advance(self, token_id: int) -> None:
        fault = self.masker.fault
        mask = self.allowed_mask() if fault != "short_mask" else self.inner.allowed_mask()
        if fault == "no_raise" and not mask[token_id]:
            return
        if token_id >= len(mask) or not mask[token_id]:
            if fault == "sticky_refusal":
                self._extra_steps = getattr(self, "_extra_steps", 0) + 1
            raise ForbiddenTokenError(token_id, self.masker.token_text(token_id), self.step,
                                      self.describe())
        if token_id in self.masker.eos_token_ids and not self.inner.eos_allowed():
            self._fake_finished = True  # EOS the wrapped masker refuses (eos_always)
            self._eos_token = token_id
            return
        if fault in ("unsound_token", "unsound_late", "allow_control", "unsound_rare",
                     "special_in_string") and not self.inner.allowed_mask()[token_id]:
            self._wrong = True  # the wrapped masker cannot follow; we stop here
            raise ForbiddenTokenError(token_id, self.masker.token_text(token_id), self.step,
                                      "injected unsound token cannot be followed")
        self.inner.advance(token_id)

    def fork(self) -> MaskerState:
        if self.masker.fault == "shared_fork":
            return self
        out = FaultyState(self.masker, self.inner.fork())
        out.__dict__.update({k: v for k, v in self.__dict__.items() if k not in ("inner",)})
        out.inner = self.inner.fork()
        return out

    def features(self) -> StateFeatures:
        if self.masker.fault == "features_none":
            return StateFeatures()
        return self.inner.features()

    @property
    def token_ids(self) -> Sequence[int]:
        ids = list(self.inner.token_ids)
        if getattr(self, "_fake_finished", False):
            ids.append(self._eos_token)
        return ids

    @property
    def step(self) -> int:
        return len(self.token_ids) + getattr(self, "_extra_steps", 0)

    @property
    def is_finished(self) -> bool:
        return getattr(self, "_fake_finished", False) or self.inner.is_finished


class FaultyMasker(Masker):
    def __init__(self, inner: Masker, fault: str):
        if fault not in FAULTS:
            raise ValueError(f"unknown fault {fault!r}; choose from {', '.join(FAULTS)}")
        self.inner = inner
        self.fault = fault
        for name in ("grammar", "tokenizer", "vocab_size", "eos_token_ids", "backend_version",
                     "grammar_formats", "feature_status", "tokenizations"):
            setattr(self, name, getattr(inner, name))
        if fault == "declares_any_tokenization":
            if inner.tokenizations is Tokenizations.ANY:
                raise ValueError("declares_any_tokenization needs a backend that declares "
                                 "fewer tokenizations than any")
            self.tokenizations = Tokenizations.ANY
        self.backend_name = f"{inner.backend_name}+{fault}"
        first = inner.new_state().allowed_mask()
        n = len(inner.tokenizer)
        specials = set(getattr(inner.tokenizer, "all_special_ids", []))
        text_ids = [i for i in range(n) if i not in specials]
        self.bad_token = next(i for i in reversed(text_ids) if not first[i])
        self.refused_token = None
        self.n_text = n
        self.text_mask = np.zeros(n, dtype=bool)
        self.control_ids = np.zeros(0, dtype=np.int64)
        self.vocab = Vocabulary(inner.tokenizer, inner.vocab_size)
        self.partial_ids = np.array([i for i in self.vocab.text_ids if i < n
                                     and self.vocab.is_partial_utf8(int(i))], dtype=np.int64)
        self.backslash_ids = np.array([i for i in self.vocab.text_ids if i < n
                                       and b"\\" in self.vocab.token_bytes[int(i)]],
                                      dtype=np.int64)
        self.special_and_added = np.array(sorted(
            (set(self.vocab.special_ids) | set(self.vocab.control_ids)) & set(range(n))),
            dtype=np.int64)
        if fault in ("refuse_last_allowed", "unsound_late", "allow_control", "refuse_at_depth",
                     "unsound_rare"):
            vocab = Vocabulary(inner.tokenizer, inner.vocab_size)
            ids = vocab.text_ids[vocab.text_ids < n]
            self.text_mask[ids] = True
            self.text_mask[list(vocab.control_ids)] = False
            self.control_ids = np.array(sorted(vocab.control_ids), dtype=np.int64)
            if fault == "allow_control" and not len(self.control_ids):
                raise ValueError("allow_control needs a tokenizer with chat-template control "
                                 "tokens that are not flagged special")
        if fault == "refuse_token":
            # The token valid strings of this grammar need most often (after the first one).
            from collections import Counter


            vocab = Vocabulary(inner.tokenizer, inner.vocab_size)
            counts: Counter = Counter()
            for _, text in valid_strings(inner.grammar, 10, seed=0)[0]:
                counts.update(vocab.canonical(text)[0][1:])
            self.refused_token = counts.most_common(1)[0][0]
        if fault == "features_none" and all(
                str(getattr(v, "value", v)) == "missing" for v in inner.feature_status.values()):
            raise ValueError("features_none needs a backend that declares some feature")

    def new_state(self) -> MaskerState:
        return FaultyState(self, self.inner.new_state())


def faulty_backend(spec: BackendSpec, fault: str) -> BackendSpec:
    """``spec`` with ``fault`` injected into every masker it compiles."""
    def create(grammar, tokenizer, vocab_size=None, **options):
        if fault == "drops_schema_bounds":
            if grammar.format != "json_schema":
                raise ValueError("drops_schema_bounds needs a JSON-schema grammar")
            import json

            loose = replace(grammar, text=json.dumps(_without_bounds(json.loads(grammar.text))))
            masker = FaultyMasker(spec.create_masker(loose, tokenizer, vocab_size, **options),
                                  fault)
            masker.grammar = grammar  # it claims the bounds it dropped
            return masker
        if fault == "drops_schema":
            if grammar.format != "json_schema":
                raise ValueError("drops_schema needs a JSON-schema grammar")
            inner = spec.create_masker(builtin_grammar("json"), tokenizer, vocab_size, **options)
            masker = FaultyMasker(inner, fault)
            masker.grammar = grammar  # it claims the schema it dropped
            return masker
        return FaultyMasker(spec.create_masker(grammar, tokenizer, vocab_size, **options), fault)

    return replace(spec, name=f"{spec.name}+{fault}", create_masker=create,
                   description=f"{spec.name} with an injected fault: {FAULTS[fault]}")


def _without_bounds(node, names: bool = False):
    """``node`` without bound keywords (``names``: a ``properties`` map, whose keys are
    property names, not keywords)."""
    if isinstance(node, dict):
        return {k: _without_bounds(v, k in ("properties", "$defs", "definitions") and not names)
                for k, v in node.items() if names or k not in SCHEMA_BOUNDS}
    if isinstance(node, list):
        return [_without_bounds(v) for v in node]
    return node


__all__ = ["FAULTS", "FaultyMasker", "faulty_backend"]
