"""`DecoderForCausalLM`: a decoder family (`families.FAMILIES`) with the interface
the engine drives (`forward(input_ids, batch, kv_caches)` -> float32 logits for
`batch.logits_index` rows, `spec`, `set_force_dense`, `local_num_kv_heads`, ...), as
`Phi3SmallForCausalLM` has it."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from ...errors import InputError
from ...kernels.linear import gemv as gemv_kernel
from ...spec import HeadSpec, ModelSpec
from ..batch import ForwardBatch
from ..causal_lm import CausalLM
from ..layers import Embedding, Linear, RMSNorm, add_norm, fusable_norm, gemv_layer, norm_args
from ..options import ModelOptions
from .blocks import DecoderLayer, KVCacheLayer
from .config import DecoderConfig
from .fused import Rows, checkpoint_params
from .rope import DecoderRotary


def decoder_spec(config: DecoderConfig, force_dense: bool = False) -> ModelSpec:
    """Each layer's LayerSpec from config.json (`hf_config`: windows per layer), or all dense."""
    spec = config.attention_spec()
    if not force_dense:
        return spec
    dense = tuple(replace(layer, heads=(HeadSpec(dense=True),) * layer.num_heads) for layer in spec.layers)
    return ModelSpec(name=f"{spec.name}-dense", layers=dense)


class DecoderModel(nn.Module):
    def __init__(self, config: DecoderConfig, spec: ModelSpec, options: ModelOptions, fk: dict):
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, **fk)
        self.layers = nn.ModuleList(DecoderLayer(config, layer, options, fk) for layer in spec.layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, fk, config.norm_offset)


class DecoderForCausalLM(CausalLM):
    def __init__(self, config: DecoderConfig, options: ModelOptions | None = None, **fields):
        super().__init__()
        options = ModelOptions.of(options, **fields)
        self.config = config
        self.options = options
        self.spec = decoder_spec(config, options.force_dense)
        self.attn_impl = options.attn_impl
        fk = {"device": options.device, "dtype": options.dtype}
        self.model = DecoderModel(config, self.spec, options, fk)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False, **fk)
        self.rotary = DecoderRotary(config.rope, options.device)
        # Gemma-3: the windowed layers rotate with their own base (which layers: the file's own
        # spec, so that force_dense keeps each layer's rotary)
        self.local_rotary = DecoderRotary(config.local_rope, options.device) if config.local_rope else None
        windowed = [layer.heads[0].sliding_window > 0 for layer in decoder_spec(config).layers]
        self.local_layers = tuple(windowed) if self.local_rotary is not None else (False,) * len(windowed)
        # Gemma's sqrt(hidden), rounded to the model's dtype as transformers rounds it
        self.embed_scale = float(torch.tensor(config.embed_scale, dtype=options.dtype))
        self.fused = options.attn_impl != "reference"  # the fused kernels, on a GPU (models.layers)
        self.gemv = options.gemv_on  # the batch-1 Triton GEMV: on for a GPU, as for Phi-3-Small

    def set_force_dense(self, force_dense: bool) -> None:
        self.spec = decoder_spec(self.config, force_dense)
        for block, layer in zip(self.model.layers, self.spec.layers, strict=True):
            block.self_attn.layer = layer

    def set_triton_gemv(self, on: bool, o_proj: bool | None = None) -> None:
        if not isinstance(on, bool) or not isinstance(o_proj, (bool, type(None))):
            raise InputError(f"set_triton_gemv takes bools, got {on!r}, o_proj={o_proj!r}")
        o_proj = self.options.gemv_o_proj if o_proj is None else o_proj
        self.options = replace(self.options, triton_gemv=on, gemv_o_proj=o_proj)
        self.gemv = on
        for block in self.model.layers:
            block.self_attn.gemv = block.mlp.gemv = on
            block.self_attn.gemv_o = o_proj

    def checkpoint_params(self) -> dict[str, nn.Parameter | Rows]:
        """Checkpoint tensor name -> what it fills (the fused q/k/v and gate/up rows: `fused`)."""
        return checkpoint_params(self, self.config)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        batch: ForwardBatch,
        kv_caches: list[KVCacheLayer] | None = None,
    ) -> torch.Tensor:  # [B, vocab] float32, or [T, vocab] when batch.logits_index is None
        cfg = self.config
        x = self.model.embed_tokens(input_ids)  # [T, hidden]
        if cfg.embed_scale != 1.0:
            x = x * self.embed_scale
        rope = {False: self.rotary.cos_sin(batch.positions)}  # [T, D] cos and sin
        if self.local_rotary is not None:
            rope[True] = self.local_rotary.cos_sin(batch.positions)
        residual = None
        for i, layer in enumerate(self.model.layers):
            cos, sin = rope[self.local_layers[i]]
            x, residual = layer(x, residual, cos, sin, batch, kv_caches[i] if kv_caches is not None else None)
        if batch.logits_index is not None:
            x, residual = x[batch.logits_index], residual[batch.logits_index]  # [B, hidden]
        final = self.model.norm
        if gemv_layer(self.lm_head, self.gemv, x) and fusable_norm(final):  # the final add + norm inside
            args, kind = norm_args(final, residual)
            logits, _ = gemv_kernel.gemv(x, self.lm_head.weight, None, norm=args, norm_kind=kind)
        else:
            h, _ = add_norm(final, x, residual, self.fused)
            logits = self.lm_head(h)  # [B, vocab]
        if cfg.final_softcap:
            logits = torch.tanh(logits / cfg.final_softcap) * cfg.final_softcap
        return logits.float()
