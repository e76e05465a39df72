"""The backend contract: what every masker backend must do, checked against real grammars.

Any plugin can run it against itself, over the four built-in grammars and the shipped LM's
tokenizer (with padding ids added to the logits width, so padding handling is exercised):

    pytest --pyargs shim_adapters.conformance.contract                     # every installed backend
    SHIM_CONTRACT_BACKENDS=mybackend pytest --pyargs shim_adapters.conformance.contract
    SHIM_CONTRACT_TOKENIZER=gpt2 pytest --pyargs shim_adapters.conformance.contract   # another tokenizer
    SHIM_CONTRACT_GRAMMARS=my.lark,id.regex pytest --pyargs shim_adapters.conformance.contract
    python -m shim_adapters.conformance.contract mybackend --grammar my.lark   # without pytest

or from code: ``run_contract("mybackend")`` returns one :class:`ContractOutcome` per check and
grammar; ``assert_contract("mybackend")`` raises on the first violation.

The checks: mask shape equals the logits width; padding ids are never allowed; EOS is in the
mask exactly when ``eos_allowed()``, and only where the independent reference accepts; a
forbidden token (text, special or padding) raises ForbiddenTokenError naming the token, the
step and the state, and leaves the state usable; forks are independent; ``features()`` fields
are None exactly where the backend declares the feature missing, with the declared types;
``describe()`` is a non-empty line; random walks over allowed tokens end in strings the
reference acceptor accepts.
"""

from __future__ import annotations

import argparse
import functools
import os
import random
import sys
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from shim_adapters.backends.registry import backends, get_backend
from shim_adapters.backends.spec import BackendSpec
from shim_adapters.conformance.checks import CellContext, _choose
from shim_adapters.conformance.profiles import get_profile
from shim_adapters.conformance.runner import resolve_tokenizer
from shim_adapters.errors import ForbiddenTokenError
from shim_adapters.grammars.grammar import BUILTIN_GRAMMARS, Grammar, builtin_grammar, load_grammar
from shim_adapters.grammars.reference import reference_acceptor
from shim_adapters.lm.loading import load_lm
from shim_adapters.mask.protocol import (
    FEATURE_NAMES,
    FeatureStatus,
    Masker,
    MaskerState,
    StateFeatures,
)
from shim_adapters.mask.vocab import Vocabulary

#: Grammars every backend is checked on.
CONTRACT_GRAMMARS: tuple[str, ...] = tuple(BUILTIN_GRAMMARS)
#: One grammar per other format, so a regex-only or schema-only plugin can run the contract:
#: a backend is checked on these of the formats it declares (``BackendSpec.grammar_formats``).
FORMAT_GRAMMARS: dict[str, Grammar] = {
    "regex:semver": Grammar(r"(v|V)?[0-9]+\.[0-9]+(\.[0-9]+)?(-(alpha|beta|rc)[0-9]*)?",
                            "regex", "semver"),
    "json_schema:point": Grammar('{"type": "object", "properties": {"x": {"type": "integer"}, '
                                 '"y": {"type": "integer"}}, "required": ["x", "y"], '
                                 '"additionalProperties": false}', "json_schema", "point"),
    "ebnf:bits": Grammar('root ::= bit bit*\nbit ::= "0" | "1"\n', "ebnf", "bits"),
}


#: Contract violations of our own plugins found by the per-format grammars, with the reason:
#: the pytest entry marks them xfail (strict: a fix shows as XPASS and fails, so the entry
#: goes). Keyed by (backend, grammar). Empty: shim-outlines now registers its feature status
#: per format (``BackendSpec.feature_status_by_format``).
KNOWN_CONTRACT_VIOLATIONS: dict[tuple[str, str], str] = {}


def contract_grammars(backend: str) -> tuple[str, ...]:
    """The grammars ``backend`` is checked on: the grammar files named by
    $SHIM_CONTRACT_GRAMMARS (a plugin whose backend takes only some grammars of a format names
    its own), else the built-ins if it takes Lark, plus one per other format it declares."""
    chosen = os.environ.get(GRAMMARS_ENV_VAR)
    if chosen:
        return tuple(g.strip() for g in chosen.split(",") if g.strip())
    formats = set(get_backend(backend).grammar_formats)
    names = list(CONTRACT_GRAMMARS) if "lark" in formats else []
    names += [key for key, g in FORMAT_GRAMMARS.items() if g.format in formats]
    return tuple(names)


def contract_grammar(name: str) -> Grammar:
    """A ``format:name`` key of :data:`FORMAT_GRAMMARS`, a built-in name or a grammar file."""
    return FORMAT_GRAMMARS[name] if name in FORMAT_GRAMMARS else load_grammar(name)
#: Extra logits beyond the tokenizer's vocabulary, as real models pad their embedding.
CONTRACT_PADDING = 37
#: Environment variable restricting the pytest run to some backends (comma-separated).
BACKENDS_ENV_VAR = "SHIM_CONTRACT_BACKENDS"
#: Environment variable naming the grammar files to check on (comma-separated).
GRAMMARS_ENV_VAR = "SHIM_CONTRACT_GRAMMARS"
#: Environment variable choosing another tokenizer than the shipped LM's.
TOKENIZER_ENV_VAR = "SHIM_CONTRACT_TOKENIZER"


class ContractViolation(AssertionError):
    """A backend breaks the masker contract; the message names the grammar, step and state."""


@dataclass(frozen=True)
class ContractOutcome:
    backend: str
    grammar: str
    check: str
    ok: bool
    message: str = ""


def _require(condition: bool, message: Callable[[], str] | str) -> None:
    if not condition:
        raise ContractViolation(message() if callable(message) else message)


# ---------------------------------------------------------------------------------------------
# Shared setup
# ---------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def contract_tokenizer():
    """(tokenizer, logits width) with CONTRACT_PADDING padding ids: the shipped LM's, or the
    one named by $SHIM_CONTRACT_TOKENIZER (an offline name such as ``gpt2``, or a directory)."""
    chosen = os.environ.get(TOKENIZER_ENV_VAR)
    if chosen:
        tok = resolve_tokenizer(chosen)
        return tok.tokenizer, max(tok.logits_width, len(tok.tokenizer)) + CONTRACT_PADDING

    lm = load_lm(None)
    return lm.tokenizer, max(lm.vocab_size, len(lm.tokenizer)) + CONTRACT_PADDING


@functools.lru_cache(maxsize=64)
def contract_masker(backend: str, grammar: str) -> Masker:
    """The backend's masker for a contract grammar and the contract tokenizer (cached)."""
    tokenizer, width = contract_tokenizer()
    return get_backend(backend).compile(contract_grammar(grammar), tokenizer, width)


def _walk_context(masker: Masker, seed: int):
    return CellContext(masker=masker, grammar=masker.grammar,
                       vocab=Vocabulary(masker.tokenizer, masker.vocab_size),
                       tokenizer_name="contract", profile=get_profile("fast", seed=seed,
                                                                     walk_budget=40),
                       prefix=None, rng=random.Random(seed))


def _mask(state: MaskerState) -> np.ndarray:
    """The state's mask, after checking it is a bool vector over the full logits width."""
    mask = state.allowed_mask()
    width = state.masker.vocab_size
    _require(isinstance(mask, np.ndarray) and mask.dtype == np.bool_,
             lambda: f"allowed_mask() returned {type(mask).__name__} of dtype "
                     f"{getattr(mask, 'dtype', '?')}, not np.bool_; step {state.step}")
    _require(mask.shape == (width,),
             lambda: f"mask shape {mask.shape} != logits width ({width},); step {state.step}, "
                     f"grammar {state.masker.grammar.name}")
    return mask


def _states_along_walk(masker: Masker, seed: int, steps: int = 12) -> list[MaskerState]:
    """Forks of the states a short random walk visits (the fresh state first)."""
    ctx = _walk_context(masker, seed)
    state = masker.new_state()
    visited = [state.fork()]
    for _ in range(steps):
        allowed = np.flatnonzero(_mask(state) & ctx.is_text)
        if not len(allowed):
            break
        state.advance(int(allowed[ctx.rng.randrange(len(allowed))]))
        visited.append(state.fork())
    return visited


# ---------------------------------------------------------------------------------------------
# The checks (each raises ContractViolation)
# ---------------------------------------------------------------------------------------------
def check_mask_shape(masker: Masker, seed: int = 0) -> None:
    """Every mask is a bool vector over the full logits width."""
    for state in _states_along_walk(masker, seed):
        mask = _mask(state)
        _require(isinstance(mask, np.ndarray) and mask.dtype == np.bool_,
                 lambda: f"allowed_mask() returned {type(mask).__name__} of dtype "
                         f"{getattr(mask, 'dtype', '?')}, not np.bool_; {state.describe()}")
        _require(mask.shape == (masker.vocab_size,),
                 lambda: f"mask shape {mask.shape} != logits width ({masker.vocab_size},); "
                         f"{state.describe()}")


def check_padding_masked(masker: Masker, seed: int = 0) -> None:
    """Ids beyond the tokenizer's vocabulary are never allowed."""
    n = len(masker.tokenizer)
    for state in _states_along_walk(masker, seed):
        pad = np.flatnonzero(_mask(state)[n:])
        _require(not len(pad), lambda: f"{len(pad)} padding ids allowed (first {n + pad[0]}); "
                                       f"{state.describe()}")


def check_eos_only_when_accepting(masker: Masker, seed: int = 0) -> None:
    """EOS is in the mask iff eos_allowed(), and only where the reference accepts the text."""
    ref = reference_acceptor(masker.grammar)
    ctx = _walk_context(masker, seed)
    for state in _states_along_walk(masker, seed, steps=40):
        mask = _mask(state)
        eos = state.eos_allowed()
        in_mask = {e: bool(mask[e]) for e in masker.eos_token_ids if e < masker.vocab_size}
        _require(all(v == eos for v in in_mask.values()),
                 lambda: f"eos_allowed()={eos} but EOS ids in the mask: {in_mask}; "
                         f"{state.describe()}")
        if eos:
            text = ctx.data(list(state.token_ids)).decode(errors="replace")
            _require(ref.accepts(text), lambda: f"EOS allowed after {text!r}, which the "
                                                f"reference rejects; {state.describe()}")


def _expect_forbidden(state: MaskerState, token: int, kind: str) -> None:
    before = _mask(state).copy()
    step = state.step
    try:
        state.advance(token)
    except ForbiddenTokenError as exc:
        _require(exc.token_id == token and exc.step == step,
                 f"ForbiddenTokenError for {kind} token {token} names token {exc.token_id} "
                 f"step {exc.step} (expected {token}, step {step})")
        _require(str(token) in str(exc) and f"step {step}" in str(exc) and exc.state,
                 f"ForbiddenTokenError message must name token, step and state: {exc}")
    except Exception as exc:  # noqa: BLE001 - the wrong error type is the violation
        raise ContractViolation(f"advance({kind} token {token}) raised {type(exc).__name__}: "
                                f"{exc}; expected ForbiddenTokenError") from exc
    else:
        raise ContractViolation(f"advance() accepted forbidden {kind} token {token} at step "
                                f"{step}; {state.describe()}")
    _require(state.step == step and np.array_equal(_mask(state), before),
             f"a refused {kind} token changed the state (step {step} -> {state.step})")


def check_forbidden_token_error(masker: Masker, seed: int = 0) -> None:
    """A forbidden token raises ForbiddenTokenError (token, step, state) and changes nothing."""
    ctx = _walk_context(masker, seed)
    for state in _states_along_walk(masker, seed, steps=4):
        mask = _mask(state)
        text_forbidden = np.flatnonzero(~mask & ctx.is_text)
        if len(text_forbidden):
            _expect_forbidden(state, int(text_forbidden[ctx.rng.randrange(len(text_forbidden))]),
                              "text")
        if masker.vocab_size > len(masker.tokenizer):
            _expect_forbidden(state, masker.vocab_size - 1, "padding")
        specials = [int(i) for i in ctx.non_eos_special if not mask[i]]
        if specials:
            _expect_forbidden(state, specials[0], "special")
        if not state.eos_allowed():
            _expect_forbidden(state, min(masker.eos_token_ids), "EOS")


def check_fork_independence(masker: Masker, seed: int = 0) -> None:
    """Advancing a fork never changes the original, and vice versa."""
    ctx = _walk_context(masker, seed)
    for state in _states_along_walk(masker, seed, steps=6):
        allowed = np.flatnonzero(_mask(state) & ctx.is_text)
        if not len(allowed):
            continue
        ids = list(state.token_ids)
        mask = _mask(state).copy()
        fork = state.fork()
        a = int(allowed[ctx.rng.randrange(len(allowed))])
        fork.advance(a)
        _require(list(state.token_ids) == ids and np.array_equal(_mask(state), mask),
                 lambda: f"advancing a fork by {a} changed the original; {state.describe()}")
        fork_ids = list(fork.token_ids)
        fork_mask = _mask(fork).copy()
        b = int(allowed[ctx.rng.randrange(len(allowed))])
        state.advance(b)
        _require(list(fork.token_ids) == fork_ids and np.array_equal(_mask(fork),
                                                                      fork_mask),
                 lambda: f"advancing the original by {b} changed its fork; {fork.describe()}")
        replay = masker.new_state()
        for t in fork_ids:
            replay.advance(t)
        _require(np.array_equal(_mask(replay), fork_mask),
                 lambda: f"a fork's mask differs from a fresh replay of {fork_ids}")


def check_features_match_status(masker: Masker, spec: BackendSpec | None = None,
                                seed: int = 0) -> None:
    """features() fields are None exactly where the backend declares the feature missing."""
    status = dict(masker.feature_status)
    _require(set(status) == set(FEATURE_NAMES),
             f"feature_status declares {sorted(status)}, expected {sorted(FEATURE_NAMES)}")
    if spec is not None:
        registered = spec.feature_status_for(masker.grammar.format)
        _require({k: FeatureStatus(v) for k, v in registered.items()}
                 == {k: FeatureStatus(v) for k, v in status.items()},
                 f"masker.feature_status {status} differs from the status registered for "
                 f"{masker.grammar.format} grammars {dict(registered)}")
    types = {"parser_state": tuple, "lexer_state": frozenset, "partial_lexeme": str}
    for state in _states_along_walk(masker, seed):
        feats = state.features()
        _require(isinstance(feats, StateFeatures),
                 f"features() returned {type(feats).__name__}, not StateFeatures")
        for name in FEATURE_NAMES:
            value = getattr(feats, name)
            missing = FeatureStatus(status[name]) is FeatureStatus.MISSING
            _require((value is None) == missing,
                     lambda: f"feature {name} is {'None' if value is None else 'present'} but "
                             f"declared {status[name]}; {state.describe()}")
            if value is not None:
                _require(isinstance(value, types[name]),
                         f"feature {name} is {type(value).__name__}, expected "
                         f"{types[name].__name__}")
        if feats.parser_state is not None:
            _require(all(isinstance(x, str) for x in feats.parser_state),
                     "parser_state items must be strings")
        if feats.lexer_state is not None:
            _require(all(isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str)
                         and isinstance(x[1], (int, np.integer)) for x in feats.lexer_state),
                     "lexer_state items must be (terminal: str, position: int) pairs")
        hash(tuple(sorted(feats.extra.items(), key=lambda kv: kv[0])))  # extras are hashable


def check_describe(masker: Masker, seed: int = 0) -> None:
    """describe() is one non-empty line naming the backend."""
    for state in _states_along_walk(masker, seed, steps=3):
        text = state.describe()
        _require(isinstance(text, str) and text.strip() and "\n" not in text,
                 f"describe() must be one non-empty line, got {text!r}")


def check_random_walks(masker: Masker, walks: int = 3, seed: int = 0) -> None:
    """Walks over allowed tokens that end in EOS end in strings the reference accepts."""
    ref = reference_acceptor(masker.grammar)
    ctx = _walk_context(masker, seed)
    finished = 0
    for w in range(walks):
        state = masker.new_state()
        for step in range(2 * ctx.profile.walk_budget):
            mask = _mask(state)
            allowed = np.flatnonzero(mask & ctx.is_text)
            eos = state.eos_allowed()
            _require(len(allowed) or eos,
                     lambda: f"dead end: nothing allowed and no EOS; {state.describe()}")
            choice = _choose(ctx, "uniform", allowed, eos, step)
            if choice is None:
                text = ctx.data(list(state.token_ids)).decode(errors="replace")
                _require(ref.accepts(text), lambda: f"walk {w} ended (EOS) in {text!r}, which "
                                                    f"the reference rejects; {state.describe()}")
                state.advance(min(masker.eos_token_ids))
                _require(state.is_finished and not _mask(state).any(),
                         f"after EOS: is_finished={state.is_finished}, "
                         f"{int(_mask(state).sum())} tokens still allowed")
                finished += 1
                break
            state.advance(choice)
    _require(finished > 0, f"none of {walks} random walks reached EOS within "
                           f"{2 * ctx.profile.walk_budget} steps")


#: Every contract check, by name (each takes the masker; features also takes the spec).
CONTRACT_CHECKS: dict[str, Callable[..., None]] = {
    "mask_shape": check_mask_shape,
    "padding_masked": check_padding_masked,
    "eos_only_when_accepting": check_eos_only_when_accepting,
    "forbidden_token_error": check_forbidden_token_error,
    "fork_independence": check_fork_independence,
    "features_match_status": check_features_match_status,
    "describe": check_describe,
    "random_walks": check_random_walks,
}


def run_contract(backend: str, grammars: Sequence[str] | None = None,
                 seed: int = 0) -> list[ContractOutcome]:
    """Every contract check for ``backend`` on each grammar (default: those of every format it
    declares, :func:`contract_grammars`); violations are outcomes, not raised."""
    spec = get_backend(backend)
    grammars = contract_grammars(backend) if grammars is None else grammars
    out = []
    for grammar in grammars:
        try:
            masker = contract_masker(backend, grammar)
        except Exception as exc:  # noqa: BLE001 - a compile failure is an outcome
            out.append(ContractOutcome(backend, grammar, "compile", False,
                                       f"{type(exc).__name__}: {exc}"))
            continue
        for name, check in CONTRACT_CHECKS.items():
            try:
                if name == "features_match_status":
                    check(masker, spec, seed=seed)
                else:
                    check(masker, seed=seed)
                out.append(ContractOutcome(backend, grammar, name, True))
            except ContractViolation as exc:
                out.append(ContractOutcome(backend, grammar, name, False, str(exc)))
    return out


def assert_contract(backend: str, grammars: Sequence[str] | None = None) -> None:
    """Raise ContractViolation listing every violation of ``backend``."""
    bad = [o for o in run_contract(backend, grammars) if not o.ok]
    if bad:
        raise ContractViolation("\n".join(f"{o.backend}/{o.grammar}/{o.check}: {o.message}"
                                          for o in bad))


# ---------------------------------------------------------------------------------------------
# pytest entry point: ``pytest --pyargs shim_adapters.conformance.contract``
# ---------------------------------------------------------------------------------------------
def contract_backends() -> list[str]:
    """Backends under test: $SHIM_CONTRACT_BACKENDS, else every installed backend."""
    chosen = os.environ.get(BACKENDS_ENV_VAR)
    if chosen:
        return [b.strip() for b in chosen.split(",") if b.strip()]
    return list(backends())


def pytest_generate_tests(metafunc) -> None:
    names = None
    if "contract_backend" in metafunc.fixturenames:
        names = contract_backends()
        if not names:
            raise RuntimeError("no masker backend is installed: pip install plugins/shim-NAME "
                               "(the contract suite needs at least one)")
    if names is not None and "contract_grammar" in metafunc.fixturenames:
        import pytest

        pairs = []
        for b in names:
            for g in contract_grammars(b):
                reason = KNOWN_CONTRACT_VIOLATIONS.get((b, g))
                marks = [pytest.mark.xfail(reason=reason, strict=True)] if reason else []
                pairs.append(pytest.param(b, g, marks=marks, id=f"{b}-{g}"))
        metafunc.parametrize("contract_backend,contract_grammar", pairs)
    elif names is not None:
        metafunc.parametrize("contract_backend", names)


def test_backend_contract_check(contract_backend: str, contract_grammar: str) -> None:
    """All contract checks for one backend and grammar (each named in the failure)."""
    masker = contract_masker(contract_backend, contract_grammar)
    spec = get_backend(contract_backend)
    failures = []
    for name, check in CONTRACT_CHECKS.items():
        try:
            if name == "features_match_status":
                check(masker, spec)
            else:
                check(masker)
        except ContractViolation as exc:
            failures.append(f"{name}: {exc}")
    assert not failures, (f"{contract_backend} on {contract_grammar} breaks the contract:\n"
                          + "\n".join(failures))


def test_backend_registration(contract_backend: str) -> None:
    """The registered spec is complete: version, formats, a status for every feature."""
    spec = get_backend(contract_backend)
    assert spec.version and spec.grammar_formats, spec
    assert set(spec.feature_status) == set(FEATURE_NAMES), spec.feature_status
    masker = contract_masker(contract_backend, contract_grammars(contract_backend)[0])
    assert masker.backend_name == spec.name and masker.backend_version, masker
    assert masker.vocab_size == contract_tokenizer()[1]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m shim_adapters.conformance.contract",
        description="Run the backend contract on installed backends (default: all).")
    parser.add_argument("backends", nargs="*", help="backend names (default: every installed)")
    parser.add_argument("--grammar", action="append", default=None, metavar="FILE",
                        help="a grammar file to check on (repeatable; default: the built-ins "
                             "and one grammar per format the backend declares)")
    args = parser.parse_args(argv)
    names = args.backends or contract_backends()
    bad = 0
    for name in names:
        for o in run_contract(name, grammars=args.grammar):
            bad += not o.ok
            print(f"{'ok  ' if o.ok else 'FAIL'} {o.backend:10s} {o.grammar:8s} {o.check}"
                  + ("" if o.ok else f"\n     {o.message}"))
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
