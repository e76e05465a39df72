"""shim-adapters: SHIM correction for grammar-constrained decoding over pluggable maskers.

The packages, bottom to top (each imports only the ones before it; see ``docs/design.md``):
:mod:`.errors`, :mod:`.grammars`, :mod:`.mask`, :mod:`.backends`, :mod:`.lm`, :mod:`.shim`,
:mod:`.integrations`, :mod:`.evaluation`, :mod:`.conformance`, then :mod:`.demo` and :mod:`.cli`.

The names a user needs are importable from here; those of the upper layers (the LM, fitting,
the integrations) load on first use, so importing the package does not load transformers.
"""

from importlib import import_module
from typing import Any

from shim_adapters.errors import (BackendNotFoundError, DeadEndError, ForbiddenTokenError,
                                  GrammarError, ManifestMismatchError, ShimError,
                                  UnsupportedGrammarError, VocabMismatchError)
from shim_adapters.grammars import BUILTIN_GRAMMARS, Grammar, builtin_grammar, load_grammar
from shim_adapters.mask.protocol import (FEATURE_NAMES, FeatureStatus, Masker, MaskerState,
                                         StateFeatures)

__version__ = "0.1.0"

#: Public name -> the module that defines it, imported when the name is first used.
_LAZY = {
    "get_backend": "shim_adapters.backends.registry",
    "backends": "shim_adapters.backends.registry",
    "BackendSpec": "shim_adapters.backends.spec",
    "load_lm": "shim_adapters.lm.loading",
    "FitRecipe": "shim_adapters.shim.fitting",
    "fit_controller": "shim_adapters.shim.fitting",
    "load_controller": "shim_adapters.shim.artefact",
    "save_controller": "shim_adapters.shim.artefact",
    "sample_with_shim": "shim_adapters.shim.correction",
    "ShimAdjuster": "shim_adapters.shim.correction",
    "shim_logits_processor": "shim_adapters.integrations.hf",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'shim_adapters' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "BUILTIN_GRAMMARS", "FEATURE_NAMES", "BackendNotFoundError", "DeadEndError", "FeatureStatus",
    "ForbiddenTokenError", "Grammar", "GrammarError", "ManifestMismatchError", "Masker",
    "MaskerState", "ShimError", "StateFeatures", "UnsupportedGrammarError", "VocabMismatchError",
    "builtin_grammar", "load_grammar", "__version__", *_LAZY,
]
