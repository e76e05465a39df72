"""The mask layer: the backend-neutral contract between a masker and everything above it.

The :class:`~.protocol.Masker` / :class:`~.protocol.MaskerState` protocol and the state
features a backend exposes (:mod:`.protocol`), packed token bitmasks and their application
(:mod:`.bitmask`, :mod:`.expansion`), UTF-8 and tokenizer identity (:mod:`.utf8`,
:mod:`.tokenizer_identity`, :mod:`.tokenizers_offline`), per-construct capability reports
(:mod:`.capability`), explaining a mask (:mod:`.explain`) and the cross-process compile cache
(:mod:`.compile_cache`).

Layer: imports :mod:`shim_adapters.errors` and :mod:`shim_adapters.grammars` only.
"""
