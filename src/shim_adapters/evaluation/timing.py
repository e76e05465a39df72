"""Per-phase timings and memory: the costs docs/design.md asks to report separately.

Phases (one duration per call): ``compile`` (grammar -> masker), ``first_mask`` (the mask at
step 0, often the most expensive), ``mask`` (later masks), ``advance`` (masker consumes a
token), ``gamma`` (the method's re-weighting: SHIM's controller or ASAp's trie lookup),
``apply`` (mask + log γ added to the logits and renormalised), ``lm_forward`` and ``sample``.
"""

from __future__ import annotations

import resource
import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Iterator

import numpy as np

PHASES = ("compile", "first_mask", "mask", "advance", "gamma", "apply", "lm_forward", "sample",
          "asap_update")


class PhaseTimer:
    """Collects one duration per call of each named phase."""

    def __init__(self) -> None:
        self.durations: dict[str, list[float]] = defaultdict(list)

    def add(self, phase: str, seconds: float) -> None:
        self.durations[phase].append(seconds)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - start)

    def merge(self, other: "PhaseTimer") -> None:
        for name, values in other.durations.items():
            self.durations[name].extend(values)

    def summary(self) -> dict[str, dict[str, float]]:
        """Per phase: calls, total seconds, mean/p50/p95/p99 in microseconds."""
        out: dict[str, dict[str, float]] = {}
        order = [p for p in PHASES if p in self.durations]
        order += sorted(set(self.durations) - set(PHASES))
        for name in order:
            values = np.asarray(self.durations[name], dtype=np.float64) * 1e6
            if values.size == 0:
                continue
            out[name] = {
                "calls": int(values.size),
                "total_s": float(values.sum() / 1e6),
                "mean_us": float(values.mean()),
                "p50_us": float(np.percentile(values, 50)),
                "p95_us": float(np.percentile(values, 95)),
                "p99_us": float(np.percentile(values, 99)),
            }
        return out


class NullTimer(PhaseTimer):
    """A timer that records nothing (the default when timings are not wanted)."""

    def add(self, phase: str, seconds: float) -> None:  # noqa: D102 - intentionally empty
        return None


def peak_rss_mib() -> float:
    """Peak resident memory of this process so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
