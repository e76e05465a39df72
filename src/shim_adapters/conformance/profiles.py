"""How much each conformance check samples: ``fast`` for CI, ``full`` for release runs."""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Profile:
    name: str
    #: Random walks picking uniformly among allowed tokens, and walks weighted to rare tokens.
    uniform_walks: int = 3
    rare_walks: int = 3
    #: Steps before walks steer towards an end; hard cap is twice this.
    walk_budget: int = 48
    #: Allowed tokens whose extension is checked against the prefix reference, per step.
    tokens_per_step: int = 12
    #: Valid strings generated from the grammar for the completeness check.
    valid_strings: int = 10
    #: Non-canonical tokenizations tried per valid string (char-by-char + random segmentations).
    noncanonical_per_string: int = 2
    #: Allowed tokens followed one step further, per step, for the dead-end check.
    dead_end_tokens_per_step: int = 3
    #: Walks along which backends' masks are compared token by token.
    differential_walks: int = 4
    #: Disagreeing tokens adjudicated per step.
    differential_tokens_per_step: int = 16
    #: Replays allowed when minimising one failure.
    minimise_budget: int = 40
    #: Most repros kept per check.
    keep_failures: int = 20
    #: Seconds each sampling phase (walks, completeness, differential) may take per cell;
    #: a phase stopped by it says so in the report (how many of its items ran).
    phase_budget_s: float = 15.0
    #: Samples and length for the controller the γ check fits on the shipped LM; skipped
    #: (with the measured cost) when the masker is too slow to fit it within phase_budget_s.
    #: Exhaustive mask check: at most this many states (the start, then prefixes of strings
    #: generated at a fixed seed), the whole vocabulary judged at each, within this budget.
    exhaustive_states: int = 10
    exhaustive_strings: int = 4
    exhaustive_budget_s: float = 8.0
    gamma_samples: int = 24
    gamma_max_new_tokens: int = 48
    seed: int = 0


PROFILES: dict[str, Profile] = {
    "fast": Profile("fast"),
    "full": Profile("full", uniform_walks=12, rare_walks=12, walk_budget=96, tokens_per_step=32,
                    valid_strings=40, noncanonical_per_string=3, dead_end_tokens_per_step=6,
                    differential_walks=12, differential_tokens_per_step=32, minimise_budget=120,
                    keep_failures=30, phase_budget_s=240.0, exhaustive_states=64,
                    exhaustive_strings=8, exhaustive_budget_s=120.0, gamma_samples=64,
                    gamma_max_new_tokens=64),
}


def get_profile(profile: "str | Profile", **overrides) -> Profile:
    """A named profile (``fast``/``full``) or a Profile, with field overrides."""
    if isinstance(profile, Profile):
        base = profile
    else:
        try:
            base = PROFILES[profile]
        except KeyError:
            raise ValueError(f"unknown conformance profile {profile!r}; "
                             f"choose from {', '.join(PROFILES)}") from None
    return replace(base, **overrides) if overrides else base
