"""The LM's KV cache through transformers' public Cache API, on transformers 4.45+ and 5.

Every forward pass that reads or extends a cache goes through :func:`forward_with_cache`:

- the keyword: transformers 5 names the cache ``cache`` (the forward argument and the output
  field) where transformers 4 names it ``past_key_values``; the name is read once from the
  library's own output class, never guessed per model;
- the type: models of transformers 4 that build their own cache hand back per-layer
  ``(key, value)`` tuples; :func:`as_cache` puts them into a :class:`DynamicCache` through its
  public ``update`` (no copy), the form both versions read;
- a batch continuing one prompt: :func:`widened` copies the prompt's cache (of the class the
  model built for itself: full or sliding-window layers) and repeats it along the batch, the
  way ``generate()`` widens a cache for several sequences per prompt.
"""

from __future__ import annotations

import copy
import dataclasses

import torch
from transformers import Cache, DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

#: The forward keyword and output field of the KV cache in the installed transformers.
CACHE_KEYWORD = ("cache" if "cache" in {f.name for f in dataclasses.fields(CausalLMOutputWithPast)}
                 else "past_key_values")


def as_cache(past) -> Cache:
    """``past`` as a transformers :class:`Cache` (legacy per-layer tuples are wrapped)."""
    if isinstance(past, Cache):
        return past
    if past is None:
        raise TypeError("the model returned no KV cache although use_cache=True was asked")
    cache = DynamicCache()
    for layer, (key, value) in enumerate(past):
        cache.update(key, value, layer)
    return cache


def forward_with_cache(model, input_ids: torch.Tensor,
                       cache: Cache | None = None) -> tuple[torch.Tensor, Cache]:
    """Run ``model`` on ``input_ids`` after ``cache`` (None: from the start); returns the logits
    and the extended cache (``cache`` itself where the model extends it in place)."""
    kwargs = {"input_ids": input_ids, "use_cache": True}
    if cache is not None:
        kwargs[CACHE_KEYWORD] = cache
    out = model(**kwargs)
    return out.logits, as_cache(getattr(out, CACHE_KEYWORD))


def widened(cache: Cache, batch: int) -> Cache:
    """A copy of a batch-1 ``cache`` repeated ``batch`` times (``cache`` is left as it is)."""
    wide = copy.deepcopy(cache)
    wide.batch_repeat_interleave(batch)
    return wide


def prompt_kv(cache: Cache) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
    """The (key, value) tensors of each layer of ``cache`` (iteration gives them first in every
    layer's entry; transformers 5 adds a sliding-window field after them)."""
    return tuple((entry[0], entry[1]) for entry in cache)
