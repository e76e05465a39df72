"""Integrations: SHIM inside the generation loops people already run.

:mod:`.hf` gives transformers ``LogitsProcessor`` objects built from a masker and a controller
artefact; the per-backend wrappers (XGrammar's and SynCode's processors, ``outlines.Generator``)
live in the backend plugins and build on it.

Layer: imports SHIM, the LM layer and below.
"""
