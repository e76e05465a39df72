"""Upstream bugs the conformance suite knows about: reported as xfail with their repro.

A failure that matches an entry here is counted as *xfailed* (with the bug id) instead of
failed, so a known upstream defect neither hides (it is still listed, with its minimised
repro) nor blocks CI. Each entry names the backend version it was seen in; a backend at
another version is judged without the entry, so a fix (or a regression) shows up.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .report import Repro


@dataclass(frozen=True)
class KnownBug:
    id: str
    backend: str
    #: Backend versions (``Masker.backend_version``) the bug is known in.
    versions: tuple[str, ...]
    check: str
    kinds: tuple[str, ...]
    summary: str
    #: Minimal repro in words (the report carries the concrete one).
    repro: str
    #: Extra condition on the concrete failure (token text, grammar...); None: any of ``kinds``.
    matches: Callable[[Repro], bool] | None = None


#: No backend failed a soundness or canonical completeness check in the full run (see
#: conformance/reports/); add an entry here when one does, with the upstream version.
KNOWN_BUGS: tuple[KnownBug, ...] = ()


def match_known_bug(repro: Repro, backend_version: str) -> str | None:
    """The id of the known bug ``repro`` is an instance of, or None."""
    for bug in KNOWN_BUGS:
        if (bug.backend == repro.backend and backend_version in bug.versions
                and bug.check == repro.check and repro.kind in bug.kinds
                and (bug.matches is None or bug.matches(repro))):
            return bug.id
    return None
