"""What a new user meets first: one reading of a ``.regex`` file, errors before usage, install
hints that exist, a damaged artefact refused before anything compiles, and the grammar a
controller was fitted on read back from its artefact."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from shim_adapters import cli
from shim_adapters.backends.registry import get_backend
from shim_adapters.backends.spec import BackendSpec
from shim_adapters.conformance.runner import _resolve_grammar
from shim_adapters.errors import BackendNotFoundError, GrammarError
from shim_adapters.grammars import Grammar, load_grammar
from shim_adapters.shim.artefact import fitted_grammar, read_manifest
from shim_adapters.shim.fitting import fit_controller


def run(*args):
    return CliRunner().invoke(cli.main, list(map(str, args)), prog_name="shim")


@pytest.mark.parametrize("ending", ["\n", "\r\n", ""])
def test_a_regex_file_means_its_content_without_the_final_newline(tmp_path, ending):
    path = tmp_path / "id.regex"
    path.write_bytes(f"[a-z]+(-[0-9]+)?{ending}".encode())
    loaded = load_grammar(path)
    assert loaded.text == "[a-z]+(-[0-9]+)?"
    assert _resolve_grammar(str(path)).sha256 == loaded.sha256  # conformance reads it alike


def test_a_regex_that_needs_a_newline_says_so_in_the_pattern(tmp_path):
    path = tmp_path / "line.regex"
    path.write_text("[a-z]+\\n\n")
    assert load_grammar(path).text == "[a-z]+\\n"


def test_an_unknown_backend_gets_no_made_up_install_command():
    with pytest.raises(BackendNotFoundError) as exc:
        get_backend("nosuch")
    message = str(exc.value)
    assert "plugins/shim-nosuch" not in message
    assert "entry point" in message and "'shim_adapters'" in message


def test_the_reason_comes_before_the_usage():
    result = run("sample", "--max-new-tokens", "-3")
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert lines[0].startswith("shim sample: error: Invalid value for '--max-new-tokens'"), lines
    assert any(line.startswith("Usage: shim sample") for line in lines[1:])


@pytest.fixture(scope="module")
def artefact(lm, tmp_path_factory):
    grammar = Grammar('start: "x" ("0" | "1")+ "y"\n', "lark", "xbits")
    masker = get_backend("xgrammar").compile(grammar, lm.tokenizer, lm.vocab_size)
    out = tmp_path_factory.mktemp("artefact") / "xbits"
    fit_controller(lm, masker, "Write x, some bits, then y:\n", n_samples=24, output_dir=out,
                   max_new_tokens=12, progress=False, max_samples=None,
                   stop_at_newline=False)
    (out.parent / "xbits.lark").write_text(grammar.text)
    return out


def test_a_damaged_artefact_is_refused_before_the_grammar_compiles(artefact, tmp_path,
                                                                   monkeypatch):
    import shutil

    damaged = tmp_path / "damaged"
    shutil.copytree(artefact, damaged)
    weights = next(damaged.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))

    def no_compile(*args, **kwargs):
        raise AssertionError("the grammar was compiled before the artefact was checked")

    monkeypatch.setattr(BackendSpec, "compile", no_compile)
    monkeypatch.setattr(BackendSpec, "capability", no_compile)
    result = run("sample", "--grammar", artefact.parent / "xbits.lark", "--backend", "xgrammar",
                 "--prompt-text", "Bits:", "--controller", damaged)
    assert result.exit_code == 2, result.output
    assert "sha256" in result.output and str(weights.name) in result.output


def test_the_fitted_grammar_comes_back_from_the_artefact(artefact):
    manifest = read_manifest(artefact)
    grammar = fitted_grammar(manifest)
    assert grammar.sha256 == manifest["grammar_sha256"]
    assert grammar.text == (artefact.parent / "xbits.lark").read_text()


def test_an_edited_grammar_text_is_refused(artefact):
    manifest = dict(read_manifest(artefact))
    manifest["grammar_text"] = manifest["grammar_text"].replace('"y"', '"z"')
    with pytest.raises(GrammarError, match="does not hash"):
        fitted_grammar(manifest)


def test_a_builtin_comes_back_with_its_prompt():
    from shim_adapters.grammars import builtin_grammar

    bv4 = builtin_grammar("bv4")
    manifest = {"grammar_name": "bv4", "grammar_sha256": bv4.sha256}
    assert fitted_grammar(manifest).default_prompt == bv4.default_prompt
