"""The backend-neutral contract between a grammar masker and everything built on it.

A :class:`Masker` is one grammar compiled for one tokenizer by one backend; it creates one
:class:`MaskerState` per sequence. SHIM's features are read from state the masker already
computes, and each backend declares, per feature, whether it reads it *exactly*, *derives* it
(e.g. with a shadow parser) or has it *missing*; consumers must cope with any subset.

Backends implement these by subclassing :class:`MaskerBase` / :class:`MaskerStateBase`, which
add the shared checks (forbidden token -> :class:`~shim_adapters.errors.ForbiddenTokenError`).
"""

from __future__ import annotations

import abc
import enum
import json
from dataclasses import dataclass, field
from typing import Hashable, Mapping, Sequence

import numpy as np

from shim_adapters.errors import ForbiddenTokenError
from shim_adapters.grammars.grammar import Grammar
from shim_adapters.mask.bitmask import apply_token_bitmask_, pack_mask
from shim_adapters.mask.tokenizer_identity import TokenizerIdentity


class FeatureStatus(str, enum.Enum):
    """How a backend provides one state feature."""

    EXACT = "exact"  #: read from the backend's own state
    DERIVED = "derived"  #: reconstructed (shadow parser, fallback readout); may differ in detail
    MISSING = "missing"  #: not available; the feature is absent (None) in every state


class Tokenizations(str, enum.Enum):
    """Which tokenizations of allowed text a backend's mask admits (declared per masker).

    An LM may spell a string with any of its token splits; a masker that admits only some is
    not wrong if it says so, and the conformance suite judges each declaration against what
    the mask does (``shim_adapters.conformance``).
    """

    #: Every token whose bytes extend the output to a viable prefix is allowed.
    ANY = "any"
    #: Where the grammar forces the next text, only its canonical tokenization is allowed
    #: (a shorter or otherwise split token of the forced text is refused); anywhere else, any.
    CANONICAL_IN_FORCED_TEXT = "canonical_in_forced_text"
    #: Only canonical tokenizations of the output are guaranteed to be allowed.
    CANONICAL = "canonical"


#: The state features of docs/design.md, in a fixed order.
FEATURE_NAMES: tuple[str, ...] = ("parser_state", "lexer_state", "partial_lexeme")


@dataclass(frozen=True)
class StateFeatures:
    """Masker state before the next token, as SHIM's encoder consumes it.

    ``parser_state``: recent parser states, most recent first (LALR stack top first, or the
    Earley items that can consume the next byte), each rendered as a short string.
    ``lexer_state``: (terminal, position) pairs still consistent with the partial lexeme;
    position is the backend's progress marker inside that terminal (a DFA state, an FSM node).
    ``partial_lexeme``: the text of the unfinished lexeme.
    A field is ``None`` when the backend declares that feature missing.
    """

    parser_state: tuple[str, ...] | None = None
    lexer_state: frozenset[tuple[str, int]] | None = None
    partial_lexeme: str | None = None
    #: Backend extras the encoder may use (e.g. stack depth); free-form, hashable values.
    extra: Mapping[str, object] = field(default_factory=dict)


def canonical_value(value: object) -> str:
    """A backend extra as a string that survives a JSON round trip unchanged."""
    if isinstance(value, str):
        return value
    if type(value) is int:
        return str(value)  # == json.dumps(value), without the encoder's overhead
    try:
        return json.dumps(value, sort_keys=True)
    except (TypeError, ValueError):
        return str(value)


def state_key(features: StateFeatures) -> tuple:
    """A hashable identity of a StateFeatures (its ``extra`` mapping is not hashable).

    Extras are compared by canonical value, so a state equals its JSON round trip."""
    extra = features.extra
    if extra:
        items = tuple(sorted((str(k), v if isinstance(v, str) else canonical_value(v))
                             for k, v in extra.items()))
    else:
        items = ()
    return (features.parser_state, features.lexer_state, features.partial_lexeme, items)


class MaskerState(abc.ABC):
    """One sequence's constraint state. Not shared across rows or threads: ``fork`` instead."""

    masker: "Masker"

    @abc.abstractmethod
    def allowed_mask(self) -> np.ndarray:
        """Bool array over the model's full logit width: True where the token may come next.

        EOS ids are True exactly when :meth:`eos_allowed`; padding ids (beyond the tokenizer's
        vocabulary) are always False. After EOS has been accepted, every entry is False.
        """

    @abc.abstractmethod
    def advance(self, token_id: int) -> None:
        """Consume one token; raises ForbiddenTokenError (with :meth:`describe`) if forbidden."""

    @abc.abstractmethod
    def eos_allowed(self) -> bool:
        """Whether the output so far is a complete string of the grammar."""

    @abc.abstractmethod
    def fork(self) -> "MaskerState":
        """An independent copy: advancing one never changes the other."""

    @abc.abstractmethod
    def features(self) -> StateFeatures:
        """The state features before the next token (fields per the masker's feature_status)."""

    @property
    @abc.abstractmethod
    def token_ids(self) -> Sequence[int]:
        """The tokens consumed so far (EOS included once accepted)."""

    @property
    @abc.abstractmethod
    def is_finished(self) -> bool:
        """True once EOS has been accepted."""

    # ---- shared behaviour -------------------------------------------------------------
    @property
    def step(self) -> int:
        return len(self.token_ids)

    def text(self) -> str:
        """The generated text so far, EOS excluded."""
        ids = [t for t in self.token_ids if t not in self.masker.eos_token_ids]
        return self.masker.decode(ids)

    def allowed_token_ids(self) -> np.ndarray:
        return np.flatnonzero(self.allowed_mask())

    def fill_next_token_bitmask(self, bitmask, row: int = 0) -> None:
        """Write :meth:`allowed_mask` into row ``row`` of a packed int32 bitmask (XGrammar's
        layout, see :mod:`shim_adapters.mask.bitmask`): a CPU torch tensor or a numpy array.

        This default packs the bool mask; backends override it with their own fill. Every
        implementation sets exactly the bits :meth:`allowed_mask` is True for."""
        target = bitmask.numpy() if hasattr(bitmask, "numpy") and not isinstance(
            bitmask, np.ndarray) else bitmask
        pack_mask(self.allowed_mask(), out=target[row])

    def feature_key(self) -> Hashable:
        """A hashable that determines :meth:`features`: equal keys imply equal features.

        SHIM's γ cache is keyed on it, so it must be cheap. This default is the features'
        own identity (:func:`state_key`); backends override it with something they can read
        without building the features (e.g. a raw state dump)."""
        return state_key(self.features())

    def describe(self) -> str:
        """A one-line diagnostic of the state, used in every error message."""
        feats = self.features()
        text = self.text()
        shown = text if len(text) <= 80 else "..." + text[-77:]
        parts = [f"backend={self.masker.backend_name}", f"grammar={self.masker.grammar.name}",
                 f"step={self.step}", f"text={shown!r}"]
        if feats.parser_state is not None:
            parts.append(f"parser_state={list(feats.parser_state[:4])}")
        if feats.lexer_state is not None:
            parts.append(f"lexer_state={sorted(feats.lexer_state)[:6]}")
        if feats.partial_lexeme is not None:
            parts.append(f"partial_lexeme={feats.partial_lexeme!r}")
        parts.append(f"eos_allowed={self.eos_allowed()}")
        return " ".join(parts)

    def _forbidden(self, token_id: int) -> ForbiddenTokenError:
        return ForbiddenTokenError(token_id, self.masker.token_text(token_id), self.step,
                                   self.describe())


class Masker(abc.ABC):
    """One grammar compiled for one tokenizer by one backend."""

    #: Registered backend name (``syncode``, ``xgrammar``, ``outlines``, ...).
    backend_name: str
    #: Version string of the backend library the masks come from.
    backend_version: str
    #: Grammar formats this backend compiles natively (others are converted or refused).
    grammar_formats: tuple[str, ...]
    #: Per feature in FEATURE_NAMES: how this backend provides it.
    feature_status: Mapping[str, FeatureStatus]
    #: Which tokenizations of allowed text the mask admits; judged by the conformance suite.
    tokenizations: Tokenizations = Tokenizations.ANY

    grammar: Grammar
    tokenizer: object
    #: Width of the model's logits (>= the tokenizer's vocabulary; the excess is padding).
    vocab_size: int
    eos_token_ids: frozenset[int]
    #: Fingerprint fields added after artefacts were first written: the value an artefact
    #: that lacks the field was written with (so it loads where that still holds).
    legacy_fingerprint: Mapping[str, str] = {}

    @abc.abstractmethod
    def new_state(self) -> MaskerState:
        """A fresh state at the start of the output."""

    def fill_next_token_bitmasks(self, states: Sequence[MaskerState], bitmask,
                                 rows: Sequence[int]) -> None:
        """Fill row ``rows[i]`` of ``bitmask`` for ``states[i]`` (a batch's fill: backends
        may override it to do their per-row fix-ups with one vectorised op)."""
        for row, state in zip(rows, states):
            state.fill_next_token_bitmask(bitmask, row)

    def advance_states(self, states: Sequence[MaskerState], token_ids: Sequence[int]) -> None:
        """``states[i].advance(token_ids[i])`` for every i (a batch's step: backends may
        override it to accept the batch in one call). Raises as ``advance`` does, for the
        first row whose token is forbidden."""
        for state, token_id in zip(states, token_ids):
            state.advance(token_id)

    def apply_token_bitmask_(self, logits, bitmask) -> None:
        """Mask ``logits`` (batch, vocab) in place with a packed bitmask (batch, words).

        The default is the core's kernel (:func:`shim_adapters.mask.bitmask.apply_token_bitmask_`);
        a backend may hand in its own."""
        apply_token_bitmask_(logits, bitmask)

    @property
    def tokenizer_identity(self) -> TokenizerIdentity:
        return TokenizerIdentity.of(self.tokenizer)

    def decode(self, token_ids: Sequence[int]) -> str:
        """The text the tokens spell, exactly: no clean-up of spaces (a tokenizer converted
        from GGUF cleans up by default and would turn the constrained ``a !=`` into ``a!=``)."""
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=False,
                                     clean_up_tokenization_spaces=False)

    def token_text(self, token_id: int) -> str:
        token_id = int(token_id)
        if token_id < 0 or token_id >= self.vocab_size:
            return f"<out-of-range id {token_id}>"
        if token_id >= len(self.tokenizer):
            return f"<padding id {token_id}>"
        return self.tokenizer.convert_ids_to_tokens(int(token_id))

    def fingerprint(self) -> dict[str, str]:
        """What a compiled artefact for this masker must match (see artefact manifests)."""
        return {
            "backend": self.backend_name,
            "backend_version": self.backend_version,
            "grammar_sha256": self.grammar.sha256,
            "tokenizer_sha256": self.tokenizer_identity.sha256,
            "vocab_size": str(self.vocab_size),
        }
