"""Views of a loaded LM that the evaluation needs; they delegate to the real model.

- :func:`stop_folded`: an LM whose "end of output" is EOS *or* any token containing a newline.
  Few-shot prompts (BV4, Spider) are answered on one line, after which an instruct LM rarely
  emits EOS but starts the next example. Folding every newline token's probability into one
  EOS id gives a proper LM (same probability of each one-line answer, ended by a newline or
  EOS) that masking, SHIM, ASAp and rejection all see alike, so the KL stays exact.
- :func:`gqa_without_copies` / :func:`shared_prefix_cache`: grouped-query attention that reads
  the KV cache in place, and one copy of the prompt's KV for a whole batch (the sampling
  engine prefills a prompt once and shares it, see :mod:`shim_adapters.lm.sampling`).
"""

from __future__ import annotations

import dataclasses

import torch
from transformers import DynamicCache


class _Delegating(torch.nn.Module):
    def __init__(self, inner) -> None:
        super().__init__()
        self.inner = inner

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.inner, name)


class StopFoldedModel(_Delegating):
    """Logits with every stop token's mass moved onto ``eos_id`` (stop tokens get -inf)."""

    def __init__(self, inner, stop_ids: list[int], eos_id: int) -> None:
        super().__init__(inner)
        ids = sorted(set(int(i) for i in stop_ids) | {int(eos_id)})
        self.register_buffer("fold_ids", torch.as_tensor(ids, dtype=torch.long), persistent=False)
        self.eos_id = int(eos_id)

    def forward(self, *args, **kwargs):
        out = self.inner(*args, **kwargs)
        logits = out.logits.float()
        merged = torch.logsumexp(logits[..., self.fold_ids], dim=-1)
        logits = logits.index_fill(-1, self.fold_ids, float("-inf"))
        logits[..., self.eos_id] = merged
        out.logits = logits
        return out


def newline_token_ids(tokenizer) -> list[int]:
    """Every token whose text contains a line break (they are whitespace-only in BPE vocabs)."""
    return [i for i in range(len(tokenizer))
            if any(c in tokenizer.decode([i]) for c in "\n\r")]


def stop_folded(lm, masker_eos_ids) -> object:
    """``lm`` (a LoadedLM) ending at EOS or at a newline, with one EOS id the masker accepts."""
    common = sorted(set(int(e) for e in masker_eos_ids))
    if not common:
        raise ValueError("the masker declares no EOS id to fold stop tokens into")
    eos_id = common[0]
    stops = newline_token_ids(lm.tokenizer) + [int(e) for e in lm.eos_token_ids] + common
    model = StopFoldedModel(lm.model, stops, eos_id).eval()
    return dataclasses.replace(lm, model=model, eos_token_ids=(eos_id,),
                               identifier=f"{lm.identifier}+stop-at-newline")


# ---- grouped-query attention without copying the KV cache --------------------------------
GQA_ATTENTION = "sdpa_gqa"


def _sdpa_gqa(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
              is_causal=None, **kwargs):
    """SDPA for one new token: the query heads that share a KV head are laid along the query
    axis, so the cache is read in place instead of being repeated per head (transformers
    4.53's ``repeat_kv`` copies the whole cache every step: most of a decode step's time with
    a 2,000-token few-shot prompt). Other shapes go to the stock SDPA path."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    b, hq, q, d = query.shape
    hkv = key.shape[1]
    if q != 1 or hq == hkv or dropout:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    n_rep = hq // hkv
    mask = attention_mask
    if mask is not None and mask.ndim == 4:
        mask = mask[:, :, :, : key.shape[-2]]
    folded = query.reshape(b, hkv, n_rep, d)
    out = torch.nn.functional.scaled_dot_product_attention(folded, key, value, attn_mask=mask,
                                                           scale=scaling)
    return out.reshape(b, hq, 1, d).transpose(1, 2).contiguous(), None


def gqa_without_copies(lm) -> bool:
    """Switch ``lm`` to :func:`_sdpa_gqa` when it uses SDPA with grouped-query attention.
    Same arithmetic, no per-step cache copy; returns whether it switched."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    config = lm.model.config
    heads = getattr(config, "num_attention_heads", None)
    kv = getattr(config, "num_key_value_heads", None) or heads
    if config._attn_implementation != "sdpa" or not heads or kv == heads:
        return False
    AttentionInterface.register(GQA_ATTENTION, _attention_with_split)
    AttentionMaskInterface.register(GQA_ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    config._attn_implementation = GQA_ATTENTION
    return True


# ---- one copy of the prompt's KV for the whole batch -------------------------------------
class SplitKV(tuple):
    """(prompt part shared by every row: batch 1, generated part: one per row)."""


def _split_attention(query, key: SplitKV, value: SplitKV, attention_mask, scaling):
    """Attention over [shared prompt KV ; per-row generated KV] without materialising the
    prompt per row. Causal inside the generated part; the prompt is visible to every query."""
    kp, kg = key
    vp, vg = value
    b, hq, q, d = query.shape
    hkv = kp.shape[1]
    n_rep = hq // hkv
    m = n_rep * q
    folded = query.reshape(b, hkv, m, d)
    scale = scaling if scaling is not None else d ** -0.5
    p_len = kp.shape[-2]
    # prompt part: the batch goes into the rows, so the shared KV is never expanded per row
    rows = folded.permute(1, 0, 2, 3).reshape(hkv, b * m, d)
    s_prompt = torch.matmul(rows, kp[0].transpose(-1, -2)).reshape(hkv, b, m, p_len) \
        .permute(1, 0, 2, 3) * scale  # (b, hkv, m, P)
    s_gen = torch.matmul(folded, kg.transpose(-1, -2)) * scale  # (b, hkv, m, g)
    g = kg.shape[-2]
    if q > 1:
        pos = torch.arange(q).unsqueeze(1) + (g - q)
        causal = torch.arange(g).unsqueeze(0) <= pos  # (q, g)
        s_gen = s_gen.masked_fill(~causal.repeat(n_rep, 1), float("-inf"))
    if attention_mask is not None and attention_mask.ndim == 4:
        mask = attention_mask[..., -q:, : p_len + g]
        if mask.dtype == torch.bool:
            mask = torch.zeros(mask.shape, dtype=s_gen.dtype).masked_fill(~mask, float("-inf"))
        mask = mask.repeat(1, 1, n_rep, 1)
        s_prompt = s_prompt + mask[..., :p_len]
        s_gen = s_gen + mask[..., p_len:]
    probs = torch.softmax(torch.cat([s_prompt, s_gen], dim=-1), dim=-1)
    p_rows = probs[..., :p_len].permute(1, 0, 2, 3).reshape(hkv, b * m, p_len)
    out_prompt = torch.matmul(p_rows, vp[0]).reshape(hkv, b, m, d).permute(1, 0, 2, 3)
    out = out_prompt + torch.matmul(probs[..., p_len:], vg)
    return out.reshape(b, hq, q, d).transpose(1, 2).contiguous()


def _attention_with_split(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                          is_causal=None, **kwargs):
    if isinstance(key, SplitKV):
        return _split_attention(query, key, value, attention_mask, scaling), None
    return _sdpa_gqa(module, query, key, value, attention_mask, dropout=dropout,
                     scaling=scaling, is_causal=is_causal, **kwargs)


class SharedPrefixCache(DynamicCache):
    """A cache for ``batch`` rows continuing one prompt whose (batch-1) KV is ``prefix``: the
    generated part is an ordinary per-row :class:`DynamicCache`, and attention reads
    :class:`SplitKV` pairs (prompt, generated). Only for models switched by
    :func:`gqa_without_copies` (their attention reads SplitKV)."""

    def __init__(self, prefix: tuple[tuple[torch.Tensor, torch.Tensor], ...], batch: int) -> None:
        super().__init__()
        self.prefix = prefix
        self.prefix_length = int(prefix[0][0].shape[-2])
        self.batch = batch

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        kp, vp = self.prefix[layer_idx]
        return SplitKV((kp, keys)), SplitKV((vp, values))

    def get_seq_length(self, layer_idx: int | None = 0) -> int:
        return self.prefix_length + super().get_seq_length(layer_idx or 0)

    def get_mask_sizes(self, query, layer_idx: int | None = 0) -> tuple[int, int]:
        # the mask spans the shared prompt and the generated part; the query is given as its
        # positions (transformers 4) or its length (transformers 5)
        length = query if isinstance(query, int) else int(query.shape[0])
        return self.get_seq_length(layer_idx) + length, 0


def shared_prefix_cache(prefix: tuple[tuple[torch.Tensor, torch.Tensor], ...],
                        batch: int) -> SharedPrefixCache:
    """A cache for ``batch`` rows continuing one prompt whose (batch-1) KV is ``prefix``
    (see :class:`SharedPrefixCache`)."""
    return SharedPrefixCache(prefix, batch)


def uses_split_attention(model) -> bool:
    config = getattr(model, "config", None)
    return getattr(config, "_attn_implementation", None) == GQA_ATTENTION
