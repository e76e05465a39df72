"""shim-adapters: SHIM correction for grammar-constrained decoding over pluggable maskers."""

from shim_adapters.errors import (
                     BackendNotFoundError,
                     DeadEndError,
                     ForbiddenTokenError,
                     GrammarError,
                     ManifestMismatchError,
                     ShimError,
                     UnsupportedGrammarError,
                     VocabMismatchError,
)
from shim_adapters.grammars.grammar import BUILTIN_GRAMMARS, Grammar, builtin_grammar, load_grammar
from shim_adapters.mask.protocol import (
                     FEATURE_NAMES,
                     FeatureStatus,
                     Masker,
                     MaskerState,
                     StateFeatures,
)

__version__ = "0.1.0"

__all__ = [
    "BUILTIN_GRAMMARS", "FEATURE_NAMES", "BackendNotFoundError", "DeadEndError", "FeatureStatus",
    "ForbiddenTokenError", "Grammar", "GrammarError", "ManifestMismatchError", "Masker",
    "MaskerState", "ShimError", "StateFeatures", "UnsupportedGrammarError", "VocabMismatchError",
    "builtin_grammar", "load_grammar", "__version__",
]
