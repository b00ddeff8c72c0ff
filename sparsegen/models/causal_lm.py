"""What the engine reads of every causal LM besides `forward`: where its weights live, how many
KV heads this process caches, and tied embeddings. One base for Phi-3-Small and the families."""

from __future__ import annotations

import torch
from torch import nn


class CausalLM(nn.Module):
    """A causal LM with `self.model.embed_tokens`, `self.lm_head` and `self.config`."""

    def checkpoint_params(self) -> dict:
        """Checkpoint tensor name -> the parameter it fills (the loader's map; a family's fused
        weights map several names into one parameter's rows, `families.fused`)."""
        return dict(self.named_parameters())

    def tie_embeddings(self) -> None:
        self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def local_num_kv_heads(self) -> int:
        """KV heads whose cache this process holds: all of them here; a rank's own groups under
        tensor parallelism (`parallel.sharding`). The engine sizes its KV cache by this."""
        return self.config.num_key_value_heads

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype
