"""shim-outlines: the outlines engines (outlines_core, llguidance) as a shim-adapters backend."""

from .cfg_masker import LLGuidanceMasker, LLGuidanceState
from .plugin import backend_spec, create_masker
from .regex_masker import OutlinesCoreMasker, OutlinesCoreState
from .shadow_parser import ShadowGrammar, ShadowParser, ShadowParserError

__all__ = ["LLGuidanceMasker", "LLGuidanceState", "OutlinesCoreMasker", "OutlinesCoreState",
           "ShadowGrammar", "ShadowParser", "ShadowParserError", "backend_spec", "create_masker"]
