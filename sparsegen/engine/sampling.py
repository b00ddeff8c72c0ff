"""Sampling parameters and the sampler: greedy, temperature, top-k, top-p, seeded."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import InputError


@dataclass(frozen=True)
class SamplingParams:
    """`temperature=0` is greedy. `top_k=0` and `top_p=1` switch those filters off.

    `seed` gives the request its own random stream, so its tokens do not depend on what else
    is in the batch. Generation stops at the model's EOS (unless `ignore_eos`), at any of
    `stop_token_ids`, or after `max_tokens` new tokens.
    """

    max_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InputError(f"SamplingParams.max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise InputError(f"SamplingParams.temperature must be >= 0, got {self.temperature!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise InputError(f"SamplingParams.top_k must be an int >= 0, got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise InputError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p!r}")
        stops = self.stop_token_ids
        if not isinstance(stops, (tuple, list)) or any(
            isinstance(t, bool) or not isinstance(t, int) for t in stops
        ):
            raise InputError(f"SamplingParams.stop_token_ids must be a tuple of int token ids, got {stops!r}")
        object.__setattr__(self, "stop_token_ids", tuple(stops))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """logits: [V] float32 (already divided by the temperature); filtered entries become -inf."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # mass strictly ahead of each token
        drop_sorted = before >= top_p  # the smallest prefix reaching top_p is kept (at least one)
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample(
    logits: torch.Tensor,  # [B, V] float32
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> list[int]:
    """One token per row."""
    tokens = logits.argmax(dim=-1).tolist()
    for row, (p, gen) in enumerate(zip(params, generators, strict=True)):
        if p.greedy:
            continue
        filtered = filter_logits(logits[row] / p.temperature, p.top_k, p.top_p)
        probs = torch.softmax(filtered, dim=-1)
        tokens[row] = int(torch.multinomial(probs, 1, generator=gen))
    return tokens
