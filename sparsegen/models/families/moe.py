"""gpt-oss's mixture of experts: a biased linear router picks each token's top-k experts and
softmaxes their logits into weights; each expert is a clamped SwiGLU over interleaved gate / up
columns (gate clamped above at `limit`, up to [-limit, limit], out = (up + 1) * gate *
sigmoid(alpha * gate)). Plain loops over the experts a batch hits (correct first, no grouped
GEMM yet). Inside a CUDA-graph capture or torch.compile, which cannot read the routing on the
host: for a few tokens (3 T k < E, a batch-1 decode step) each token's k experts' weights are
gathered on the device and applied as batched matmuls (`routed`: their weights read three times,
3 k / E of all the experts' bytes, 0.375 for gpt-oss-20b); otherwise every expert runs on every
token, weighted 0 where the router did not pick it. Tensor names are the checkpoint's (`mlp.router.*`, `mlp.experts.*`)."""

from __future__ import annotations

import torch
from torch import nn

from ..layers import Linear
from .config import DecoderConfig


class Experts(nn.Module):
    def __init__(self, config: DecoderConfig, fk: dict):
        super().__init__()
        e, h, f = config.num_experts, config.hidden_size, config.intermediate_size
        self.limit, self.alpha = config.swiglu_limit, config.swiglu_alpha
        self.gate_up_proj = nn.Parameter(torch.empty(e, h, 2 * f, **fk))  # [E, hidden, 2F] interleaved
        self.gate_up_proj_bias = nn.Parameter(torch.empty(e, 2 * f, **fk))  # [E, 2F]
        self.down_proj = nn.Parameter(torch.empty(e, f, h, **fk))  # [E, F, hidden]
        self.down_proj_bias = nn.Parameter(torch.empty(e, h, **fk))  # [E, hidden]
        # False on a tensor-parallel rank but the first: its down_proj output is a partial sum
        # over its share of F, which the ranks all-reduce, so the bias is added by one rank only
        self.down_bias_on = True

    def expert(self, i: int, x: torch.Tensor) -> torch.Tensor:  # x: [n, hidden] -> [n, hidden]
        gate_up = x @ self.gate_up_proj[i] + self.gate_up_proj_bias[i]  # [n, 2F]
        gate = gate_up[:, 0::2].clamp(max=self.limit)
        up = gate_up[:, 1::2].clamp(min=-self.limit, max=self.limit)
        out = ((up + 1) * (gate * torch.sigmoid(gate * self.alpha))) @ self.down_proj[i]  # [n, hidden]
        return out + self.down_proj_bias[i] if self.down_bias_on else out

    def routed(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden], idx: [T, k] expert ids -> [T, k, hidden]: each token through each of its
        experts, their weights gathered on the device (no host read)."""
        w_gu, b_gu = self.gate_up_proj[idx], self.gate_up_proj_bias[idx]  # [T, k, hidden, 2F], [T, k, 2F]
        gate_up = (x[:, None, None, :] @ w_gu).squeeze(2) + b_gu  # [T, k, 2F]
        gate = gate_up[..., 0::2].clamp(max=self.limit)
        up = gate_up[..., 1::2].clamp(min=-self.limit, max=self.limit)
        act = (up + 1) * (gate * torch.sigmoid(gate * self.alpha))  # [T, k, F]
        w_down, b_down = self.down_proj[idx], self.down_proj_bias[idx]  # [T, k, F, hidden], [T, k, hidden]
        out = (act[:, :, None, :] @ w_down).squeeze(2)  # [T, k, hidden]
        return out + b_down if self.down_bias_on else out


class MixtureOfExperts(nn.Module):
    def __init__(self, config: DecoderConfig, fk: dict):
        super().__init__()
        self.top_k = config.experts_per_tok
        self.router = Linear(config.hidden_size, config.num_experts, bias=True, **fk)
        self.experts = Experts(config, fk)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, hidden]
        logits = self.router(x)  # [T, E]
        top, idx = torch.topk(logits, self.top_k, dim=-1)  # [T, k]
        weights = torch.softmax(top, dim=-1)  # [T, k]
        out = torch.zeros_like(x)
        if x.is_cuda and torch.cuda.is_current_stream_capturing() or torch.compiler.is_compiling():
            return self.static_routing(x, idx, weights)
        for e in torch.unique(idx).tolist():  # the experts this batch routes to
            tok, slot = torch.where(idx == e)  # the tokens routed to expert e, and at which rank
            out.index_add_(0, tok, self.experts.expert(e, x[tok]) * weights[tok, slot, None])
        return out

    def static_routing(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The mixture with no host read of the routing (idx, weights: [T, k]) -> [T, hidden]: the
        gathered experts for a few tokens, else every expert on every token, weighted 0 where the
        router did not pick it."""
        num_experts = self.experts.gate_up_proj.shape[0]
        if 3 * x.shape[0] * self.top_k < num_experts:
            return (self.experts.routed(x, idx) * weights[..., None]).sum(1)
        out = torch.zeros_like(x)
        for e in range(num_experts):
            w = (weights * (idx == e)).sum(-1, keepdim=True)  # [T, 1]
            out += self.experts.expert(e, x) * w
        return out
