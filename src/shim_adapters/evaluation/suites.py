"""Evaluation suites: lists of (grammar, prompt) cases, built in or written by a user.

A suite file (JSON or TOML) looks like::

    name = "my-suite"
    [[cases]]
    name = "inv-and"
    grammar = "grammars/inv.ebnf"     # a path (relative to the suite file) or a built-in name
    prompt_file = "prompts/inv.txt"   # or: prompt = "..."; omitted: the grammar's default
    max_new_tokens = 64               # optional
    exact = false                     # optional: enumerate the (finite) language exactly
    stop_at_newline = false           # optional: a newline also ends the output

Built-in suites: ``fast`` (the four built-in grammars with the shipped LM's prompts),
``binary5``, ``json``, ``sql``, ``bv4``, ``slia``, ``cp`` and ``spider``. ``bv4`` and ``spider`` read the
benchmark data from ``data_dir`` at run time (``.../BV4``: ``*.ebnf`` + ``*.txt`` 3-shot prompt;
``.../spider``: ``grammar.lark`` + ``instance_*.txt``); without it they fall back to the
built-in grammar of the same domain. Benchmark data is never copied into the repository.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import tomllib

from shim_adapters.grammars.grammar import BUILTIN_GRAMMARS, Grammar, builtin_grammar, load_grammar
from shim_adapters.grammars.transforms import prune_undefined_rules

BUILTIN_SUITES = ("fast", "binary5", "json", "sql", "bv4", "slia", "cp", "spider")
DEFAULT_MAX_NEW_TOKENS = 64


@dataclass(frozen=True)
class EvalCase:
    """One (grammar, prompt) pair to evaluate."""

    name: str
    grammar: Grammar
    prompt: str
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    #: The language is small and finite: also compute the exact KL over all of it.
    exact: bool = False
    #: The output also ends at a newline (one-line answers to few-shot prompts); see
    #: :mod:`shim_adapters.lm.views`. ``"auto"``: probed as ``shim fit`` probes
    #: (:func:`shim_adapters.shim.fitting.prepare_prompt`).
    stop_at_newline: bool | str = False


@dataclass(frozen=True)
class Suite:
    name: str
    cases: tuple[EvalCase, ...]
    #: Where the suite came from (a file path, or ``builtin:NAME[:data_dir]``).
    source: str = ""
    notes: tuple[str, ...] = field(default=())

    def select(self, names: list[str] | None = None, limit: int | None = None) -> "Suite":
        """A sub-suite: the named cases (in the given order) and/or the first ``limit``."""
        cases = list(self.cases)
        if names:
            by_name = {c.name: c for c in cases}
            unknown = [n for n in names if n not in by_name]
            if unknown:
                raise ValueError(f"suite {self.name!r} has no case(s) {unknown}; cases: "
                                 f"{', '.join(by_name)}")
            cases = [by_name[n] for n in names]
        if limit is not None:
            cases = cases[:limit]
        return Suite(self.name, tuple(cases), self.source, self.notes)


def _builtin_case(name: str, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS) -> EvalCase:
    grammar = builtin_grammar(name)
    return EvalCase(name=name, grammar=grammar, prompt=grammar.default_prompt or "",
                    max_new_tokens=max_new_tokens, exact=(name == "binary5"))


def _ebnf_problem_suite(name: str, data_dir: str | Path, *, max_new_tokens: int,
                        prune_undefined: bool = False) -> Suite:
    """Problems given as ``X.ebnf`` grammar + ``X.txt`` few-shot prompt (one-line answers)."""
    root = Path(data_dir)
    grammars = sorted(root.glob("*.ebnf"))
    if not grammars:
        raise FileNotFoundError(f"{root}: no *.ebnf grammars (expected the {name.upper()} "
                                f"benchmark directory: one X.ebnf + X.txt per problem)")
    cases, notes = [], []
    for path in grammars:
        prompt = path.with_suffix(".txt")
        if not prompt.is_file():
            raise FileNotFoundError(f"{path}: no prompt file {prompt.name} next to it")
        text = path.read_text()
        if prune_undefined:
            text, pruned = prune_undefined_rules(text, source=str(path))
            if pruned.changed:
                notes.append(f"{path.stem}: {pruned.summary()}")
        grammar = Grammar(text=text, format="ebnf", name=path.stem)
        cases.append(EvalCase(path.stem, grammar, prompt.read_text(),
                              max_new_tokens=max_new_tokens, stop_at_newline=True))
    return Suite(name, tuple(cases), f"builtin:{name}:{root}", tuple(notes))


def bv4_suite(data_dir: str | Path) -> Suite:
    """The BV4 SyGuS problems: each ``X.ebnf`` with its 3-shot prompt ``X.txt``."""
    return _ebnf_problem_suite("bv4", data_dir, max_new_tokens=64)


def slia_suite(data_dir: str | Path) -> Suite:
    """The SLIA SyGuS string problems (grammar-aligned decoding benchmark)."""
    return _ebnf_problem_suite("slia", data_dir, max_new_tokens=96)


def cp_suite(data_dir: str | Path) -> Suite:
    """Constituency parsing (Penn-Treebank brackets), one sentence-specific grammar each.

    The distributed grammars refer to rules they never define at their depth limit; the
    alternatives that use them can never complete, so they are pruned (an explicit transform,
    listed in the suite's notes), which keeps the intended language."""
    return _ebnf_problem_suite("cp", data_dir, max_new_tokens=128, prune_undefined=True)


def spider_suite(data_dir: str | Path) -> Suite:
    """Spider text-to-SQL prompts (``instance_*.txt``) under the shared ``grammar.lark``."""
    root = Path(data_dir)
    grammar_path = root / "grammar.lark"
    if not grammar_path.is_file():
        raise FileNotFoundError(f"{root}: no grammar.lark (expected the Spider benchmark "
                                f"directory)")
    grammar = Grammar(text=grammar_path.read_text(), format="lark", name="spider")
    prompts = sorted(root.glob("instance_*.txt"))
    if not prompts:
        raise FileNotFoundError(f"{root}: no instance_*.txt prompts")
    cases = tuple(EvalCase(f"spider-{p.stem.split('_')[-1]}", grammar, p.read_text(),
                           max_new_tokens=64, stop_at_newline=True) for p in prompts)
    return Suite("spider", cases, f"builtin:spider:{root}")


def builtin_suite(name: str, data_dir: str | Path | None = None) -> Suite:
    if name == "fast":
        return Suite("fast", tuple(_builtin_case(g) for g in ("binary5", "bv4", "json", "sql")),
                     "builtin:fast")
    if name == "bv4" and data_dir is not None:
        return bv4_suite(data_dir)
    if name in ("slia", "cp"):
        if data_dir is None:
            raise ValueError(f"suite {name!r} reads the benchmark data: pass its directory "
                             f"(e.g. --data-dir ../shared/benchmarks/{name.upper()})")
        return slia_suite(data_dir) if name == "slia" else cp_suite(data_dir)
    if name == "spider" and data_dir is not None:
        return spider_suite(data_dir)
    grammar = {"spider": "sql"}.get(name, name)
    if grammar not in BUILTIN_GRAMMARS:
        raise ValueError(f"no built-in suite {name!r}; built-ins: {', '.join(BUILTIN_SUITES)} "
                         f"(or pass a suite file, .json or .toml)")
    return Suite(name, (_builtin_case(grammar),), f"builtin:{name}")


def load_suite_file(path: str | Path) -> Suite:
    """Read a user's suite (.json or .toml); grammar/prompt paths are relative to the file."""
    path = Path(path)
    if path.suffix.lower() == ".toml":
        data = tomllib.loads(path.read_text())
    elif path.suffix.lower() == ".json":
        data = json.loads(path.read_text())
    else:
        raise ValueError(f"{path}: a suite file must end in .json or .toml")
    raw_cases = data.get("cases")
    if not isinstance(raw_cases, list) or not raw_cases:
        raise ValueError(f"{path}: needs a non-empty list 'cases'")
    cases = []
    for i, raw in enumerate(raw_cases):
        where = f"{path}: cases[{i}]"
        if not isinstance(raw, dict) or "grammar" not in raw:
            raise ValueError(f"{where}: each case needs 'grammar' (a path or built-in name)")
        unknown = set(raw) - {"name", "grammar", "grammar_format", "prompt", "prompt_file",
                              "max_new_tokens", "exact", "stop_at_newline"}
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {sorted(unknown)}")
        spec = raw["grammar"]
        if spec in BUILTIN_GRAMMARS:
            grammar = builtin_grammar(spec)
        else:
            grammar = load_grammar(path.parent / spec, format=raw.get("grammar_format"))
        if "prompt" in raw and "prompt_file" in raw:
            raise ValueError(f"{where}: give 'prompt' or 'prompt_file', not both")
        if "prompt_file" in raw:
            prompt = (path.parent / raw["prompt_file"]).read_text()
        else:
            prompt = raw.get("prompt", grammar.default_prompt)
        if not prompt:
            raise ValueError(f"{where}: no prompt (and grammar {grammar.name!r} has no default)")
        cases.append(EvalCase(name=str(raw.get("name", grammar.name)), grammar=grammar,
                              prompt=prompt,
                              max_new_tokens=int(raw.get("max_new_tokens",
                                                         DEFAULT_MAX_NEW_TOKENS)),
                              exact=bool(raw.get("exact", False)),
                              stop_at_newline=bool(raw.get("stop_at_newline", False))))
    names = [c.name for c in cases]
    if len(set(names)) != len(names):
        raise ValueError(f"{path}: case names must be unique, got {names}")
    return Suite(str(data.get("name", path.stem)), tuple(cases), str(path))


def load_suite(spec: str | Path | Suite, data_dir: str | Path | None = None) -> Suite:
    """A built-in suite name (with optional ``data_dir``), a suite file, or a Suite as is."""
    if isinstance(spec, Suite):
        return spec
    if isinstance(spec, str) and spec in BUILTIN_SUITES:
        return builtin_suite(spec, data_dir)
    path = Path(spec)
    if path.is_file():
        return load_suite_file(path)
    raise ValueError(f"suite {str(spec)!r} is neither a built-in ({', '.join(BUILTIN_SUITES)}) "
                     f"nor an existing .json/.toml file")
