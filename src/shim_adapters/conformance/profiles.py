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
    #: Exhaustive mask check: every token of the vocabulary (special, added and padding ids
    #: included) judged at each of at most ``exhaustive_states`` states, drawn along
    #: ``exhaustive_strings`` valid strings generated at a fixed seed, at every depth or
    #: spread over all depths (checks.EXHAUSTIVE_SAMPLING_RULE).
    exhaustive_states: int = 16
    exhaustive_strings: int = 3
    #: The work above is what a cell checks, on any machine. This wall-clock cap (seconds per
    #: cell, compile excluded) is only a safety net for a runaway cell: the checks it stops
    #: are reported incomplete, an error of the cell, never a pass.
    safety_cap_s: float = 600.0
    #: Samples and length for the controller the γ check fits on the shipped LM.
    gamma_samples: int = 24
    gamma_max_new_tokens: int = 48
    seed: int = 0


PROFILES: dict[str, Profile] = {
    "fast": Profile("fast"),
    "full": Profile("full", uniform_walks=12, rare_walks=12, walk_budget=96, tokens_per_step=32,
                    valid_strings=40, noncanonical_per_string=3, dead_end_tokens_per_step=6,
                    differential_walks=12, differential_tokens_per_step=32, minimise_budget=120,
                    keep_failures=30, exhaustive_states=64, exhaustive_strings=8,
                    safety_cap_s=3600.0, gamma_samples=64,
                    gamma_max_new_tokens=64),
}


#: Time caps that were budgets once: a profile naming one is refused with this advice.
RETIRED_FIELDS = {"phase_budget_s": "work budgets (uniform_walks, rare_walks, valid_strings, "
                                    "exhaustive_states) fix what a cell checks; safety_cap_s is "
                                    "the only time cap",
                  "exhaustive_budget_s": "exhaustive_states fixes the states swept; "
                                         "safety_cap_s is the only time cap"}


def get_profile(profile: "str | Profile", **overrides) -> Profile:
    """A named profile (``fast``/``full``) or a Profile, with field overrides."""
    retired = [k for k in overrides if k in RETIRED_FIELDS]
    if retired:
        raise ValueError("; ".join(f"profile field {k!r} is retired: {RETIRED_FIELDS[k]}"
                                   for k in retired))
    if isinstance(profile, Profile):
        base = profile
    else:
        try:
            base = PROFILES[profile]
        except KeyError:
            raise ValueError(f"unknown conformance profile {profile!r}; "
                             f"choose from {', '.join(PROFILES)}") from None
    return replace(base, **overrides) if overrides else base
