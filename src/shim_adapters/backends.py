"""What a plugin registers: a named backend that compiles a grammar into a Masker."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

from .grammar import Grammar
from .protocol import FEATURE_NAMES, FeatureStatus, Masker


@dataclass(frozen=True)
class BackendSpec:
    """A masker backend as a plugin declares it.

    ``create_masker(grammar, tokenizer, vocab_size, **options)`` compiles ``grammar`` for
    ``tokenizer`` with logits of width ``vocab_size`` (None: the tokenizer's length).

    ``schema_support`` declares, per JSON-schema construct (keyword, or ``pattern:lookaround``
    ...), a :class:`~shim_adapters.capability.Support` value; undeclared keywords count as
    checked only after generation. ``native_formats`` are the formats compiled without
    conversion (default: all of ``grammar_formats``).
    """

    name: str
    version: str
    grammar_formats: tuple[str, ...]
    feature_status: Mapping[str, FeatureStatus]
    create_masker: Callable[..., Masker]
    description: str = ""
    schema_support: Mapping[str, str] = field(default_factory=dict)
    native_formats: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        unknown = set(self.feature_status) - set(FEATURE_NAMES)
        if unknown:
            raise ValueError(f"backend {self.name!r} declares unknown features {sorted(unknown)}")
        missing = set(FEATURE_NAMES) - set(self.feature_status)
        if missing:
            raise ValueError(f"backend {self.name!r} must declare a status for {sorted(missing)}"
                             " (use FeatureStatus.MISSING)")

    def capability(self, grammar: Grammar):
        """Per-construct support of ``grammar`` on this backend (see :mod:`.capability`)."""
        from .capability import capability_report

        return capability_report(grammar, self)

    def compile(self, grammar: Grammar, tokenizer: object, vocab_size: int | None = None,
                *, strict: bool = False, **options) -> Masker:
        """Compile ``grammar``; ``strict`` refuses one with a construct the mask cannot
        enforce. The masker carries its report as ``masker.capability``."""
        from .capability import check_strict

        report = self.capability(grammar)
        if strict:
            check_strict(report)
        masker = self.create_masker(grammar, tokenizer, vocab_size, **options)
        try:
            masker.capability = report
        except AttributeError:  # a masker with __slots__ keeps no report
            pass
        return masker
