"""The pytest plugin: one line in a user's CI runs conformance on their grammars and fails
exactly the failure classes that fail, with the repros."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

UNFINISHED = Path(__file__).resolve().parents[1] / "conformance" / "grammars" / \
    "unfinished_list.lark"


def test_plugin_one_liner_fails_only_the_failing_class(pytester):
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--shim-conformance=xgrammar",
                                "--shim-tokenizer=default", "--shim-grammar=binary5",
                                f"--shim-grammar={UNFINISHED}")
    # control-tokens: the shipped tokenizer has no added token, so that class is skipped
    # with its reason, never passed
    result.assert_outcomes(passed=7, failed=1, skipped=2)
    result.stdout.fnmatch_lines(["*unfinished_list.lark::dead-ends*",
                                 "*no_finite_completion: after '[' token*"])


def test_plugin_fail_on_and_usage_error(pytester):
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--shim-conformance=xgrammar",
                                f"--shim-grammar={UNFINISHED}",
                                "--shim-fail-on=soundness,errors")
    result.assert_outcomes(passed=2)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--shim-conformance=xgrammar")
    assert result.ret != 0
    result.stderr.fnmatch_lines(["*needs at least one --shim-grammar*"])
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--shim-conformance=nope",
                                           "--shim-grammar=binary5")
    assert result.ret == 4  # pytest's usage error
    result.stderr.fnmatch_lines(["*no backend named 'nope' is installed*"])
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--shim-conformance=xgrammar",
                                           "--shim-grammar=binary5", "--shim-accept-known=typo")
    result.stderr.fnmatch_lines(["*no known bug 'typo'*"])


PERSON = Path(__file__).resolve().parents[1] / "conformance" / "grammars" / "person.json"


@pytest.mark.slow  # two subprocess runs of the fast profile on a schema (minutes on 2 cores)
def test_plugin_known_bugs_fail_until_accepted_by_id(pytester):
    """XGrammar's trailing-whitespace refusal on a JSON schema is a known bug: it fails the
    completeness test until --shim-accept-known names it, and is listed either way."""
    bug = "xgrammar-schema-trailing-whitespace-refused"
    args = ["-p", "no:cacheprovider", "--shim-conformance=xgrammar", f"--shim-grammar={PERSON}",
            "--shim-fail-on=completeness"]
    result = pytester.runpytest_subprocess(*args)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([f"*known bug {bug} met*--accept-known {bug}*"])
    result = pytester.runpytest_subprocess(*args, f"--shim-accept-known={bug}",
                                           "--shim-accept-known=xgrammar-schema-escapes-refused",
                                           "--shim-accept-known="
                                           "xgrammar-schema-escapes-refused-edge")
    result.assert_outcomes(passed=1)


def test_fixture_fails_the_calling_test_with_the_repros(pytester):
    pytester.makepyfile(f'''
def test_mine(shim_conformance):
    shim_conformance("xgrammar", "default", {str(UNFINISHED)!r}, uniform_walks=1,
                     rare_walks=1, valid_strings=4)

def test_clean(shim_conformance):
    report = shim_conformance("xgrammar", "default", "binary5", uniform_walks=1,
                              rare_walks=1, valid_strings=4)
    assert report.exit_code == 0
''')
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*dead-ends failed (exit bit 4)*"])
