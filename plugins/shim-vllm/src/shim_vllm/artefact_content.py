"""An artefact's identity by content: what validated bindings are cached on.

A binding validated once (manifest, weights checksum, tokenizer, logits width, LM, grammar)
is reused by every later request naming the same artefact, so admission does not reload it per
request. The cache key is the sha256 of every file in the artefact directory (and of the
request's grammar file): editing, truncating or replacing any of them gives a new key, so the
edited artefact is checked again from scratch. Each file's digest is memoised on its stat
signature (device, inode, size, mtime and ctime in ns); a write changes the ctime, which
cannot be set back from user space, so an unchanged artefact costs one ``stat`` per file per
admission and a changed one is hashed again.
"""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

from .request_args import ShimRequestArgs

#: (path) -> (stat signature, sha256 of the content)
_DIGESTS: dict[str, tuple[tuple[int, ...], str]] = {}
_LOCK = threading.Lock()


def _signature(st: os.stat_result) -> tuple[int, ...]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def file_sha256(path: Path) -> str:
    """The file's sha256, re-read only when its stat signature changed."""
    key = str(path)
    signature = _signature(path.stat())
    with _LOCK:
        found = _DIGESTS.get(key)
    if found is not None and found[0] == signature:
        return found[1]
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    value = digest.hexdigest()
    after = _signature(path.stat())
    if after == signature:  # not rewritten while it was read: the digest belongs to it
        with _LOCK:
            _DIGESTS[key] = (signature, value)
    return value


def content_key(args: ShimRequestArgs) -> str:
    """A key that changes whenever any file of the request's artefact (or grammar) changes.

    A missing artefact directory gives a key too (of nothing); binding then refuses it with
    the core's message naming the missing manifest.
    """
    digest = hashlib.sha256()
    directory = args.controller
    if directory.is_dir():
        for entry in sorted(os.scandir(directory), key=lambda e: e.name):
            if entry.is_file():
                digest.update(entry.name.encode() + b"\0")
                digest.update(file_sha256(Path(entry.path)).encode() + b"\0")
    if args.grammar is not None:
        digest.update(b"grammar\0" + str(args.grammar).encode() + b"\0")
        if args.grammar.is_file():
            digest.update(file_sha256(args.grammar).encode())
    digest.update(b"directory\0" + str(directory).encode())
    return digest.hexdigest()
