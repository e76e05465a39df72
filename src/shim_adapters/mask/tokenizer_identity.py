"""A tokenizer's identity by content, not by class or size.

Caches keyed on (class, vocab size) hand one tokenizer's masks to another (SynCode's mask-store
pitfall in docs/design.md); everything here keys on this content hash instead.
"""

from __future__ import annotations

import hashlib
import json
import weakref
from dataclasses import dataclass

_CACHE: "weakref.WeakKeyDictionary[object, TokenizerIdentity]" = weakref.WeakKeyDictionary()


def _definition(backend) -> str:
    """The tokenizer's serialised definition without its call-time settings: transformers
    switches padding and truncation on in the backend whenever the tokenizer is called with
    ``padding=True`` / ``truncation=True``, which changes no token and must not change the
    identity (else every stored controller refuses to load afterwards)."""
    text = backend.to_str()
    if backend.padding is None and backend.truncation is None:
        return text
    from tokenizers import Tokenizer

    copy = Tokenizer.from_str(text)
    copy.no_padding()
    copy.no_truncation()
    return copy.to_str()


@dataclass(frozen=True)
class TokenizerIdentity:
    sha256: str
    vocab_size: int
    name: str

    @classmethod
    def of(cls, tokenizer: object) -> "TokenizerIdentity":
        """Hash the full tokenizer definition (vocab, merges, normaliser, specials)."""
        try:
            return _CACHE[tokenizer]
        except (KeyError, TypeError):
            pass
        digest = hashlib.sha256()
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:
            digest.update(_definition(backend).encode())
        else:
            vocab = tokenizer.get_vocab()
            digest.update(json.dumps(sorted(vocab.items()), ensure_ascii=False).encode())
        specials = {k: str(v) for k, v in sorted(getattr(tokenizer, "special_tokens_map", {}).items())}
        digest.update(json.dumps(specials, sort_keys=True).encode())
        ident = cls(sha256=digest.hexdigest(), vocab_size=len(tokenizer),
                    name=str(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__))
        try:
            _CACHE[tokenizer] = ident
        except TypeError:
            pass
        return ident
