"""A corpus no one in this project wrote: MaskBench-format JSON Schemas through each backend.

Each file holds ``schema`` and ``tests`` (``valid``, ``data``). Per backend and file: the
capability report, the compile, then every instance serialised as MaskBench does
(``json.dumps(data, indent=None, ensure_ascii=False)``) and walked token by token under its
canonical tokenization and one random non-canonical split. Counted per backend:

- compiled / compile errors (the backend refused or crashed) / timeouts (the file, compile
  and walks, used more than ``file_timeout_s`` seconds of CPU time in its worker process:
  the worker is killed, a new one takes the next file). The budget is CPU time, so a file
  counts the same on an idle laptop and on a loaded CI machine; a wall-clock net of
  ``WALL_NET_FACTOR`` x the budget catches a worker that waits without computing (its row
  says ``timeout_kind: "wall"``), and a worker past ``MEMORY_BUDGET_BYTES`` of resident
  memory is killed as well (``"memory"``); the report breaks the timeouts down by kind;
- validation errors: a valid instance refused (canonical tokenization);
- invalidation errors: an invalid instance accepted (EOS allowed at its end), split into
  **silent** ones (the capability report claimed every construct enforced: a defect of our
  report) and the rest, which the post-generation validation
  (:func:`shim_adapters.mask.capability.validate_output`) must flag (``post_check_caught``;
  ``post_check_missed`` where it did not);
- time between masks (the mask of a state plus the advance to the next), p50/p99 in µs, for
  the plugin and for the raw library on the same tokens (XGrammar's ``GrammarMatcher``;
  outlines_core's ``Guide`` on the plugin's index, writing the packed mask as Outlines' own
  logits processor does).

Each (file, backend) row is appended to a JSON-lines log as it finishes, so a long run can be
killed and resumed; the report is assembled from the log.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import queue
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np
import psutil

from shim_adapters.backends.registry import get_backend
from shim_adapters.conformance.runner import resolve_tokenizer
from shim_adapters.errors import ShimError
from shim_adapters.grammars.grammar import Grammar
from shim_adapters.mask.bitmask import bitmask_words
from shim_adapters.mask.capability import capability_report, checked_formats, validate_output
from shim_adapters.mask.vocab import Vocabulary

#: CPU seconds one file (compile and every instance) may use in its worker before it is
#: killed and counted as a timeout. Some real-world schemas take minutes to compile.
FILE_TIMEOUT_S = 60.0
#: A worker still running after this many times the budget in wall-clock time is killed too
#: (a wait that uses no CPU, e.g. a deadlock, never reaches a CPU budget).
WALL_NET_FACTOR = 10.0
#: A worker whose resident memory passes this is killed too (a schema whose compile blows up:
#: one took 18 GiB before the system's OOM killer stopped it); its row says
#: ``timeout_kind: "memory"``.
MEMORY_BUDGET_BYTES = 6 * 2**30


@dataclass
class CorpusRow:
    """One MaskBench file through one backend."""

    file: str
    backend: str
    compiled: bool = False
    compile_error: str | None = None
    compile_seconds: float = 0.0
    timeout: bool = False
    #: "cpu" (the CPU budget was spent), "memory" (the memory budget) or "wall" (the
    #: wall-clock net) for a timeout.
    timeout_kind: str | None = None
    enforced: bool | None = None
    valid: int = 0
    invalid: int = 0
    validation_errors: int = 0
    invalidation_errors: int = 0
    silent_invalidation_errors: int = 0
    post_check_caught: int = 0
    post_check_missed: int = 0
    noncanonical_valid_refused: int = 0
    #: Per-step time between masks (mask + advance), µs, plugin and raw library.
    plugin_us: list[float] = field(default_factory=list)
    raw_us: list[float] = field(default_factory=list)
    examples: list[str] = field(default_factory=list)
    #: Fingerprint of the capability report the row was counted under (see
    #: :func:`declarations`): a resumed run counts again a row whose report has changed since.
    declarations: str | None = None


def corpus_files(directory: str | Path, limit: int | None = None,
                 every: int = 1) -> list[Path]:
    """The corpus's ``*.json`` files in name order; ``every``: take one file in ``every`` (a
    documented, deterministic subset); ``limit``: at most that many."""
    files = sorted(Path(directory).glob("*.json"))[::max(1, every)]
    return files[:limit] if limit else files


def serialise(data) -> str:
    """MaskBench's serialisation of an instance."""
    return json.dumps(data, indent=None, ensure_ascii=False)


def _walk(masker, ids: Sequence[int], times: list[float] | None) -> bool:
    """Whether the masker takes ``ids`` then EOS; the time of each mask + advance in µs."""
    state = masker.new_state()
    for t in ids:
        t0 = time.perf_counter()
        mask = state.allowed_mask()
        ok = bool(mask[t])
        if ok:
            state.advance(int(t))
        if times is not None:
            times.append((time.perf_counter() - t0) * 1e6)
        if not ok:
            return False
    return bool(state.eos_allowed())


def _raw_xgrammar(masker, ids: Sequence[int]) -> list[float]:
    """XGrammar's own matcher on the same tokens: fill the bitmask, accept the token (µs)."""
    if getattr(masker, "compiled", None) is None:
        return []
    import xgrammar as xgr  # only for the raw baseline of the xgrammar backend

    matcher = xgr.GrammarMatcher(masker.compiled)
    bitmask = xgr.allocate_token_bitmask(1, masker.vocab_size)
    out = []
    for t in ids:
        t0 = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask)
        ok = matcher.accept_token(int(t))
        out.append((time.perf_counter() - t0) * 1e6)
        if not ok:
            break
    return out


def _raw_outlines(masker, ids: Sequence[int]) -> list[float]:
    """outlines_core's own guide on the plugin's index and the same tokens: write the packed
    mask (as Outlines' logits processor does), advance (µs). Only for the regex/JSON masker."""
    index = getattr(masker, "index", None)
    if index is None:
        return []
    import outlines_core  # only for the raw baseline of the outlines backend

    guide = outlines_core.Guide(index)
    words = np.zeros(bitmask_words(masker.vocab_size), dtype=np.int32)
    out = []
    for t in ids:
        t0 = time.perf_counter()
        guide.write_mask_into(words.ctypes.data, words.size, 4)
        ok = bool(words[t >> 5] >> (t & 31) & 1)
        if ok:
            guide.advance(int(t), return_tokens=False)
        out.append((time.perf_counter() - t0) * 1e6)
        if not ok:
            break
    return out


#: Backends with a raw-library baseline for the time between masks.
RAW_BASELINES: dict[str, Callable] = {"xgrammar": _raw_xgrammar, "outlines": _raw_outlines}


def run_file(path: Path, backend: str, tokenizer, logits_width: int,
             vocab: Vocabulary) -> CorpusRow:
    """One file through one backend (see the module docstring)."""
    row = CorpusRow(file=path.name, backend=backend)
    spec = get_backend(backend)
    item = json.loads(path.read_text(encoding="utf-8"))
    grammar = Grammar(json.dumps(item["schema"]), "json_schema", path.name)
    t0 = time.perf_counter()
    try:
        report = capability_report(grammar, spec)
        masker = spec.compile(grammar, tokenizer, logits_width)
        masker.new_state().allowed_mask()
    except (ShimError, Exception) as exc:  # noqa: BLE001 - a refusal or crash is a count
        row.compile_error = f"{type(exc).__name__}: {str(exc)[:200]}"
        row.compile_seconds = round(time.perf_counter() - t0, 3)
        return row
    row.compile_seconds = round(time.perf_counter() - t0, 3)
    row.compiled = True
    row.enforced = report.enforced
    rng = random.Random(int(hashlib.sha256(path.name.encode()).hexdigest()[:8], 16))
    raw = RAW_BASELINES.get(backend)
    for test in item.get("tests", []):
        text = serialise(test["data"])
        ids = vocab.canonical(text)[0]
        accepted = _walk(masker, ids, row.plugin_us)
        if raw is not None:
            row.raw_us.extend(raw(masker, ids))
        split = vocab.segmentation(text, rng)
        split_ok = None if split is None or split == ids else _walk(masker, split, None)
        if test.get("valid"):
            row.valid += 1
            if not accepted:
                row.validation_errors += 1
                row.examples.append(f"valid refused: {text[:160]}")
            if split_ok is False and accepted:
                row.noncanonical_valid_refused += 1
        else:
            row.invalid += 1
            if accepted:
                row.invalidation_errors += 1
                if report.enforced:
                    row.silent_invalidation_errors += 1
                    row.examples.append(f"SILENT invalid accepted: {text[:160]}")
                elif not validate_output(grammar, text).valid:
                    row.post_check_caught += 1
                else:
                    row.post_check_missed += 1
                    row.examples.append(f"post-check missed: {text[:160]}")
    row.plugin_us = [round(x, 1) for x in row.plugin_us]
    row.raw_us = [round(x, 1) for x in row.raw_us]
    return row


def declarations(path: Path, backend: str) -> str | None:
    """A fingerprint of what decides a row's classes besides the backend's behaviour: the
    capability report of the file's schema on ``backend`` (the constructs and their declared
    support) and the formats the post-check checks. None where no report can be made."""
    try:
        schema = json.loads(path.read_text(encoding="utf-8"))["schema"]
        report = capability_report(Grammar(json.dumps(schema), "json_schema", path.name),
                                   get_backend(backend))
    except (OSError, ValueError, KeyError, TypeError, ShimError):
        return None
    payload = json.dumps({"report": report.as_dict(), "formats": checked_formats()},
                         sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def read_rows(log_path: str | Path) -> list[CorpusRow]:
    """The rows a corpus log holds (the newest line of a (file, backend) wins)."""
    rows: dict[tuple[str, str], CorpusRow] = {}
    for line in Path(log_path).read_text(encoding="utf-8").splitlines():
        if line.strip():
            row = CorpusRow(**json.loads(line))
            rows[(row.file, row.backend)] = row
    return list(rows.values())


def _exit_with_parent(parent_pid: int) -> None:
    """End this worker once the process that started it is gone (killed, even by SIGKILL):
    an orphaned worker would otherwise go on compiling a schema for up to its budget."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def _worker(conn, tokenizer_spec, parent_pid: int) -> None:
    """A worker process: load the tokenizer once, then run the files it is sent."""
    _exit_with_parent(parent_pid)
    tok = resolve_tokenizer(tokenizer_spec)
    vocab = Vocabulary(tok.tokenizer, tok.logits_width)
    conn.send("ready")
    while True:
        job = conn.recv()
        if job is None:
            return
        path, backend = job
        try:
            row = run_file(Path(path), backend, tok.tokenizer, tok.logits_width, vocab)
        except Exception as exc:  # noqa: BLE001 - a crash while walking is a count too
            row = CorpusRow(file=Path(path).name, backend=backend,
                            compile_error=f"crashed: {type(exc).__name__}: {str(exc)[:200]}")
        conn.send(asdict(row))


def _rss_bytes(process: psutil.Process) -> int:
    try:
        return process.memory_info().rss
    except psutil.Error:
        return 0


def _cpu_seconds(process: psutil.Process) -> float:
    """User + system CPU time of ``process`` (every thread), 0 once it has exited."""
    try:
        times = process.cpu_times()
    except psutil.Error:
        return 0.0
    return times.user + times.system


class _Worker:
    """One worker process; killed and replaced when a file overruns its timeout."""

    def __init__(self, tokenizer_spec):
        self.tokenizer_spec = tokenizer_spec
        self.proc = None

    def start(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker, args=(child, self.tokenizer_spec, os.getpid()),
                                daemon=True)
        self.proc.start()
        while not self.conn.poll(1.0):
            if not self.proc.is_alive():
                raise RuntimeError(f"the corpus worker died while starting (exit code "
                                   f"{self.proc.exitcode})")
        if self.conn.recv() != "ready":
            raise RuntimeError("the corpus worker did not start")

    def run(self, path: Path, backend: str, timeout_s: float) -> CorpusRow:
        if self.proc is None or not self.proc.is_alive():
            self.start()
        worker = psutil.Process(self.proc.pid)
        cpu_start = _cpu_seconds(worker)
        wall_deadline = time.monotonic() + WALL_NET_FACTOR * timeout_s
        kind = None
        try:
            self.conn.send((str(path), backend))
            while self.proc.is_alive():
                if self.conn.poll(0.5):
                    return CorpusRow(**self.conn.recv())
                if _cpu_seconds(worker) - cpu_start > timeout_s:
                    kind = "cpu"
                elif _rss_bytes(worker) > MEMORY_BUDGET_BYTES:
                    kind = "memory"
                elif time.monotonic() > wall_deadline:
                    kind = "wall"
                if kind is not None:
                    break
        except (BrokenPipeError, EOFError, ConnectionResetError):
            pass  # the worker died under us (killed from outside, e.g. by the OOM killer)
        if kind is None:  # crashed hard (a segfault in a backend): a count
            self.proc.join(5)
            self.proc = None
            return CorpusRow(file=path.name, backend=backend,
                             compile_error="the worker process died (a crash in the backend, "
                                           "or killed from outside)")
        self.proc.kill()
        self.proc.join()
        self.proc = None
        return CorpusRow(file=path.name, backend=backend, timeout=True, timeout_kind=kind)

    def stop(self) -> None:
        if self.proc is not None and self.proc.is_alive():
            try:
                self.conn.send(None)
            except (BrokenPipeError, ConnectionResetError):
                pass
            self.proc.join(10)


def run_corpus(files: Iterable[Path], backends: Sequence[str], tokenizer_spec="default",
               log_path: str | Path | None = None,
               progress: Callable[[str], None] | None = print,
               file_timeout_s: float = FILE_TIMEOUT_S, jobs: int = 1) -> list[CorpusRow]:
    """Every file through every backend, each in a worker process that is killed past
    ``file_timeout_s`` of CPU time; rows already in ``log_path`` are kept (a resumed run).

    ``jobs`` worker processes run files side by side. Budgets are CPU time per worker, so the
    counts do not depend on ``jobs``; the mask times of a row are measured in one worker, the
    plugin's and the raw library's back to back, so their ratio holds under the extra load.
    Rows come back in (file, backend) order whatever order they finished in."""
    if jobs < 1:
        raise ValueError(f"run_corpus: jobs must be at least 1, got {jobs}")
    files = list(files)
    current = {(path.name, backend): declarations(path, backend)
               for path in files for backend in backends}
    done: dict[tuple[str, str], CorpusRow] = {}
    if log_path is not None and Path(log_path).exists():
        # a timeout without its kind was a wall-clock cap, which depends on the machine's
        # load: not a measurement of the file, so it runs again under the CPU budget; a row
        # counted under other declarations (a construct since found to be dropped, a format
        # since checked) runs again too
        done = {(row.file, row.backend): row for row in read_rows(log_path)
                if not (row.timeout and row.timeout_kind is None)
                and row.declarations == current.get((row.file, row.backend))}
    todo = [(path, backend) for path in files for backend in backends
            if (path.name, backend) not in done]
    idle: queue.Queue[_Worker] = queue.Queue()
    workers = [_Worker(tokenizer_spec) for _ in range(min(jobs, max(1, len(todo))))]
    for worker in workers:
        idle.put(worker)
    record = threading.Lock()

    def run_one(job: tuple[Path, str]) -> CorpusRow:
        path, backend = job
        worker = idle.get()
        try:
            row = worker.run(path, backend, file_timeout_s)
        finally:
            idle.put(worker)
        row.declarations = current[(path.name, backend)]
        with record:  # one writer at a time: every log line is a whole row
            if log_path is not None:
                Path(log_path).parent.mkdir(parents=True, exist_ok=True)
                with open(log_path, "a", encoding="utf-8") as fh:
                    fh.write(json.dumps(asdict(row), ensure_ascii=False) + "\n")
            if progress:
                progress(f"[corpus] {backend} {path.name}: "
                         + ("timeout" if row.timeout else row.compile_error
                            or f"valid refused {row.validation_errors}/{row.valid}, "
                            f"invalid accepted {row.invalidation_errors}/{row.invalid} "
                            f"(silent {row.silent_invalidation_errors})"))
        return row

    try:
        with ThreadPoolExecutor(max_workers=len(workers)) as pool:
            for row in pool.map(run_one, todo):
                done[(row.file, row.backend)] = row
    finally:
        for worker in workers:
            worker.stop()
    return [done[(path.name, backend)] for path in files for backend in backends]


def _pct(values: list[float], q: float) -> str:
    return f"{np.percentile(values, q):.1f}" if values else "-"


def summary(rows: Sequence[CorpusRow]) -> dict[str, dict]:
    """Per backend: the counts of the module docstring and the mask-time percentiles."""
    out: dict[str, dict] = {}
    for row in rows:
        s = out.setdefault(row.backend, dict(files=0, compiled=0, compile_errors=0, timeouts=0,
                                             valid=0, invalid=0, validation_errors=0,
                                             invalidation_errors=0,
                                             silent_invalidation_errors=0,
                                             post_check_caught=0, post_check_missed=0,
                                             noncanonical_valid_refused=0, plugin_us=[],
                                             raw_us=[], paired_plugin_us=[]))
        s["files"] += 1
        s["compiled"] += row.compiled
        s["compile_errors"] += row.compile_error is not None
        s["timeouts"] += row.timeout
        if row.timeout:
            kinds = s.setdefault("timeout_kinds", {})
            kind = row.timeout_kind or "wall (older log)"
            kinds[kind] = kinds.get(kind, 0) + 1
        for key in ("valid", "invalid", "validation_errors", "invalidation_errors",
                    "silent_invalidation_errors", "post_check_caught", "post_check_missed",
                    "noncanonical_valid_refused"):
            s[key] += getattr(row, key)
        s["plugin_us"] += row.plugin_us
        s["raw_us"] += row.raw_us
        if row.raw_us:  # the plugin's times on the rows the raw library walked too
            s["paired_plugin_us"] += row.plugin_us
    return out


def _timeouts_cell(s: dict) -> str:
    kinds = s.get("timeout_kinds") or {}
    if not kinds:
        return str(s["timeouts"])
    return f"{s['timeouts']} ({', '.join(f'{k} {n}' for k, n in sorted(kinds.items()))})"


def to_markdown(rows: Sequence[CorpusRow], command: str, note: str = "") -> str:
    """The corpus report: per-backend counts, mask times, and the examples of each error."""
    lines = ["# MaskBench corpus through the backend plugins", "", f"Command: `{command}`", ""]
    if note:
        lines += [note, ""]
    lines += ["| backend | files | compiled | compile errors | timeouts | valid | validation "
              "errors | invalid | invalidation errors | silent | post-check caught | "
              "post-check missed | non-canonical split of a valid instance refused |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    stats = summary(rows)
    for backend, s in stats.items():
        lines.append(f"| {backend} | {s['files']} | {s['compiled']} | {s['compile_errors']} | "
                     f"{_timeouts_cell(s)} | {s['valid']} | {s['validation_errors']} | "
                     f"{s['invalid']} | {s['invalidation_errors']} | "
                     f"**{s['silent_invalidation_errors']}** | {s['post_check_caught']} | "
                     f"{s['post_check_missed']} | {s['noncanonical_valid_refused']} |")
    lines += ["", "Time between masks (mask + advance to the next state, canonical tokens of "
              "every instance), µs; the last five columns take the files the raw library "
              "walked too, on the same tokens:", "",
              "| backend | steps | plugin p50 | plugin p99 | steps with a raw baseline | "
              "plugin p50 | plugin p99 | raw p50 | raw p99 |",
              "|---|---|---|---|---|---|---|---|---|"]
    for backend, s in stats.items():
        paired = s["paired_plugin_us"]
        lines.append(f"| {backend} | {len(s['plugin_us'])} | {_pct(s['plugin_us'], 50)} | "
                     f"{_pct(s['plugin_us'], 99)} | {len(s['raw_us'])} | "
                     f"{_pct(paired, 50)} | {_pct(paired, 99)} | "
                     f"{_pct(s['raw_us'], 50)} | {_pct(s['raw_us'], 99)} |")
    bad = [(r, e) for r in rows for e in r.examples]
    if bad:
        lines += ["", "## Examples (first 60)", ""]
        lines += [f"- {r.backend} / {r.file}: {e}" for r, e in bad[:60]]
    errors = [r for r in rows if r.compile_error]
    if errors:
        lines += ["", "## Compile errors (first 40)", ""]
        lines += [f"- {r.backend} / {r.file}: {r.compile_error}" for r in errors[:40]]
    return "\n".join(lines) + "\n"
