"""The backend contract over every installed backend x the four built-in grammars, plus proof
that each contract check fails on a real masker with that one defect injected."""

from __future__ import annotations

import pytest

from shim_adapters.backends.registry import backends, get_backend
from shim_adapters.conformance.contract import (
    CONTRACT_CHECKS,
    ContractViolation,
    contract_masker,
    contract_tokenizer,
    pytest_generate_tests,  # noqa: F401  (parametrises below)
    run_contract,
    test_backend_contract_check,  # noqa: F401
    test_backend_registration,  # noqa: F401
)
from shim_adapters.conformance.faults import FaultyMasker


def _healthy_backend() -> str:
    """A backend to inject faults into: the fastest installed one."""
    installed = list(backends())
    for name in ("xgrammar", "outlines", "syncode"):
        if name in installed:
            return name
    assert installed, "no masker backend installed (pip install plugins/shim-xgrammar)"
    return installed[0]


#: Fault -> the contract check that must catch it.
FAULT_CATCHERS = {
    "short_mask": "mask_shape",
    "padding_allowed": "padding_masked",
    "eos_always": "eos_only_when_accepting",
    "no_raise": "forbidden_token_error",
    "sticky_refusal": "forbidden_token_error",
    "shared_fork": "fork_independence",
    "features_none": "features_match_status",
}


@pytest.mark.parametrize("fault", sorted(FAULT_CATCHERS))
def test_contract_check_catches_injected_fault(fault):
    backend = _healthy_backend()
    if fault == "features_none" and all(str(getattr(v, "value", v)) == "missing"
                                        for v in get_backend(backend).feature_status.values()):
        pytest.fail(f"{backend} declares no feature; features_none needs one that does")
    masker = FaultyMasker(contract_masker(backend, "json"), fault)
    check = CONTRACT_CHECKS[FAULT_CATCHERS[fault]]
    with pytest.raises(ContractViolation) as info:
        if FAULT_CATCHERS[fault] == "features_match_status":
            check(masker, get_backend(backend))
        else:
            check(masker)
    assert str(info.value).strip()


def test_healthy_masker_passes_every_check_the_faults_break():
    """The same checks pass on the unmodified masker (so the failures above are the faults)."""
    backend = _healthy_backend()
    masker = contract_masker(backend, "json")
    for name in set(FAULT_CATCHERS.values()):
        if name == "features_match_status":
            CONTRACT_CHECKS[name](masker, get_backend(backend))
        else:
            CONTRACT_CHECKS[name](masker)


def test_run_contract_reports_outcomes_per_check_and_grammar():
    backend = _healthy_backend()
    outcomes = run_contract(backend, grammars=("binary5",))
    assert {o.check for o in outcomes} == set(CONTRACT_CHECKS)
    assert all(o.ok for o in outcomes), [o for o in outcomes if not o.ok]


def test_contract_tokenizer_has_padding():
    tokenizer, width = contract_tokenizer()
    assert width > len(tokenizer)


def test_registration_check_uses_a_grammar_format_the_plugin_declares(example_plugin):
    """The registration check compiles a grammar of a format the plugin declares (it used to
    compile a Lark built-in and fail every plugin without Lark)."""
    from shim_adapters.conformance.contract import contract_grammars

    names = contract_grammars("choices")
    assert names and all(n.startswith("regex:") for n in names), names


def test_a_plugin_names_its_own_contract_grammars(example_plugin, tmp_path, monkeypatch):
    """A backend that takes only some grammars of its format (the example: literal choices)
    runs the whole contract, both entry points, on grammar files it names."""
    from shim_adapters.conformance.contract import GRAMMARS_ENV_VAR, main

    grammar = tmp_path / "answers.regex"
    grammar.write_text("yes|no|maybe\n")
    monkeypatch.setenv(GRAMMARS_ENV_VAR, str(grammar))
    test_backend_registration("choices")
    outcomes = run_contract("choices")
    assert outcomes and {o.grammar for o in outcomes} == {str(grammar)}
    assert all(o.ok for o in outcomes), [o.message for o in outcomes if not o.ok]
    monkeypatch.delenv(GRAMMARS_ENV_VAR)
    assert main(["choices", "--grammar", str(grammar)]) == 0
