"""The MaskBench protocol on a small marked sample of the shared corpus: every backend plugin
compiles or refuses each schema, no invalid instance gets through a report that claims every
construct enforced, and every other accepted invalid instance is flagged by the post-check."""

from __future__ import annotations

import pytest

from shim_adapters.conformance.__main__ import main as conformance_main
from shim_adapters.conformance.corpus import corpus_files, run_corpus, serialise, summary

#: One file in 400 of the shared set, in name order: 5 schemas (a documented sample).
EVERY = 400


def test_maskbench_serialisation_is_compact_json_with_raw_unicode():
    assert serialise({"a": [1, "é"]}) == '{"a": [1, "é"]}'


@pytest.mark.benchmark_data
def test_a_sample_of_the_corpus_has_no_silent_invalidation(benchmark_data, tmp_path):
    files = corpus_files(benchmark_data / "maskbench", every=EVERY)
    assert len(files) >= 4
    log = tmp_path / "corpus.rows.jsonl"
    rows = run_corpus(files, ["xgrammar", "outlines"], "default", log, progress=None)
    stats = summary(rows)
    for backend, s in stats.items():
        assert s["files"] == len(files) and s["compiled"] + s["compile_errors"] == len(files)
        assert s["silent_invalidation_errors"] == 0, (backend, [r.examples for r in rows])
        assert s["invalidation_errors"] == s["post_check_caught"] + s["post_check_missed"]
        assert s["plugin_us"], backend
    for backend in ("xgrammar", "outlines"):  # the raw library timed on the same tokens
        paired = [(len(r.plugin_us), len(r.raw_us)) for r in rows
                  if r.backend == backend and r.raw_us]
        assert paired and all(p == q for p, q in paired), (backend, paired)
    # resumable: a second run reads every row from the log and computes nothing
    again = run_corpus(files, ["xgrammar", "outlines"], "default", log, progress=None)
    assert [(r.file, r.backend) for r in again] == [(r.file, r.backend) for r in rows]
    assert len(log.read_text().splitlines()) == len(rows)


@pytest.mark.benchmark_data
def test_the_corpus_command_writes_its_report_with_the_command(benchmark_data, tmp_path):
    code = conformance_main(["--corpus", str(benchmark_data / "maskbench"), "--backend",
                             "xgrammar", "--corpus-every", "900", "--out", str(tmp_path)])
    text = (tmp_path / "corpus.md").read_text()
    assert code == 0, text
    assert "--corpus-every 900" in text and "| xgrammar | 2 |" in text


def test_the_corpus_command_refuses_a_missing_directory(tmp_path, capsys):
    assert conformance_main(["--corpus", str(tmp_path / "nope")]) == 2
    assert "usage error" in capsys.readouterr().err
    assert conformance_main(["--corpus", str(tmp_path), "--corpus-jobs", "0"]) == 2
    assert "--corpus-jobs must be at least 1" in capsys.readouterr().err


@pytest.mark.benchmark_data
def test_parallel_workers_count_what_one_worker_counts(benchmark_data, tmp_path):
    files = corpus_files(benchmark_data / "maskbench", every=600)
    one = run_corpus(files, ["xgrammar"], "default", tmp_path / "one.jsonl", progress=None)
    two = run_corpus(files, ["xgrammar"], "default", tmp_path / "two.jsonl", progress=None,
                     jobs=2)
    counted = ("compiled", "valid", "invalid", "validation_errors", "invalidation_errors",
               "silent_invalidation_errors", "post_check_caught")
    assert [(r.file, *(getattr(r, k) for k in counted)) for r in two] == \
        [(r.file, *(getattr(r, k) for k in counted)) for r in one]
    assert len((tmp_path / "two.jsonl").read_text().splitlines()) == len(files)


def _heavy_file(tmp_path, n: int = 60):
    """A MaskBench-format file whose walks take seconds of CPU: many long valid strings."""
    import json

    tests = [{"description": f"long {i}", "valid": True, "data": "word " * 300 + str(i)}
             for i in range(n)]
    path = tmp_path / "heavy.json"
    path.write_text(json.dumps({"schema": {"type": "string"}, "tests": tests}))
    return path


def test_a_file_over_its_cpu_budget_is_a_cpu_timeout_and_a_waiting_one_hits_the_net(
        tmp_path, monkeypatch):
    from shim_adapters.conformance import corpus

    path = _heavy_file(tmp_path)
    worker = corpus._Worker("default")
    try:
        row = worker.run(path, "xgrammar", timeout_s=0.3)
        assert row.timeout and row.timeout_kind == "cpu" and not row.compiled
        # a budget no file reaches, and a wall-clock net shorter than the walks take
        monkeypatch.setattr(corpus, "WALL_NET_FACTOR", 1e-4)
        row = worker.run(path, "xgrammar", timeout_s=1e3)
        assert row.timeout and row.timeout_kind == "wall"
        monkeypatch.setattr(corpus, "WALL_NET_FACTOR", 10.0)
        monkeypatch.setattr(corpus, "MEMORY_BUDGET_BYTES", 1)  # any worker is over it
        row = worker.run(path, "xgrammar", timeout_s=1e3)
        assert row.timeout and row.timeout_kind == "memory"
        monkeypatch.setattr(corpus, "MEMORY_BUDGET_BYTES", 6 * 2**30)
        row = worker.run(path, "xgrammar", timeout_s=1e3)  # the same file, finished
        assert not row.timeout and row.compiled and row.valid == 60
        assert "timeouts" in corpus.to_markdown([row], "cmd")
    finally:
        worker.stop()


def test_a_worker_killed_from_outside_is_a_count_and_the_next_file_runs(tmp_path):
    import threading

    from shim_adapters.conformance import corpus

    path = _heavy_file(tmp_path)
    worker = corpus._Worker("default")
    try:
        worker.start()
        threading.Timer(1.0, worker.proc.kill).start()  # as the OOM killer would
        row = worker.run(path, "xgrammar", timeout_s=1e3)
        assert row.compile_error.startswith("the worker process died") and not row.timeout
        row = worker.run(path, "xgrammar", timeout_s=1e3)  # a fresh worker takes the next
        assert row.compiled and row.valid == 60
    finally:
        worker.stop()


def test_a_wall_clock_timeout_in_an_old_log_runs_again(tmp_path):
    import json

    from shim_adapters.conformance.corpus import CorpusRow

    path = _heavy_file(tmp_path)
    log = tmp_path / "rows.jsonl"
    log.write_text(json.dumps({**CorpusRow(path.name, "xgrammar", timeout=True).__dict__,
                               "timeout_kind": None}) + "\n")
    [row] = run_corpus([path], ["xgrammar"], "default", log, progress=None)
    assert not row.timeout and row.valid == 60  # measured, not read back


def test_a_worker_ends_when_its_parent_is_killed(tmp_path):
    """A run killed with SIGKILL leaves no worker compiling on for the rest of its budget."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import psutil

    path = _heavy_file(tmp_path, n=3000)  # a minute or more of walking
    parent = subprocess.Popen(
        [sys.executable, "-c",
         "import sys; from pathlib import Path; from shim_adapters.conformance import corpus\n"
         "w = corpus._Worker('default'); w.start(); print(w.proc.pid, flush=True)\n"
         f"while True: w.run(Path({str(path)!r}), 'xgrammar', timeout_s=1e3)\n"],
        stdout=subprocess.PIPE, text=True)
    worker_pid = int(parent.stdout.readline())
    time.sleep(1.0)  # the worker is walking the heavy file now
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            if psutil.Process(worker_pid).status() == psutil.STATUS_ZOMBIE:
                break
        except psutil.NoSuchProcess:
            break
        time.sleep(0.2)
    else:
        os.kill(worker_pid, signal.SIGKILL)
        raise AssertionError("the worker outlived its killed parent by 5 s")


def test_a_row_counted_under_other_declarations_runs_again(tmp_path):
    """A resumed run keeps a row only if the capability report it was counted under is still
    the report of today's declarations (a construct found dropped later must not leave stale
    counts in the log)."""
    import json

    from shim_adapters.conformance.corpus import CorpusRow, declarations

    path = tmp_path / "small.json"
    path.write_text(json.dumps({"schema": {"type": "string", "maxLength": 3},
                                "tests": [{"valid": True, "data": "ab"},
                                          {"valid": False, "data": "abcd"}]}))
    current = declarations(path, "xgrammar")
    assert current and current != declarations(path, "outlines")
    log = tmp_path / "rows.jsonl"
    kept = CorpusRow(path.name, "xgrammar", compiled=True, valid=7, declarations=current)
    stale = CorpusRow(path.name, "outlines", compiled=True, valid=7, declarations="0" * 16)
    log.write_text("".join(json.dumps(r.__dict__) + "\n" for r in (kept, stale)))
    rows = run_corpus([path], ["xgrammar", "outlines"], "default", log, progress=None)
    by = {r.backend: r for r in rows}
    assert by["xgrammar"].valid == 7  # read back, not run
    assert by["outlines"].valid == 1 and by["outlines"].invalid == 1  # run again
    assert by["outlines"].declarations == declarations(path, "outlines")
