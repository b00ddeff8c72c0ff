"""sparsegen as a transformers attention backend.

`import sparsegen.hf` registers `"sparsegen"` with transformers' `AttentionInterface` (and its
`AttentionMaskInterface`, with transformers' boolean SDPA mask); then

    AutoModelForCausalLM.from_pretrained(path, attn_implementation="sparsegen")

runs `sparsegen.prefill` inside transformers' own models (the reference on a CPU, the Triton
kernel on a GPU). Each call reads its layer from the module and the keyword arguments the
model passes:
- the window: the `sliding_window` keyword (Mistral, Qwen2, Gemma-2/3, gpt-oss pass it), else
  `module.sliding_window`, else the config's `layer_types[module.layer_idx]`; None is dense;
- the logit soft-cap: the `softcap` keyword, else `module.config.attn_logit_softcapping`
  (Gemma-2);
- the scale: the `scaling` keyword;
- learned sinks: the `s_aux` keyword, else `module.sinks` (gpt-oss).
The `LayerSpec` for each (shape, window, soft-cap, sinks) is made once (`layer_spec`).

Decoding goes through transformers' own KV cache: a step's queries are the last q_len of the
k_len keys the cache hands over, which is how `prefill` reads q_len < k_len. Every row of the
batch has the same length; a mask that differs from the causal (windowed) one, which is what
left padding or packed sequences give, is refused with an InputError rather than ignored.
"""

from __future__ import annotations

import functools

import torch

from .errors import InputError, MissingExtraError
from .ops import prefill
from .spec import HeadSpec, LayerSpec

NAME = "sparsegen"


@functools.lru_cache(maxsize=256)
def layer_spec(num_heads: int, num_kv_heads: int, head_dim: int, window: int, softcap: float,
               learned_sinks: bool) -> LayerSpec:  # fmt: skip
    """One layer's spec: every head windowed (window > 0) or dense, with the soft-cap and sinks."""
    head = HeadSpec(sliding_window=window) if window else HeadSpec(dense=True)
    return LayerSpec(num_heads, num_kv_heads, head_dim, (head,) * num_heads, logit_softcap=softcap,
                     learned_sinks=learned_sinks)  # fmt: skip


def _window(module, kwargs: dict) -> int:
    if "sliding_window" in kwargs:
        w = kwargs["sliding_window"]
    elif hasattr(module, "sliding_window"):
        w = module.sliding_window
    else:
        config, idx = getattr(module, "config", None), getattr(module, "layer_idx", None)
        types = getattr(config, "layer_types", None)
        sliding = types is not None and idx is not None and types[idx] == "sliding_attention"
        w = getattr(config, "sliding_window", None) if sliding else None
    if w is None or w == 0:
        return 0
    if isinstance(w, bool) or not isinstance(w, int) or w < 0:
        raise InputError(f"the sparsegen attention backend needs an int sliding window >= 1, got {w!r:.40}")
    return w


def _softcap(module, kwargs: dict) -> float:
    c = kwargs.get("softcap")
    if c is None:
        c = getattr(getattr(module, "config", None), "attn_logit_softcapping", None)
    return float(c) if c else 0.0


def _visible(mask: torch.Tensor) -> torch.Tensor:
    """A transformers mask as booleans: True where a query sees a key (bool, or additive float)."""
    if mask.dtype == torch.bool:
        return mask
    return mask > torch.finfo(mask.dtype).min / 2


def check_mask(attention_mask, batch: int, q_len: int, k_len: int, window: int) -> None:
    """The mask transformers built must be the causal (windowed) one sparsegen computes: queries
    are the last q_len of k_len keys. Anything else (left padding, packed sequences) is refused."""
    if attention_mask is None:
        return
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 4:
        raise InputError(
            f"the sparsegen attention backend takes a 4D mask [B, 1, q_len, k_len] or None, got "
            f"{type(attention_mask).__name__} {tuple(getattr(attention_mask, 'shape', ()))}"
        )
    mask = _visible(attention_mask[..., :k_len])  # [B, 1 or H, q_len, k_len]
    dev = mask.device
    i = torch.arange(k_len - q_len, k_len, device=dev)[:, None]
    j = torch.arange(k_len, device=dev)[None, :]
    want = j <= i
    if window:
        want &= (i - j) < window
    if tuple(mask.shape[-2:]) != (q_len, k_len) or not bool((mask == want).all()):
        raise InputError(
            "the sparsegen attention backend runs unpadded batches of equal-length rows only: the "
            "attention mask differs from the causal one (left padding, packed sequences or a custom "
            "mask); generate one prompt at a time or batch prompts of the same length without padding"
        )


def sparsegen_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                        **kwargs):  # fmt: skip
    """transformers' attention function signature: query [B, H, Lq, D], key/value [B, Hkv, Lk, D]
    -> (output [B, Lq, H, D], None)."""
    if dropout and getattr(module, "training", False):
        raise InputError(
            "the sparsegen attention backend runs inference only: attention dropout is not supported"
        )
    if kwargs.get("output_attentions"):
        raise InputError(
            "the sparsegen attention backend does not return attention weights (output_attentions)"
        )
    b, h, q_len, d = query.shape
    hkv, k_len = key.shape[1], key.shape[2]
    if key.shape[0] != b or value.shape != key.shape or key.shape[3] != d:
        raise InputError(
            f"query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)} do not agree"
        )
    window = _window(module, kwargs)
    sinks = kwargs.get("s_aux", getattr(module, "sinks", None))
    layer = layer_spec(h, hkv, d, window, _softcap(module, kwargs), sinks is not None)
    check_mask(attention_mask, b, q_len, k_len, window)
    q = query.transpose(1, 2).reshape(b * q_len, h, d)  # [B*Lq, H, D]
    k = key.transpose(1, 2).reshape(b * k_len, hkv, d)  # [B*Lk, Hkv, D]
    v = value.transpose(1, 2).reshape(b * k_len, hkv, d)
    steps = torch.arange(b + 1, dtype=torch.int32, device=query.device)
    cu_q, cu_k = steps * q_len, steps * k_len  # [B+1]
    if sinks is not None:
        sinks = sinks.detach().float().reshape(h)  # [H]
    out = prefill(q, k, v, cu_q, cu_k, layer, scaling, sinks=sinks, max_seqlen_q=q_len, max_seqlen_k=k_len)
    return out.view(b, q_len, h, d), None


def register() -> None:
    """Register "sparsegen" with transformers (done on import; calling it again is harmless)."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError as exc:
        raise MissingExtraError(
            f"the transformers attention backend needs transformers ({exc}): pip install 'sparsegen[hf]'"
        ) from None
    AttentionInterface.register(NAME, sparsegen_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)


register()
