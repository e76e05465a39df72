"""A fitted controller on disk: safetensors weights + a JSON manifest checked on load.

A controller is only meaningful for the grammar, tokenizer, backend (and its version: feature
ids change with it) and LM it was fitted for, so the manifest records all of them and
:func:`load_controller` refuses a mismatch with
:class:`~shim_adapters.errors.ManifestMismatchError` naming the field (docs/design.md: a
cache keyed on less returns wrong answers). The manifest also records the sha256 and size of
the weights file and a sha256 of its own content, so a truncated or edited artefact is refused
with :class:`ArtefactCorruptedError` instead of loading garbage. Nothing is pickled.

Layout of an artefact directory::

    manifest.json          # everything below, human-readable
    controller.safetensors # encoder.cross_vocab (uint64), controller.* (float32)

Writing is atomic: the manifest is the commit point. A re-fit writes its weights under a name
the current manifest does not use (``controller.safetensors`` and ``controller.1.safetensors``
alternate), then replaces the manifest with ``os.replace``; an interrupted re-fit leaves the
previous manifest and the weights it names untouched, so the previous artefact still loads.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Mapping

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file

from shim_adapters import __version__
from shim_adapters.errors import GrammarError, ManifestMismatchError, ShimError
from shim_adapters.grammars import BUILTIN_GRAMMARS, Grammar, builtin_grammar
from shim_adapters.mask.protocol import FEATURE_NAMES, Masker
from shim_adapters.shim.controller import CONTROLLERS, Controller
from shim_adapters.shim.features import FeatureEncoder
from shim_adapters.shim.prompt_set import (  # noqa: F401 (the warning is part of this API)
    FittedPrompts,
    PromptOutsideFitWarning,
    warn_outside_fit,
)

FORMAT = "shim-adapters controller"
FORMAT_VERSION = 1
#: Written when the controller uses text features (:mod:`shim_adapters.shim.features`):
#: readers that only know version 1 refuse it by its version instead of scoring without them.
TEXT_FEATURES_FORMAT_VERSION = 2
READABLE_FORMAT_VERSIONS = (FORMAT_VERSION, TEXT_FEATURES_FORMAT_VERSION)
MANIFEST_FILE = "manifest.json"
WEIGHTS_FILE = "controller.safetensors"
#: Where a re-fit writes when the current manifest names WEIGHTS_FILE (see the module doc).
ALTERNATE_WEIGHTS_FILE = "controller.1.safetensors"


class ArtefactCorruptedError(ShimError):
    """The artefact's files are truncated, edited or unreadable."""

    def __init__(self, path: str | Path, problem: str):
        super().__init__(f"{path}: {problem}; refusing to load (refit or restore the artefact)")
        self.path = str(path)
        self.problem = problem


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _manifest_digest(manifest: Mapping[str, Any]) -> str:
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, ensure_ascii=False).encode()
                          ).hexdigest()


def _feature_status(masker: Masker) -> dict[str, str]:
    return {k: str(getattr(masker.feature_status.get(k), "value", "missing"))
            for k in FEATURE_NAMES}


def expected_fields(masker: Masker, lm=None) -> dict[str, str]:
    """The manifest fields that must equal the run's (grammar, tokenizer, backend, LM)."""
    fields = dict(masker.fingerprint())
    if lm is not None:
        fields["lm_identifier"] = str(lm.identifier)
        fields["lm_revision"] = str(lm.revision)
    return fields


def build_manifest(controller: Controller, masker: Masker, lm=None, *,
                   prompt: str | None = None, training: Mapping[str, Any] | None = None
                   ) -> dict[str, Any]:
    """The manifest of a fitted controller (without the weights' and its own checksums)."""
    return {
        "format": FORMAT,
        "format_version": (TEXT_FEATURES_FORMAT_VERSION if controller.encoder_.uses_text
                           else FORMAT_VERSION),
        "shim_adapters_version": __version__,
        **expected_fields(masker, lm),
        "grammar_name": masker.grammar.name,
        "grammar_format": masker.grammar.format,
        "grammar_text": masker.grammar.text,
        "prompt": prompt,
        "features": {"feature_status": _feature_status(masker),
                     "encoder": controller.encoder_.vocab_manifest()},
        "controller": {"kind": controller.kind,
                       "params": json.loads(json.dumps(controller.get_params())),
                       "beta": controller.beta_, "reg": controller.reg_,
                       "eos_token_ids": [int(e) for e in controller.eos_token_ids_],
                       "weights": sorted(controller.weights_)},
        "training": {**controller.learned_summary(), **dict(training or {})},
    }


def _weights_in_use(directory: Path) -> str | None:
    try:
        return json.loads((directory / MANIFEST_FILE).read_text()).get("weights_file")
    except (OSError, ValueError, AttributeError):
        return None


def _replace_atomically(path: Path, write) -> None:
    """``write(tmp_path)`` then rename over ``path``: readers see the old file or the new."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(Path(tmp))
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_controller(directory: str | Path, controller: Controller, masker: Masker, lm=None, *,
                    prompt: str | None = None, training: Mapping[str, Any] | None = None
                    ) -> dict[str, Any]:
    """Write the artefact into ``directory`` atomically; returns the manifest written."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {f"controller.{k}": np.ascontiguousarray(v, dtype=np.float32)
               for k, v in controller.weights_.items()}
    tensors.update(controller.encoder_.tensors())
    in_use = _weights_in_use(directory)
    name = ALTERNATE_WEIGHTS_FILE if in_use == WEIGHTS_FILE else WEIGHTS_FILE
    weights_path = directory / name
    _replace_atomically(weights_path, lambda tmp: save_file(tensors, str(tmp)))
    manifest = build_manifest(controller, masker, lm, prompt=prompt, training=training)
    manifest["weights_file"] = name
    manifest["weights_sha256"] = _sha256_file(weights_path)
    manifest["weights_bytes"] = weights_path.stat().st_size
    manifest["manifest_sha256"] = _manifest_digest(manifest)
    text = json.dumps(manifest, indent=1, ensure_ascii=False)
    _replace_atomically(directory / MANIFEST_FILE, lambda tmp: tmp.write_text(text))
    for stale in (WEIGHTS_FILE, ALTERNATE_WEIGHTS_FILE):  # the previous weights, now unused
        if stale != name:
            (directory / stale).unlink(missing_ok=True)
    return manifest


def read_manifest(directory: str | Path) -> dict[str, Any]:
    """The manifest, after checking that it is intact (not that it matches the run)."""
    path = Path(directory) / MANIFEST_FILE
    if not path.is_file():
        raise ArtefactCorruptedError(path, "no manifest.json (not a controller artefact)")
    try:
        manifest = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise ArtefactCorruptedError(path, f"manifest is not valid JSON ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ArtefactCorruptedError(path, f"not a {FORMAT!r} manifest")
    if manifest.get("format_version") not in READABLE_FORMAT_VERSIONS:
        raise ManifestMismatchError("format_version", READABLE_FORMAT_VERSIONS,
                                    manifest.get("format_version"), str(path))
    if manifest.get("manifest_sha256") != _manifest_digest(manifest):
        raise ArtefactCorruptedError(path, "manifest content does not match its "
                                           "manifest_sha256 (edited or damaged)")
    return manifest


def read_verified_manifest(directory: str | Path) -> dict[str, Any]:
    """The manifest, after checking that it and the weights file are intact: everything about
    an artefact that needs neither the grammar compiled nor the LM loaded, so a damaged one is
    refused before either."""
    manifest = read_manifest(directory)
    _checked_weights(Path(directory), manifest)
    return manifest


def _checked_weights(directory: Path, manifest: Mapping[str, Any]) -> Path:
    if manifest.get("weights_file") not in (WEIGHTS_FILE, ALTERNATE_WEIGHTS_FILE):
        raise ArtefactCorruptedError(directory / MANIFEST_FILE,
                                     f"weights_file {manifest.get('weights_file')!r} is not "
                                     f"one this package writes")
    weights_path = directory / manifest["weights_file"]
    if not weights_path.is_file():
        raise ArtefactCorruptedError(weights_path, "weights file is missing")
    size = weights_path.stat().st_size
    if size != manifest["weights_bytes"]:
        raise ArtefactCorruptedError(weights_path, f"weights file has {size} bytes, the "
                                                   f"manifest says {manifest['weights_bytes']} "
                                                   f"(truncated?)")
    if _sha256_file(weights_path) != manifest["weights_sha256"]:
        raise ArtefactCorruptedError(weights_path, "weights file sha256 does not match the "
                                                   "manifest (modified or damaged)")
    return weights_path


def fitted_grammar(manifest: Mapping[str, Any]) -> Grammar:
    """The grammar the controller was fitted on, from its manifest: the built-in it names when
    the hashes agree (with its prompt), else the text the manifest carries, checked against
    ``grammar_sha256``. Every wrapper compiles its processor from this."""
    name, wanted = manifest.get("grammar_name"), manifest.get("grammar_sha256")
    if name in BUILTIN_GRAMMARS and builtin_grammar(name).sha256 == wanted:
        return builtin_grammar(name)
    text, fmt = manifest.get("grammar_text"), manifest.get("grammar_format")
    if isinstance(text, str) and isinstance(fmt, str):
        grammar = Grammar(text=text, format=fmt, name=str(name or "<fitted grammar>"))
        if grammar.sha256 == wanted:
            return grammar
        raise GrammarError("the manifest's grammar_text does not hash to its grammar_sha256 "
                           "(edited manifest)", grammar_name=str(name))
    raise GrammarError(f"the manifest names grammar {name!r} but carries no grammar text (an "
                       f"artefact written before manifests carried it): pass the Grammar it was "
                       f"fitted on", grammar_name=str(name))


def check_manifest(manifest: Mapping[str, Any], masker: Masker, lm=None,
                   path: str = "<artefact>") -> None:
    """Raise ManifestMismatchError on the first field that differs from the run."""
    legacy = getattr(masker, "legacy_fingerprint", {})
    for field, expected in expected_fields(masker, lm).items():
        found = manifest.get(field, legacy.get(field))
        if found != expected:
            raise ManifestMismatchError(field, expected, found, path)
    status = manifest["features"]["feature_status"]
    if status != _feature_status(masker):
        raise ManifestMismatchError("features.feature_status", _feature_status(masker), status,
                                    path)


def warn_if_prompt_outside(manifest: Mapping[str, Any], prompt: str | None, where: str) -> None:
    """Warn (never refuse) when ``prompt`` is not one the controller was fitted on.

    A controller fitted for a grammar usually carries over to other prompts of the same task:
    on Spider (SQL, SmolLM2) one fitted on instance 0000 cut the KL on three prompts it never
    saw about as much as their own fits did (``docs/prompt_transfer.md``), but nothing
    guarantees it for a prompt of another kind."""
    if prompt is None:
        return
    fitted = FittedPrompts.from_manifest(manifest)
    if fitted.has_text(prompt) is False:
        warn_outside_fit(fitted, where, "the prompt", stacklevel=4)


def load_controller(directory: str | Path, masker: Masker, lm=None, *,
                    prompt: str | None = None) -> tuple[Controller, dict[str, Any]]:
    """Load and verify an artefact for this masker (and LM, when given). ``prompt``: the
    prompt it will be used with; one it was not fitted on gives a
    :class:`PromptOutsideFitWarning` (a warning, not an error)."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    check_manifest(manifest, masker, lm, str(directory / MANIFEST_FILE))
    warn_if_prompt_outside(manifest, prompt, str(directory))
    weights_path = _checked_weights(directory, manifest)
    try:
        tensors = load_file(str(weights_path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise ArtefactCorruptedError(weights_path, f"unreadable safetensors ({exc})") from None
    spec = manifest["controller"]
    cls = CONTROLLERS.get(spec["kind"])
    if cls is None:
        raise ManifestMismatchError("controller.kind", sorted(CONTROLLERS), spec["kind"],
                                    str(directory / MANIFEST_FILE))
    controller = cls(**spec["params"])
    controller.encoder_ = FeatureEncoder.from_manifest(manifest["features"]["encoder"], tensors)
    controller.weights_ = {k: tensors[f"controller.{k}"] for k in spec["weights"]}
    controller.beta_ = float(spec["beta"])
    controller.reg_ = float(spec["reg"])
    controller.eos_token_ids_ = np.array(spec["eos_token_ids"], dtype=np.int64)
    expected_rows = controller.encoder_.n_features_
    if controller.weights_["embed"].shape[0] != expected_rows:
        raise ArtefactCorruptedError(weights_path, f"first layer has "
                                                   f"{controller.weights_['embed'].shape[0]} rows "
                                                   f"but the encoder has {expected_rows} features")
    controller.n_features_in_ = expected_rows
    training = manifest.get("training", {})
    for attr, key in (("cv_log_loss_", "cv_log_loss"), ("fit_seconds_", "fit_seconds"),
                      ("contrast_gain_per_step_", "contrast_gain_per_step")):
        if key in training:
            setattr(controller, attr, training[key])
    controller.prompting_ = dict(training.get("prompting", {}))  # chat, stop_at_newline
    controller.fitted_prompts_ = FittedPrompts.from_manifest(manifest)  # the wrappers warn
    controller._prepare()
    return controller, manifest
