"""What a plugin registers: a named backend that compiles a grammar into a Masker."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

from .grammar import Grammar
from .protocol import FEATURE_NAMES, FeatureStatus, Masker


@dataclass(frozen=True)
class BackendSpec:
    """A masker backend as a plugin declares it.

    ``create_masker(grammar, tokenizer, vocab_size, **options)`` compiles ``grammar`` for
    ``tokenizer`` with logits of width ``vocab_size`` (None: the tokenizer's length).
    """

    name: str
    version: str
    grammar_formats: tuple[str, ...]
    feature_status: Mapping[str, FeatureStatus]
    create_masker: Callable[..., Masker]
    description: str = ""

    def __post_init__(self) -> None:
        unknown = set(self.feature_status) - set(FEATURE_NAMES)
        if unknown:
            raise ValueError(f"backend {self.name!r} declares unknown features {sorted(unknown)}")
        missing = set(FEATURE_NAMES) - set(self.feature_status)
        if missing:
            raise ValueError(f"backend {self.name!r} must declare a status for {sorted(missing)}"
                             " (use FeatureStatus.MISSING)")

    def compile(self, grammar: Grammar, tokenizer: object, vocab_size: int | None = None,
                **options) -> Masker:
        return self.create_masker(grammar, tokenizer, vocab_size, **options)
