"""Phi-3-Small (DESIGN §2) as a plain PyTorch module whose attention is sparsegen's.

Module names equal the checkpoint's tensor names (`model.layers.N.self_attn.query_key_value`,
...), so `state_dict()` *is* the HF layout. Attention goes only through `sparsegen.prefill` /
`sparsegen.paged_decode`, each layer with its own `LayerSpec`: compiled kernels on a GPU, the
reference on a CPU. Tokens are flattened: activations are `[T, hidden]` for T tokens of a batch.
"""

from __future__ import annotations

import torch
from torch import nn

from .. import ops
from ..errors import InputError
from ..presets import from_hf_config
from ..spec import HeadSpec, LayerSpec, ModelSpec
from .batch import ForwardBatch
from .config import Phi3SmallConfig
from .rope import Rotary

KVCacheLayer = tuple[torch.Tensor, torch.Tensor]  # k_cache, v_cache: [num_pages, page_size, Hkv, D]

# attn_impl -> (prefill impl, decode impl) passed to sparsegen.prefill / sparsegen.paged_decode.
# None picks per device (kernels on a GPU, the reference on a CPU); "triton" forces the generated
# prefill kernel (also under TRITON_INTERPRET=1 on a CPU) and lets decode pick per device.
ATTN_IMPLS = {None: (None, None), "reference": ("reference", "reference"), "triton": ("triton", None)}


def model_spec(config: Phi3SmallConfig, force_dense: bool = False) -> ModelSpec:
    """Each layer's LayerSpec from the config's blocksparse_* fields (or all dense)."""
    spec = from_hf_config(config.to_hf_dict(), name="phi3small")
    if not force_dense:
        return spec
    dense = tuple(
        LayerSpec(
            num_heads=layer.num_heads,
            num_kv_heads=layer.num_kv_heads,
            head_dim=layer.head_dim,
            heads=(HeadSpec(dense=True),) * layer.num_heads,
        )
        for layer in spec.layers
    )
    return ModelSpec(name="phi3small-dense", layers=dense)


def _fused(x: torch.Tensor, impl: tuple) -> bool:
    """The fused elementwise kernels run on a GPU, except in the reference model (attn_impl
    "reference"), which stays plain PyTorch throughout so that it can serve as the oracle."""
    return x.is_cuda and impl[0] != "reference"


def fused_ops():
    """sparsegen.models.fused, imported on first use on a GPU (it defines Triton kernels)."""
    from . import fused

    return fused


def gegelu(x: torch.Tensor, limit: float) -> torch.Tensor:
    """GeGeLU over interleaved halves: even columns are the gate, odd ones the linear part."""
    gate = x[..., 0::2].clamp(max=limit)
    linear = x[..., 1::2].clamp(min=-limit, max=limit)
    return gate * torch.sigmoid(1.702 * gate) * (linear + 1.0)


class _NoInit:
    """Parameters are allocated, never initialised: the loader or `random_model` fills each one.

    (Building on the meta device instead would run torch's Python init refs, which import
    torch._dynamo and with it Triton, before a test can turn on TRITON_INTERPRET.)
    """

    def reset_parameters(self) -> None:
        pass


class Linear(_NoInit, nn.Linear):
    pass


class Embedding(_NoInit, nn.Embedding):
    pass


class Attention(nn.Module):
    def __init__(self, config: Phi3SmallConfig, layer: LayerSpec, fk: dict):
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        self.group = config.group_size
        self.scale = config.attention_scale
        qkv_out = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        self.query_key_value = Linear(config.hidden_size, qkv_out, bias=True, **fk)
        self.dense = Linear(config.hidden_size, config.hidden_size, bias=True, **fk)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,  # [T, D]
        sin: torch.Tensor,  # [T, D]
        batch: ForwardBatch,
        kv_cache: KVCacheLayer | None,
        impl: tuple[str | None, str | None],  # (prefill impl, decode impl) for sparsegen.ops
    ) -> torch.Tensor:  # [T, hidden]
        t = x.shape[0]
        h, hkv, d, g = self.num_heads, self.num_kv_heads, self.head_dim, self.group
        qkv = self.query_key_value(x).view(t, hkv, g + 2, d)  # per KV group: G queries, then k, then v
        write = kv_cache if kv_cache is not None and batch.slot_mapping is not None else None
        if _fused(x, impl) and fused_ops().supports_rotary(qkv):  # one kernel: rotary, split, cache write
            q, k, v = fused_ops().rotary_qkv(qkv, cos, sin, write, batch.slot_mapping)
        else:
            q = Rotary.apply(qkv[:, :, :g].reshape(t, h, d), cos, sin)  # [T, H, D]
            k = Rotary.apply(qkv[:, :, g], cos, sin)  # [T, Hkv, D]
            v = qkv[:, :, g + 1].contiguous()  # [T, Hkv, D]
            if write is not None:
                write[0].view(-1, hkv, d).index_copy_(0, batch.slot_mapping, k)
                write[1].view(-1, hkv, d).index_copy_(0, batch.slot_mapping, v)
        if batch.is_decode:
            if kv_cache is None:
                raise InputError("a decode step needs a KV cache")
            out = ops.paged_decode(
                q,
                kv_cache[0],
                kv_cache[1],
                batch.block_tables,
                batch.seq_lens,
                self.layer,
                scale=self.scale,
                impl=impl[1],
            )
        else:
            if batch.kv_gather is not None:
                k_all = kv_cache[0].view(-1, hkv, d)[batch.kv_gather]  # [Tk, Hkv, D]: cached prefix + new
                v_all = kv_cache[1].view(-1, hkv, d)[batch.kv_gather]
            else:
                k_all, v_all = k, v
            out = ops.prefill(
                q,
                k_all,
                v_all,
                batch.cu_seqlens_q,
                batch.cu_seqlens_k,
                self.layer,
                scale=self.scale,
                impl=impl[0],
                check=False,  # the engine built cu_seqlens itself: skip the host read (no sync)
            )
        return self.dense(out.reshape(t, h * d))


class MLP(nn.Module):
    def __init__(self, config: Phi3SmallConfig, fk: dict):
        super().__init__()
        self.limit = config.gegelu_limit
        self.up_proj = Linear(config.hidden_size, 2 * config.ff_intermediate_size, bias=True, **fk)
        self.down_proj = Linear(config.ff_intermediate_size, config.hidden_size, bias=True, **fk)

    def forward(self, x: torch.Tensor, fused: bool = False) -> torch.Tensor:
        up = self.up_proj(x)  # [T, 2 * F], gate and linear columns interleaved
        act = fused_ops().gegelu(up, self.limit) if fused else gegelu(up, self.limit)  # [T, F]
        return self.down_proj(act)


class DecoderLayer(nn.Module):
    def __init__(self, config: Phi3SmallConfig, layer: LayerSpec, fk: dict):
        super().__init__()
        eps = config.layer_norm_epsilon
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=eps, **fk)
        self.self_attn = Attention(config, layer, fk)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=eps, **fk)
        self.mlp = MLP(config, fk)

    def forward(self, x, cos, sin, batch, kv_cache, impl):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, batch, kv_cache, impl)
        return x + self.mlp(self.post_attention_layernorm(x), fused=_fused(x, impl))


class Phi3SmallModel(nn.Module):
    def __init__(self, config: Phi3SmallConfig, spec: ModelSpec, fk: dict):
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, **fk)
        self.layers = nn.ModuleList(DecoderLayer(config, layer, fk) for layer in spec.layers)
        self.final_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon, **fk)


class Phi3SmallForCausalLM(nn.Module):
    """`forward(input_ids, batch, kv_caches)` -> float32 logits for `batch.logits_index` rows."""

    def __init__(
        self,
        config: Phi3SmallConfig,
        *,
        force_dense: bool = False,
        attn_impl: str | None = None,
        dummy_token_indices: tuple[int, ...] = (),
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        if attn_impl not in ATTN_IMPLS:
            raise InputError(f"attn_impl must be one of {tuple(ATTN_IMPLS)}, got {attn_impl!r}")
        self.config = config
        self.spec = model_spec(config, force_dense)
        self.attn_impl = attn_impl
        self._impls = ATTN_IMPLS[attn_impl]
        fk = {"device": device, "dtype": dtype}
        self.model = Phi3SmallModel(config, self.spec, fk)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False, **fk)
        self.rotary = Rotary(config, device)
        dummies = (
            config.dummy_token_indices if config.dummy_token_indices is not None else dummy_token_indices
        )
        dummies = sorted({i for i in dummies if 0 <= i < config.vocab_size})
        self.register_buffer(
            "dummy_ids", torch.tensor(dummies, dtype=torch.long, device=device), persistent=False
        )

    def set_force_dense(self, force_dense: bool) -> None:
        """Switch every layer between its own spec and a dense one (same weights)."""
        self.spec = model_spec(self.config, force_dense)
        for block, layer in zip(self.model.layers, self.spec.layers, strict=True):
            block.self_attn.layer = layer

    def tie_embeddings(self) -> None:
        self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def local_num_kv_heads(self) -> int:
        """KV heads whose cache this process holds: all of them here; a rank's own groups under
        tensor parallelism (`models.tensor_parallel`). The engine sizes its KV cache by this."""
        return self.config.num_key_value_heads

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        batch: ForwardBatch,
        kv_caches: list[KVCacheLayer] | None = None,
    ) -> torch.Tensor:  # [B, vocab] float32, or [T, vocab] when batch.logits_index is None
        cfg = self.config
        x = self.model.embed_tokens(input_ids) * cfg.mup_embedding_multiplier  # [T, hidden]
        cos, sin = self.rotary.cos_sin(batch.positions, batch.use_long_rope)  # [T, D]
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, batch, kv_caches[i] if kv_caches is not None else None, self._impls)
        if batch.logits_index is not None:
            x = x[batch.logits_index]
        x = self.model.final_layernorm(x)
        logits = self.lm_head(x).float() / cfg.mup_width_multiplier  # [B, vocab]
        if self.dummy_ids.numel():
            logits.index_fill_(-1, self.dummy_ids, torch.finfo(logits.dtype).min)
        return logits
