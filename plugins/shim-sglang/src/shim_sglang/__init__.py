"""SHIM in SGLang: a ``CustomLogitProcessor`` configured per request through ``custom_params``."""

__version__ = "0.1.0"
