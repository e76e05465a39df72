"""Compiled grammars cached across processes, as text, keyed on everything they depend on.

A compiled grammar is only valid for one (normalised grammar, backend + version, tokenizer
content, logits width, compile options): a cache keyed on less hands one tokenizer's masks to
another (docs/design.md). Entries are whatever text the backend serialises to (XGrammar:
``CompiledGrammar.serialize_json``) plus a JSON header with the key fields and the payload's
sha256, checked on read; nothing is pickled. Writes are atomic (temp file + ``os.replace``), so
concurrent processes never read half an entry.

Location: ``$SHIM_CACHE_DIR``, else ``$XDG_CACHE_HOME/shim-adapters``, else
``~/.cache/shim-adapters``; ``SHIM_CACHE_DIR=off`` disables it. Only compiles that took at least
``$SHIM_CACHE_MIN_SECONDS`` (default 0.1 s) are stored: reading an entry costs about 50 µs per
KiB, which for small grammars is more than compiling them again (measured with XGrammar 0.2.9
and GPT-2's 50k tokens: SQL compiles in 230 ms and loads in 38 ms; an 8-field schema compiles
in 24 ms and would load in 62 ms).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Mapping

from shim_adapters.grammars.grammar import Grammar

FORMAT = "shim-adapters compiled grammar"
FORMAT_VERSION = 1
#: JSON-schema maps whose key order is part of the meaning: backends emit properties in
#: schema order, so reordering ``properties`` changes the language and must change the key.
_ORDERED_MAPS = frozenset({"properties"})


def cache_dir() -> Path | None:
    value = os.environ.get("SHIM_CACHE_DIR")
    if value is not None:
        return None if value.strip().lower() in ("", "off", "0", "none") else Path(value)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "shim-adapters"


#: An entry larger than this is neither written nor read (a read one is deleted): at about
#: 50 µs per KiB it would take seconds to load and its JSON several times its size in memory.
MAX_ENTRY_BYTES = 64 * 2**20


def min_build_seconds() -> float:
    try:
        return float(os.environ.get("SHIM_CACHE_MIN_SECONDS", "0.1"))
    except ValueError:
        return 0.1


def _normalise_schema(value: Any, ordered: bool = False) -> Any:
    if isinstance(value, dict):
        items = value.items() if ordered else sorted(value.items())
        return {k: _normalise_schema(v, ordered=(k in _ORDERED_MAPS and not ordered))
                for k, v in items}
    if isinstance(value, list):
        return [_normalise_schema(v) for v in value]
    return value


def normalised_grammar(grammar: Grammar) -> str:
    """The grammar text up to changes that cannot change the language: a JSON schema's
    keyword order and whitespace (``properties`` keeps its order), trailing whitespace of
    lines in a grammar file."""
    if grammar.format == "json_schema":
        try:
            schema = json.loads(grammar.text)
        except ValueError:
            return grammar.text
        return json.dumps(_normalise_schema(schema), separators=(",", ":"), ensure_ascii=False)
    return "\n".join(line.rstrip() for line in grammar.text.strip().splitlines())


def cache_key(grammar: Grammar, backend: str, backend_version: str, tokenizer_sha256: str,
              vocab_size: int, options: Mapping[str, Any] | None = None) -> dict[str, str]:
    """The fields an entry must match; ``key["sha256"]`` names the entry."""
    fields = {"format": grammar.format, "grammar": hashlib.sha256(
                  normalised_grammar(grammar).encode()).hexdigest(),
              "backend": backend, "backend_version": backend_version,
              "tokenizer_sha256": tokenizer_sha256, "vocab_size": str(int(vocab_size)),
              "options": json.dumps(dict(options or {}), sort_keys=True, default=str)}
    fields["sha256"] = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()
    return fields


class CompileCache:
    """Text entries under a directory; a corrupt or mismatched entry is a miss, not an error."""

    def __init__(self, directory: str | Path | None = None):
        self.directory = Path(directory) if directory is not None else cache_dir()
        self.hits = 0
        self.misses = 0

    def _path(self, key: Mapping[str, str]) -> Path:
        return self.directory / key["backend"] / f"{key['sha256']}.json"

    def get(self, key: Mapping[str, str]) -> str | None:
        if self.directory is None:
            return None
        path = self._path(key)
        try:
            if path.stat().st_size > MAX_ENTRY_BYTES:
                # reading it back costs more than compiling (and GBs of memory): drop it
                path.unlink(missing_ok=True)
                self.misses += 1
                return None
            entry = json.loads(path.read_text(encoding="utf-8"))
            ok = (entry.get("format") == FORMAT and entry.get("format_version") == FORMAT_VERSION
                  and entry.get("key") == dict(key)
                  and hashlib.sha256(entry["payload"].encode()).hexdigest()
                  == entry.get("payload_sha256"))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            ok = False
        if not ok:
            self.misses += 1
            return None
        self.hits += 1
        return entry["payload"]

    def put(self, key: Mapping[str, str], payload: str) -> None:
        if self.directory is None or len(payload) > MAX_ENTRY_BYTES:
            return
        path = self._path(key)
        entry = {"format": FORMAT, "format_version": FORMAT_VERSION, "key": dict(key),
                 "payload_sha256": hashlib.sha256(payload.encode()).hexdigest(),
                 "payload": payload}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".entry.", suffix=".tmp")
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                json.dump(entry, fh, ensure_ascii=False)
            os.replace(tmp, path)
        except OSError:  # a read-only or full cache directory only costs the next compile
            return

    def get_or_build(self, key: Mapping[str, str], build: Callable[[], Any],
                     dump: Callable[[Any], str], load: Callable[[str], Any],
                     worth_storing: Callable[[Any], bool] | None = None) -> Any:
        """``load`` the cached entry, else ``build`` it and store ``dump(result)`` when the
        build was slow enough to be worth reading back and ``worth_storing(result)`` (the
        backend's say on the entry's size: a serialisation can cost far more than a build)."""
        payload = self.get(key)
        if payload is not None:
            try:
                return load(payload)
            except Exception:  # noqa: BLE001 - an unreadable entry is rebuilt, never trusted
                self.hits -= 1
                self.misses += 1
        start = time.perf_counter()
        result = build()
        if time.perf_counter() - start >= min_build_seconds() and \
                (worth_storing is None or worth_storing(result)):
            self.put(key, dump(result))
        return result


_DEFAULT: CompileCache | None = None


def default_cache() -> CompileCache:
    """The process-wide cache at :func:`cache_dir` (re-read when SHIM_CACHE_DIR changes)."""
    global _DEFAULT
    if _DEFAULT is None or _DEFAULT.directory != cache_dir():
        _DEFAULT = CompileCache()
    return _DEFAULT
