"""Which LM the engine serves, by the content of its weights, against an artefact's manifest.

A controller's γ̂ is fitted for one LM's next-token distribution; the same tokenizer on another
LM gives a wrong correction, silently. The manifest records ``lm_revision``, the sha256 that
:func:`shim_adapters.lm.loading.load_lm` computes over the model's weights files (each file's
name, a NUL byte, its bytes; files ``*.safetensors``, ``*.bin``, ``*.gguf`` of the model
directory in sorted order, or the one ``.gguf`` file). :func:`weights_revision` computes the
same digest for the model the engine serves (a local directory or ``.gguf`` file, or a hub
model already in the local Hugging Face cache), so an artefact fitted on another LM, or on
other weights of the same LM, is refused by that field. The LM's path or name
(``lm_identifier``) is not compared: the same weights served from another directory are the
same LM.

Hashing a large model takes a while (about 1 s per GB), once per process: the digest is
memoised on the weights files' stat signatures.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any, Mapping

from huggingface_hub import snapshot_download

from shim_adapters.errors import ManifestMismatchError
from shim_adapters.lm.loading import files_digest

#: The files load_lm hashes (shim_adapters.lm.loading).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf")

_REVISIONS: dict[tuple, str] = {}
_LOCK = threading.Lock()


class ServedModelNotFoundError(ValueError):
    """The served model's weights are not on this machine's filesystem, so its identity cannot
    be checked."""


def weights_files(model: str | os.PathLike, revision: str | None = None) -> list[Path]:
    """The weights files whose content identifies ``model`` (as load_lm hashes them)."""
    path = Path(model).expanduser()
    if not path.exists():
        path = _hub_snapshot(str(model), revision)
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ServedModelNotFoundError(f"{path}: a model file must be a .gguf file")
        return [path.resolve()]
    files = sorted(p for p in path.iterdir() if p.suffix in WEIGHT_SUFFIXES)
    if not files:
        raise ServedModelNotFoundError(f"{path}: no weights file (*.safetensors, *.bin, *.gguf) "
                                       f"in the served model's directory")
    return files


def _hub_snapshot(name: str, revision: str | None) -> Path:
    """The local copy of a hub model the engine loaded (never downloads)."""
    try:
        return Path(snapshot_download(name, revision=revision, local_files_only=True))
    except Exception as exc:  # not a hub name, or not in the local cache
        raise ServedModelNotFoundError(
            f"the served model {name!r} is neither a local path nor in the local Hugging Face "
            f"cache ({type(exc).__name__}); SHIM checks the LM by its weights files") from None


def weights_revision(model: str | os.PathLike, revision: str | None = None) -> str:
    """sha256 over the weights files, exactly as ``load_lm(...).revision``."""
    files = weights_files(model, revision)
    signature = tuple((str(f), *_signature(f)) for f in files)
    with _LOCK:
        found = _REVISIONS.get(signature)
    if found is not None:
        return found
    value = files_digest(files)
    with _LOCK:
        _REVISIONS[signature] = value
    return value


def _signature(path: Path) -> tuple[int, ...]:
    st = path.stat()
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def check_lm_revision(manifest: Mapping[str, Any], served_revision: str, path: str) -> None:
    """Refuse an artefact whose ``lm_revision`` is not the served weights' digest."""
    found = manifest.get("lm_revision")
    if found != served_revision:
        raise ManifestMismatchError(
            "lm_revision", served_revision, found,
            f"{path} (fitted on LM {manifest.get('lm_identifier')!r}; the engine serves other "
            f"weights)")
