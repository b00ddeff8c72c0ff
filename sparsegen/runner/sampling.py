"""The sampler, vectorised over the batch (its parameters: `request.sampling_params`).

`sample()` turns one step's logits into one token per row:

1. raw log-probabilities (`log_softmax` of the model's logits) for rows that ask for `logprobs`;
   then each constrained row's grammar mask (`runner.token_mask`: forbidden tokens to -inf);
2. `logit_bias` added, then `allowed_token_ids` (every other token to -inf);
3. `min_tokens`: EOS and the stop tokens are masked until a row has that many new tokens;
4. penalties: repetition (prompt and output tokens, CTRL style), presence and frequency (output
   tokens only);
5. greedy rows (temperature below 1e-5, vLLM's threshold) take the argmax; the others divide
   by their temperature, apply `min_p`, `top_k` and `top_p`, and draw with the
   exponential-race trick: `argmax(probs / q)`, `q ~ Exp(1)`.

Extreme valid values never turn a row into NaN: penalised logits are capped at float32's
largest finite value, each row's maximum is subtracted before the temperature divides it (so
the best token stays at 0 and nothing overflows upward), top-p always keeps the most likely
token, and a row whose `min_tokens` would ban every token (or every allowed token) is left
unmasked.

Every step is a batched tensor operation; Python loops only build index lists. A row with a
`seed` draws its noise from a counter-based hash of (seed, number of tokens it has generated,
token id), so its tokens depend on nothing else in the batch and come out the same after a
preemption recomputes it. Rows without a seed get fresh seeds from torch's global generator.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from ..errors import InputError
from ..request.sampling_params import (
    FLOAT32_MAX,
    MAX_LOGPROBS,
    SEED_LIMIT,
    SamplerOutput,
    SamplingParams,
    TokenLogprobs,
)
from .prompt_logprobs import DevicePromptLogprobs
from .token_mask import apply_token_bitmask, check_masks, mask_allows_beyond
from .transfer import on_device

# The parameters and result types live in sampling_params; callers may import them from here too.
__all__ = ["MAX_LOGPROBS", "SEED_LIMIT", "DeviceSample", "SamplerOutput", "SamplingParams", "TokenLogprobs",
           "apply_min_p", "apply_penalties", "apply_top_k_top_p", "filter_logits", "sample", "sample_on_device",
           "seeded_exponentials"]  # fmt: skip


ARGMAX_CHUNK = 512  # greedy_argmax's first stage reduces chunks of this many logits (0: torch.argmax)


def greedy_argmax(x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(dim=-1)` for x [B, V] -> [B] int64, the same index (the first maximal one; a NaN
    counts as the maximum, as in torch.argmax), in two stages: the maximum of each ARGMAX_CHUNK
    chunk of a row, then the best chunk. For Phi-3-Small's 100,352 logits, measured on the H200
    (benchmarks/engine/bench_argmax.py): torch.argmax took 21.7 us for one row and 30.9 for 32, this 11.8
    and 17.0 (chunks of 512; 13.2 / 18.3 with 1024); the token is on a decode step's critical
    path."""
    b, v = x.shape
    c = ARGMAX_CHUNK
    if c <= 0 or v <= c:
        return x.argmax(dim=-1)
    n = -(-v // c)
    if n * c != v:  # pad with -inf: never the first maximal entry unless the row is all -inf,
        # and then index 0 wins in both ways
        x = torch.nn.functional.pad(x, (0, n * c - v), value=-math.inf)
    vals, idx = x.view(b, n, c).max(dim=-1)  # [B, n] each chunk's maximum and its first index
    best = vals.argmax(dim=-1, keepdim=True)  # [B, 1] the first chunk holding the row's maximum
    return (best * c + idx.gather(1, best))[:, 0]


# -- filters --------------------------------------------------------------------------------------
def apply_top_k_top_p(
    logits: torch.Tensor,  # [B, V] float32, already divided by the temperature
    top_k: torch.Tensor | None,  # [B] int64, V where off
    top_p: torch.Tensor | None,  # [B] float32, 1 where off
) -> torch.Tensor:
    """Filtered entries become -inf. Top-k keeps ties of the k-th value; top-p keeps the smallest
    prefix (by descending probability) whose mass reaches p, so at least one token survives."""
    if top_k is None and top_p is None:
        return logits
    values, order = logits.sort(dim=-1, descending=True)  # [B, V]
    if top_k is not None:
        kth = values.gather(1, (top_k.clamp(1, logits.shape[-1]) - 1)[:, None])  # [B, 1]
        values = values.masked_fill(values < kth, float("-inf"))
    if top_p is not None:
        probs = values.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass strictly ahead of each token
        drop = before >= top_p[:, None]  # [B, V]; a top_p that underflows float32 is 0 here,
        drop[:, 0] = False  # and the most likely token stays whatever top_p is
        values = values.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, values)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """logits: [B, V]; min_p: [B]. Drops tokens less likely than min_p times the most likely."""
    probs = logits.softmax(dim=-1)
    keep = probs >= min_p[:, None] * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(~keep, float("-inf"))


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """One row (or a batch) with one top-k / top-p setting; see `apply_top_k_top_p`."""
    rows = logits.reshape(-1, logits.shape[-1])
    b, v = rows.shape
    k = torch.full((b,), top_k if top_k > 0 else v, dtype=torch.long, device=rows.device)
    p = torch.full((b,), float(top_p), dtype=rows.dtype, device=rows.device)
    out = apply_top_k_top_p(rows, k if top_k > 0 else None, p if top_p < 1.0 else None)
    return out.reshape(logits.shape)


def apply_penalties(
    logits: torch.Tensor,  # [B, V] float32
    prompt_ids: Sequence[Sequence[int]],
    output_ids: Sequence[Sequence[int]],
    repetition: torch.Tensor,  # [B]
    presence: torch.Tensor,  # [B]
    frequency: torch.Tensor,  # [B]
) -> torch.Tensor:
    b, v = logits.shape
    dev = logits.device

    def counts(lists: Sequence[Sequence[int]]) -> torch.Tensor:  # [B, V] float32 occurrences
        width = max((len(x) for x in lists), default=0)
        ids = torch.full((b, max(width, 1)), v, dtype=torch.long)  # v: a padding column, dropped
        for row, x in enumerate(lists):
            ids[row, : len(x)] = torch.as_tensor(list(x), dtype=torch.long)
        out = torch.zeros(b, v + 1, device=dev)
        return out.scatter_add_(1, ids.to(dev), torch.ones(ids.shape, device=dev))[:, :v]

    out_counts = counts(output_ids)
    seen = (out_counts > 0) | (counts(prompt_ids) > 0)  # [B, V]
    # a penalty below float32's smallest normal number would be 0 here (a division by zero)
    rep = repetition.clamp(min=torch.finfo(torch.float32).tiny)[:, None]
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - frequency[:, None] * out_counts - presence[:, None] * (out_counts > 0).float()
    return logits.clamp(max=FLOAT32_MAX)  # +inf (a huge boost) becomes the largest float; -inf stays


def apply_logit_processors(x: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """x: [B, V] float32 -> [B, V]: each row's `logit_bias` added, then tokens outside its
    `allowed_token_ids` set to -inf. One scatter for all rows' biases and one for all rows'
    allowed sets (the loop over rows only builds the index lists); rows with neither are
    untouched. Ids are within the vocabulary (engine.checks); the result is capped at float32's
    largest finite value so a bias never makes +inf."""
    b, v = x.shape
    dev = x.device
    rows, cols, vals = [], [], []
    for r, p in enumerate(params):
        for tok, bias in p.logit_bias:
            rows.append(r)
            cols.append(tok)
            vals.append(bias)
    if rows:
        bias = torch.zeros(b, v, device=dev).index_put_(
            (on_device(dev, rows), on_device(dev, cols)), on_device(dev, vals, torch.float32)
        )  # [B, V]; ids within a row are distinct (SamplingParams sorts and checks them)
        x = (x + bias).clamp(max=FLOAT32_MAX)
    rows, cols, masked = [], [], []
    for r, p in enumerate(params):
        if p.allowed_token_ids is not None:
            masked.append(r)
            rows += [r] * len(p.allowed_token_ids)
            cols += p.allowed_token_ids
    if masked:
        keep = torch.ones(b, v, dtype=torch.bool, device=dev)  # [B, V]
        keep[on_device(dev, masked)] = False
        keep.index_put_(
            (on_device(dev, rows), on_device(dev, cols)), torch.ones((), dtype=torch.bool, device=dev)
        )
        x = x.masked_fill(~keep, -math.inf)
    return x


# -- noise ----------------------------------------------------------------------------------------
_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash on int64 tensors holding values in [0, 2**32): products stay < 2**63."""
    x = x ^ (x >> 16)
    x = (x * 0x045D9F3B) & _M32
    x = x ^ (x >> 16)
    x = (x * 0x045D9F3B) & _M32
    return x ^ (x >> 16)


def seeded_exponentials(seeds: Sequence[int], steps: Sequence[int], vocab: int, device) -> torch.Tensor:
    """[B, vocab] float32 Exp(1) noise, a pure function of (seed, step, column) per row."""
    s = [seed % SEED_LIMIT for seed in seeds]
    lo = on_device(device, [x & _M32 for x in s], torch.long)[:, None]
    hi = on_device(device, [x >> 32 for x in s], torch.long)[:, None]
    step = on_device(device, [t & _M32 for t in steps], torch.long)[:, None]
    k1 = _mix32(lo ^ 0x243F6A88)
    k2 = _mix32(hi ^ k1 ^ 0x85A308D3)
    k3 = _mix32(step ^ k2 ^ 0x13198A2E)  # [B, 1] one key per (seed, step)
    col = (torch.arange(vocab, dtype=torch.long, device=device)[None, :] * 0x9E3779B1) & _M32
    h = _mix32((_mix32(col ^ k3) + k1) & _M32)  # [B, V] in [0, 2**32)
    u = ((h >> 8).double() + 0.5) * 2.0**-24  # uniform in (0, 1), never 0 or 1
    return (-torch.log(u)).float()


# -- the sampler ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class DeviceSample:
    """One step's sampler output before the host reads it: tensors on the logits' device, or
    (after `to_host`) pinned copies that an event says when are complete."""

    token_ids: torch.Tensor  # [B] int64
    logprob_rows: tuple[int, ...] = ()  # rows that asked for logprobs, in order
    logprob_ks: tuple[int, ...] = ()  # each such row's number of top entries
    chosen: torch.Tensor | None = None  # [R] float32: the sampled token's log-probability
    top_ids: torch.Tensor | None = None  # [R, k] int64, k = max(logprob_ks) (None when k == 0)
    top_values: torch.Tensor | None = None  # [R, k] float32
    ready: torch.cuda.Event | None = None  # recorded after the copies to the host (GPU only)
    failed: tuple[tuple[int, str], ...] = ()  # rows whose sampling failed, and why (runner.isolation)
    prompt: DevicePromptLogprobs | None = None  # the step's prompt log-probabilities, if any

    def to_host(self) -> DeviceSample:
        """Start copying every tensor to pinned host memory (non-blocking, on the current stream)
        and record an event after them; on a CPU the tensors are already on the host."""
        if self.token_ids.device.type != "cuda":
            return self

        def pinned(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            return out.copy_(t, non_blocking=True)

        ready = torch.cuda.Event()
        host = replace(self, token_ids=pinned(self.token_ids), chosen=pinned(self.chosen),
                       top_ids=pinned(self.top_ids), top_values=pinned(self.top_values),
                       prompt=self.prompt.to_host(pinned) if self.prompt is not None else None)  # fmt: skip
        ready.record()
        return replace(host, ready=ready)

    def output(self) -> SamplerOutput:
        """The tokens (and log-probabilities) as Python values; waits for `to_host`'s copies."""
        if self.ready is not None:
            self.ready.synchronize()
        token_ids = self.token_ids.tolist()
        logprobs: list[TokenLogprobs | None] = [None] * len(token_ids)
        if self.logprob_rows:
            chosen = self.chosen.tolist()
            top_i = self.top_ids.tolist() if self.top_ids is not None else None
            top_v = self.top_values.tolist() if self.top_values is not None else None
            for j, (r, kr) in enumerate(zip(self.logprob_rows, self.logprob_ks, strict=True)):
                top = tuple(zip(top_i[j][:kr], top_v[j][:kr], strict=True)) if kr else ()
                logprobs[r] = TokenLogprobs(token_ids[r], chosen[j], top)
        prompt = self.prompt.output() if self.prompt is not None else ()
        return SamplerOutput(token_ids, logprobs, self.failed, prompt)


def sample(
    logits, params, output_ids, prompt_ids=None, *, eos_token_id=None, token_bitmask=None
) -> SamplerOutput:
    """One token per row, read back to the host: `sample_on_device(...).output()` (see it for the
    arguments, and the module docstring for the order of the steps)."""
    return sample_on_device(
        logits, params, output_ids, prompt_ids, eos_token_id=eos_token_id, token_bitmask=token_bitmask
    ).output()


def sample_on_device(
    logits: torch.Tensor,  # [B, V] float32
    params: Sequence[SamplingParams],
    output_ids: Sequence[Sequence[int]],  # each row's generated tokens so far
    prompt_ids: Sequence[Sequence[int]] | None = None,  # needed only for repetition_penalty
    *,
    eos_token_id: int | None = None,
    num_generated: Sequence[int] | None = None,
    token_bitmask: torch.Tensor | None = None,  # [B, W] int32 host: grammar masks (runner.token_mask)
) -> DeviceSample:
    """`sample()` without reading anything back: the tokens stay on the logits' device.

    `num_generated` (default: the lengths of `output_ids`) is each row's count of tokens generated
    before this one, which is all that `min_tokens` and a seed's stream need. A decode step
    launched before the previous step's tokens reach the host passes counts one above its
    `output_ids`; rows with penalties need the tokens themselves and must then not be passed.
    `token_bitmask` holds a grammar mask for each row whose params have `structured_outputs`
    (the other rows' words are ignored); required when any row has them.
    """
    b, v = logits.shape
    if len(params) != b or len(output_ids) != b:
        raise InputError(
            f"sample() got {b} rows of logits, {len(params)} params, {len(output_ids)} histories"
        )
    if num_generated is None:
        num_generated = [len(out) for out in output_ids]
    elif len(num_generated) != b:
        raise InputError(f"sample() got {b} rows of logits and {len(num_generated)} num_generated")
    for p, out, n in zip(params, output_ids, num_generated, strict=True):
        if p.has_penalties and n != len(out):
            raise InputError(
                f"a row with penalties needs its whole output history: num_generated={n}, "
                f"{len(out)} output ids"
            )
    dev = logits.device
    x = logits.float()
    raw_logprobs = None
    if any(p.logprobs is not None for p in params):
        raw_logprobs = torch.log_softmax(x, dim=-1)  # [B, V]

    masked = any(p.has_structured_output for p in params)
    if masked:
        if token_bitmask is None:
            raise InputError("a row with structured_outputs was sampled without its grammar mask")
        check_masks(token_bitmask, params, v)  # a row that no token satisfies fails alone
        x = apply_token_bitmask(x, token_bitmask, params)
    x = apply_logit_processors(x, params)

    # min_tokens: mask EOS and the stop tokens of rows that have not produced enough yet.
    rows, cols = [], []
    for r, (p, n) in enumerate(zip(params, num_generated, strict=True)):
        if n < p.min_tokens:
            banned = set(p.stop_token_ids)
            if eos_token_id is not None and not p.ignore_eos:
                banned.add(eos_token_id)
            banned = {t for t in banned if t < v}
            if len(banned) >= v:  # every token would be banned: min_tokens cannot hold, so no mask
                continue
            if p.allowed_token_ids is not None and banned.issuperset(p.allowed_token_ids):
                continue  # the same when every allowed token would be banned
            if p.has_structured_output and not mask_allows_beyond(token_bitmask[r], banned, v):
                continue  # and when the grammar allows nothing else (it must end now)
            rows += [r] * len(banned)
            cols += sorted(banned)
    if rows:
        x = x.index_put((on_device(dev, rows), on_device(dev, cols)), torch.full((), -math.inf, device=dev))

    pen = [r for r, p in enumerate(params) if p.has_penalties]
    if pen:
        if prompt_ids is None:
            prompt_ids = [[] for _ in range(b)]

        def col(name: str) -> torch.Tensor:
            return on_device(dev, [getattr(params[r], name) for r in pen], torch.float32)

        idx = on_device(dev, pen)
        x = x.clone() if x is logits else x
        x[idx] = apply_penalties(
            x[idx],
            [prompt_ids[r] for r in pen],
            [output_ids[r] for r in pen],
            col("repetition_penalty"),
            col("presence_penalty"),
            col("frequency_penalty"),
        )

    tokens = greedy_argmax(x)  # [B] greedy choice, replaced below for sampled rows
    hot = [r for r, p in enumerate(params) if not p.greedy]
    if hot:
        ps = [params[r] for r in hot]
        idx = on_device(dev, hot)
        temp = on_device(dev, [p.temperature for p in ps], torch.float32)
        y = x[idx]  # [b, V]
        y = (y - y.amax(dim=-1, keepdim=True)) / temp[:, None]  # the best token at 0, the rest <= 0
        if any(p.min_p > 0 for p in ps):
            y = apply_min_p(y, on_device(dev, [p.min_p for p in ps], torch.float32))
        top_k = top_p = None
        if any(p.top_k_enabled for p in ps):
            top_k = on_device(dev, [p.top_k if p.top_k_enabled else v for p in ps], torch.long)
        if any(p.top_p < 1.0 for p in ps):
            top_p = on_device(dev, [p.top_p for p in ps], torch.float32)
        y = apply_top_k_top_p(y, top_k, top_p)
        probs = y.softmax(dim=-1)  # [b, V]
        fresh = torch.randint(0, 2**62, (len(ps),)).tolist()  # global RNG, for rows without a seed
        seeds = [p.seed if p.seed is not None else f for p, f in zip(ps, fresh, strict=True)]
        steps = [num_generated[r] for r in hot]
        q = seeded_exponentials(seeds, steps, v, dev)  # [b, V]
        tokens = tokens.index_copy(0, idx, (probs / q).argmax(dim=-1))

    if raw_logprobs is None:
        return DeviceSample(tokens)
    want = [r for r, p in enumerate(params) if p.logprobs is not None]
    k = max(params[r].logprobs for r in want)
    idx = on_device(dev, want)
    chosen = raw_logprobs[idx].gather(1, tokens[idx][:, None])[:, 0]  # [R]
    top_v, top_i = raw_logprobs[idx].topk(k, dim=-1) if k else (None, None)  # [R, k]
    return DeviceSample(tokens, tuple(want), tuple(params[r].logprobs for r in want), chosen, top_i, top_v)
