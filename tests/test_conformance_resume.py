"""A long matrix run survives being killed: finished cells are logged as they complete, a
resume runs only the rest, and cells run under other settings are never mixed in."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from shim_adapters.conformance.__main__ import main as conformance_main
from shim_adapters.conformance.cell_log import CellLog, ResumeMismatchError
from shim_adapters.conformance.runner import run_profile_file

ROOT = Path(__file__).resolve().parents[1]
PROFILE = {"profile": "fast", "gamma": False, "backends": ["xgrammar", "outlines"],
           "tokenizers": ["default"],
           "grammars": ["binary5", str(ROOT / "conformance" / "grammars" / "semver.regex")],
           "overrides": {"uniform_walks": 1, "rare_walks": 1, "valid_strings": 4,
                         "exhaustive_states": 4}}


def _ran(messages: list[str]) -> list[str]:
    """The cells a run computed (not taken from the log), from its progress lines."""
    return [m.split(":")[0].removeprefix("[conformance] ") for m in messages
            if m.startswith("[conformance] ") and " x " in m and "differential" not in m
            and "imported" not in m]


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    profile = root / "tiny.json"
    profile.write_text(json.dumps(PROFILE))
    log_path = root / "out" / "conformance-tiny.cells.jsonl"
    said: list[str] = []
    report = run_profile_file(profile, progress=said.append, log_path=log_path)
    return profile, log_path, report, said


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().split("\n") if line]


def test_every_cell_is_logged_as_it_finishes_with_its_commit(first_run):
    _profile, log_path, report, said = first_run
    kinds = [e["kind"] for e in _lines(log_path)]
    assert kinds == ["header", "cell", "cell", "differential", "cell", "cell", "differential"]
    assert len(_ran(said)) == 4 and report.meta["remaining_cells"] == 0
    header = _lines(log_path)[0]
    assert header["settings"]["profile"]["uniform_walks"] == 1
    assert all(c.commit == header["commit"] for c in report.cells)
    md = report.to_markdown()
    assert "| total s | commit |" in md and md.count(f"| {header['commit']} |") == 4
    assert "## Wall time per cell" in md


def test_a_killed_run_resumes_without_rerunning_finished_cells(first_run, tmp_path):
    profile, log_path, report, _said = first_run
    killed = tmp_path / log_path.name
    lines = log_path.read_text().split("\n")
    # Killed while writing its third line: header, one cell, half a line.
    killed.write_text("\n".join(lines[:2]) + "\n" + lines[2][:40])
    said: list[str] = []
    resumed = run_profile_file(profile, progress=said.append, log_path=killed, resume=True)
    assert _ran(said) == ["outlines x shipped x binary5", "xgrammar x shipped x semver.regex",
                          "outlines x shipped x semver.regex"]
    assert [c.key for c in resumed.cells] == [c.key for c in report.cells]
    kept = resumed.cells[0]
    assert (kept.checks["soundness"].passed, kept.seconds) == (
        report.cells[0].checks["soundness"].passed, report.cells[0].seconds)
    assert len(resumed.differential) == 2 and resumed.meta["remaining_cells"] == 0
    # A second resume has nothing left to run and gives the same verdicts.
    again: list[str] = []
    final = run_profile_file(profile, progress=again.append, log_path=killed, resume=True)
    assert _ran(again) == [] and final.exit_code == resumed.exit_code
    assert final.to_dict()["failing_classes"] == resumed.to_dict()["failing_classes"]


def test_a_resume_refuses_other_settings_and_an_unasked_overwrite(first_run, tmp_path):
    profile, log_path, _report, _said = first_run
    copy = tmp_path / log_path.name
    shutil.copy(log_path, copy)
    with pytest.raises(ResumeMismatchError, match="exists: pass --resume"):
        run_profile_file(profile, progress=None, log_path=copy)
    with pytest.raises(ResumeMismatchError, match=r"profile\.seed: 0 vs 5"):
        run_profile_file(profile, progress=None, log_path=copy, resume=True, seed=5)
    other = json.loads(profile.read_text())
    other["overrides"]["valid_strings"] = 5
    changed = tmp_path / "tiny.json"
    changed.write_text(json.dumps(other))
    with pytest.raises(ResumeMismatchError, match=r"profile\.valid_strings: 4 vs 5"):
        run_profile_file(changed, progress=None, log_path=copy, resume=True)


def test_an_earlier_report_is_imported_only_under_the_same_settings(first_run, tmp_path):
    _profile, log_path, report, _said = first_run
    settings = _lines(log_path)[0]["settings"]
    data = report.to_dict()
    for cell in data["cells"]:
        cell.pop("commit")  # a report from before resumable runs records no commit
    old = tmp_path / "old.json"
    old.write_text(json.dumps(data))
    log = CellLog.open(tmp_path / "new.cells.jsonl", settings, resume=False)
    assert log.import_report(old, "abc1234") == 4
    assert log.commits() == {"abc1234": 4} and len(log.differentials) == 2
    assert log.import_report(old, "abc1234") == 0  # cells already logged are kept
    with_commits = tmp_path / "with-commits.json"
    with_commits.write_text(report.to_json())
    kept = CellLog.open(tmp_path / "kept.cells.jsonl", settings, resume=False)
    kept.import_report(with_commits, "abc1234")
    assert kept.commits() == {report.cells[0].commit: 4}  # a recorded commit is kept
    # A rerun done elsewhere replaces the logged cells only when asked to.
    assert kept.import_report(old, "def5678") == 0
    assert kept.import_report(old, "def5678", replace=True) == 4
    reread = CellLog.open(tmp_path / "kept.cells.jsonl", settings, resume=True)
    assert reread.commits() == {"def5678": 4} and len(reread.differentials) == 2
    data["meta"]["settings"]["versions"]["xgrammar"] = "0.0.1"
    old.write_text(json.dumps(data))
    fresh = CellLog.open(tmp_path / "other.cells.jsonl", settings, resume=False)
    with pytest.raises(ResumeMismatchError, match=r"versions\.xgrammar: '0\.0\.1' vs"):
        fresh.import_report(old, "abc1234")


def test_cli_resume_writes_the_assembled_report_and_needs_an_out_dir(first_run, tmp_path,
                                                                     capsys):
    profile, log_path, report, _said = first_run
    out = tmp_path / "out"
    out.mkdir()
    shutil.copy(log_path, out / log_path.name)
    code = conformance_main(["--profile-file", str(profile), "--out", str(out), "--resume"])
    assert code == report.exit_code
    assembled = json.loads((out / "conformance-tiny.json").read_text())
    assert len(assembled["cells"]) == 4 and assembled["meta"]["remaining_cells"] == 0
    assert conformance_main(["--profile-file", str(profile), "--out", str(out)]) == 8
    assert "--resume" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        conformance_main(["--profile-file", str(profile), "--resume"])


def test_rerun_runs_matching_logged_cells_again_and_their_differentials(first_run, tmp_path):
    profile, log_path, _report, _said = first_run
    copy = tmp_path / log_path.name
    shutil.copy(log_path, copy)
    said: list[str] = []
    report = run_profile_file(profile, progress=said.append, log_path=copy, resume=True,
                              rerun=["outlines/*/*"])
    assert _ran(said) == ["outlines x shipped x binary5", "outlines x shipped x semver.regex"]
    assert sum("differential" in m for m in said) == 2 and len(report.cells) == 4
    kinds = [e["kind"] for e in _lines(copy)]
    assert kinds.count("cell") == 6 and kinds.count("differential") == 4
    again: list[str] = []
    run_profile_file(profile, progress=again.append, log_path=copy, resume=True)
    assert _ran(again) == []  # the newest line of each cell is the one kept


def test_assemble_writes_the_logged_cells_and_fails_closed_on_the_rest(first_run, tmp_path):
    profile, log_path, _report, _said = first_run
    partial = tmp_path / log_path.name
    partial.write_text("\n".join(log_path.read_text().split("\n")[:3]) + "\n")
    said: list[str] = []
    report = run_profile_file(profile, progress=said.append, log_path=partial, resume=True,
                              run_missing=False)
    assert _ran(said) == [] and len(report.cells) == 2
    assert report.meta["not_run_yet"] == ["xgrammar/shipped/semver.regex",
                                          "outlines/shipped/semver.regex"]
    assert report.failing_classes()["errors"] == ["2 planned cells not run yet"]
    assert report.exit_code & 8


def test_a_repro_text_with_a_unicode_line_separator_survives_the_log(tmp_path):
    from shim_adapters.conformance.report import CellResult

    log = CellLog.open(tmp_path / "x.cells.jsonl", {"a": 1}, resume=False, commit="c0")
    log.add_cell(CellResult("b", "1", "t", "g", error="text with \x85 and \u2028 inside"))
    again = CellLog.open(tmp_path / "x.cells.jsonl", {"a": 1}, resume=True)
    assert again.cells[("b", "t", "g")].error == "text with \x85 and \u2028 inside"


def test_a_planned_cell_is_named_as_its_run_names_it():
    """A resumed matrix plans cells by tokenizer label without loading the tokenizer; the
    label must be the name the run records, or every cell stays "not run yet" (bit 8)."""
    from shim_adapters.conformance.runner import tokenizer_label

    assert tokenizer_label("default") == "shipped"
    assert tokenizer_label("qwen2.5") == "qwen2.5"
    assert tokenizer_label("smollm2") == "smollm2"
    assert tokenizer_label({"name": "gpt2", "logits_width": 50304}) == "gpt2"
