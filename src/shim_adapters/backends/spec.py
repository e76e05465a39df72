"""What a plugin registers: a named backend that compiles a grammar into a Masker."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

from shim_adapters.grammars.grammar import Grammar
from shim_adapters.mask.capability import capability_report, check_strict
from shim_adapters.mask.protocol import FEATURE_NAMES, FeatureStatus, Masker


@dataclass(frozen=True)
class BackendSpec:
    """A masker backend as a plugin declares it.

    ``create_masker(grammar, tokenizer, vocab_size, **options)`` compiles ``grammar`` for
    ``tokenizer`` with logits of width ``vocab_size`` (None: the tokenizer's length).

    ``schema_support`` declares, per JSON-schema construct (keyword, or ``pattern:lookaround``
    ...), a :class:`~shim_adapters.mask.capability.Support` value; undeclared keywords count as
    checked only after generation. ``native_formats`` are the formats compiled without
    conversion (default: all of ``grammar_formats``). ``feature_status_by_format`` overrides
    ``feature_status`` for the formats a backend compiles with another engine (shim-outlines:
    outlines_core for regex/JSON schema, llguidance for CFGs); :meth:`feature_status_for`
    gives the status a masker of one format must declare.
    """

    name: str
    version: str
    grammar_formats: tuple[str, ...]
    feature_status: Mapping[str, FeatureStatus]
    create_masker: Callable[..., Masker]
    description: str = ""
    schema_support: Mapping[str, str] = field(default_factory=dict)
    native_formats: tuple[str, ...] | None = None
    feature_status_by_format: Mapping[str, Mapping[str, FeatureStatus]] = field(
        default_factory=dict)

    def __post_init__(self) -> None:
        for where, status in [("", self.feature_status),
                              *((f" for {f}", s) for f, s in
                                self.feature_status_by_format.items())]:
            unknown = set(status) - set(FEATURE_NAMES)
            if unknown:
                raise ValueError(f"backend {self.name!r} declares unknown features{where} "
                                 f"{sorted(unknown)}")
            missing = set(FEATURE_NAMES) - set(status)
            if missing:
                raise ValueError(f"backend {self.name!r} must declare a status{where} for "
                                 f"{sorted(missing)} (use FeatureStatus.MISSING)")
        stray = set(self.feature_status_by_format) - set(self.grammar_formats)
        if stray:
            raise ValueError(f"backend {self.name!r} declares feature status for formats it "
                             f"does not take: {sorted(stray)}")

    def feature_status_for(self, grammar_format: str) -> Mapping[str, FeatureStatus]:
        """The feature status a masker compiled from ``grammar_format`` declares."""
        return self.feature_status_by_format.get(grammar_format, self.feature_status)

    def capability(self, grammar: Grammar):
        """Per-construct support of ``grammar`` on this backend (see :mod:`.capability`)."""
        return capability_report(grammar, self)

    def compile(self, grammar: Grammar, tokenizer: object, vocab_size: int | None = None,
                *, strict: bool = False, **options) -> Masker:
        """Compile ``grammar``; ``strict`` refuses one with a construct the mask cannot
        enforce. The masker carries its report as ``masker.capability``."""
        report = self.capability(grammar)
        if strict:
            check_strict(report)
        masker = self.create_masker(grammar, tokenizer, vocab_size, **options)
        try:
            masker.capability = report
        except AttributeError:  # a masker with __slots__ keeps no report
            pass
        return masker
