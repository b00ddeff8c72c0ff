"""The decoding loop: `LLMEngine` turns prompts into tokens over a paged KV cache.

    engine = LLMEngine(model, tokenizer=tok)
    for event in engine.stream([[1, 2, 3]], SamplingParams(max_tokens=32)):
        print(event.index, event.token_id, event.finish_reason)
    results = engine.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=32))

Each `step()` runs one prefill or one decode forward (see `scheduler.py`) and samples the rows
that reached the end of their sequence. Requests may be added between steps: they join the
batch as others finish. On a GPU, decode steps replay CUDA graphs (`use_cuda_graphs=False`
turns that off).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from ..errors import EngineError, InputError
from ..models.batch import ForwardBatch
from ..models.phi3small import Phi3SmallForCausalLM
from .kv_cache import KVCache
from .sampling import SamplingParams, TokenLogprobs, sample
from .scheduler import Chunk, Plan, Scheduler, Sequence

CPU_KV_CACHE_BYTES = 256 << 20
GPU_MEMORY_FRACTION = 0.9
GPU_HEADROOM_BYTES = 6 << 30  # activations of a prefill chunk, logits, graphs


@dataclass(frozen=True)
class TokenEvent:
    """One new token of request `index` (the order requests were given in)."""

    index: int
    token_id: int
    finish_reason: str | None  # set on the request's last token
    logprobs: TokenLogprobs | None = None  # when the request's SamplingParams.logprobs is set


@dataclass(frozen=True)
class GenerationResult:
    prompt_ids: list[int]
    output_ids: list[int]  # includes the EOS / stop token that ended it, if any
    finish_reason: str  # "eos" | "stop" | "length"
    ttft_s: float
    decode_tokens_per_s: float
    text: str | None = None  # output decoded without its final EOS / stop token

    def to_json_dict(self) -> dict:
        return {
            "prompt_ids": self.prompt_ids,
            "output_ids": self.output_ids,
            "text": self.text,
            "finish_reason": self.finish_reason,
            "ttft_s": self.ttft_s,
            "decode_tokens_per_s": self.decode_tokens_per_s,
        }


def _default_num_pages(model: Phi3SmallForCausalLM, page_size: int, kv_cache_bytes: int | None) -> int:
    cfg = model.config
    per_page = KVCache.bytes_per_page(
        cfg.num_hidden_layers, page_size, cfg.num_key_value_heads, cfg.head_dim, model.dtype
    )
    if kv_cache_bytes is None:
        if model.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(model.device)
            kv_cache_bytes = max(int(free * GPU_MEMORY_FRACTION) - GPU_HEADROOM_BYTES, 2 * per_page)
        else:
            kv_cache_bytes = CPU_KV_CACHE_BYTES
    return max(2, kv_cache_bytes // per_page)


class LLMEngine:
    def __init__(
        self,
        model: Phi3SmallForCausalLM,
        *,
        tokenizer=None,
        page_size: int = 16,
        num_pages: int | None = None,
        kv_cache_bytes: int | None = None,
        max_num_seqs: int = 32,
        max_num_batched_tokens: int = 8192,
        max_model_len: int | None = None,
        use_cuda_graphs: bool = True,
    ):
        cfg = model.config
        self.model = model
        self.tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_token_id if tokenizer is not None else cfg.eos_token_id
        self.max_model_len = min(max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        self.cache = KVCache(
            num_layers=cfg.num_hidden_layers,
            num_pages=num_pages or _default_num_pages(model, page_size, kv_cache_bytes),
            page_size=page_size,
            num_kv_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim,
            dtype=model.dtype,
            device=model.device,
        )
        self.scheduler = Scheduler(
            self.cache,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=self.max_model_len,
        )
        rs = cfg.rope_scaling
        self._long_rope_after = rs.original_max_position_embeddings if rs is not None else None
        self._index: dict[int, int] = {}  # seq_id -> request index
        self.graphs = None
        if use_cuda_graphs and model.device.type == "cuda":
            from .cuda_graphs import DecodeGraphs

            self.graphs = DecodeGraphs(model, self.cache, max_num_seqs, self.max_model_len)

    # -- requests -------------------------------------------------------------------------
    def add_request(
        self, prompt_ids: list[int], params: SamplingParams, index: int | None = None
    ) -> Sequence:
        vocab = self.model.config.vocab_size
        bad = [t for t in prompt_ids if not (isinstance(t, int) and 0 <= t < vocab)]
        if bad:
            raise InputError(f"prompt token {bad[0]!r} is not an id of the vocabulary 0..{vocab - 1}")
        seq = self.scheduler.add(list(prompt_ids), params)
        self._index[seq.seq_id] = seq.seq_id if index is None else index
        return seq

    @property
    def has_unfinished(self) -> bool:
        return not self.scheduler.idle

    # -- one step ---------------------------------------------------------------------------
    def _use_long(self, seq: Sequence, start: int, stop: int) -> list[bool]:
        """LongRoPE factor choice per position, as HF makes it: prompt tokens by the prompt's
        length, each generated token by the length reached with it (chunking cannot change it)."""
        limit = self._long_rope_after
        n_prompt = len(seq.prompt_ids)
        return [max(n_prompt, p + 1) > limit for p in range(start, stop)]

    def _prefill_batch(self, chunks: Seq[Chunk]) -> tuple[torch.Tensor, ForwardBatch]:
        dev = self.model.device
        ids, positions, slots, gather, use_long, last_rows = [], [], [], [], [], []
        cu_q, cu_k = [0], [0]
        has_prefix = any(c.start > 0 for c in chunks)
        for c in chunks:
            ids += c.seq.tokens[c.start : c.stop]
            positions.append(torch.arange(c.start, c.stop))
            slots.append(self.cache.slots(c.seq.pages, c.start, c.stop))
            if has_prefix:
                gather.append(self.cache.slots(c.seq.pages, 0, c.stop))
            if self._long_rope_after is not None:
                use_long += self._use_long(c.seq, c.start, c.stop)
            cu_q.append(cu_q[-1] + c.stop - c.start)
            cu_k.append(cu_k[-1] + c.stop)
            if c.completes:
                last_rows.append(cu_q[-1] - 1)

        def t(x, dtype=torch.long):
            return torch.tensor(x, dtype=dtype).to(dev, non_blocking=True)

        batch = ForwardBatch(
            is_decode=False,
            positions=torch.cat(positions).to(dev),  # [T]
            use_long_rope=t(use_long, torch.bool) if self._long_rope_after is not None else None,
            logits_index=t(last_rows),  # [rows sampled]
            cu_seqlens_q=t(cu_q, torch.int32),  # [B+1]
            cu_seqlens_k=t(cu_k, torch.int32),  # [B+1]
            kv_gather=torch.cat(gather).to(dev) if has_prefix else None,  # [Tk]
            slot_mapping=torch.cat(slots).to(dev),  # [T]
        )
        return t(ids), batch

    def _decode_batch(self, chunks: Seq[Chunk]) -> tuple[torch.Tensor, ForwardBatch]:
        dev = self.model.device
        seqs = [c.seq for c in chunks]
        width = max(len(s.pages) for s in seqs)
        tables = [s.pages + [self.cache.scratch_page] * (width - len(s.pages)) for s in seqs]
        positions = [len(s) - 1 for s in seqs]
        ps = self.cache.page_size
        use_long = None
        if self._long_rope_after is not None:
            flags = [self._use_long(s, p, p + 1)[0] for s, p in zip(seqs, positions, strict=True)]
            use_long = torch.tensor(flags, device=dev)
        batch = ForwardBatch(
            is_decode=True,
            positions=torch.tensor(positions, dtype=torch.long, device=dev),  # [B]
            use_long_rope=use_long,
            slot_mapping=torch.tensor(
                [s.pages[p // ps] * ps + p % ps for s, p in zip(seqs, positions, strict=True)], device=dev
            ),  # [B]
            block_tables=torch.tensor(tables, dtype=torch.int32, device=dev),  # [B, max_pages]
            seq_lens=torch.tensor([len(s) for s in seqs], dtype=torch.int32, device=dev),  # [B]
        )
        ids = torch.tensor([s.tokens[-1] for s in seqs], dtype=torch.long, device=dev)
        return ids, batch

    @torch.inference_mode()
    def _forward(self, plan: Plan) -> torch.Tensor:  # [rows sampled, vocab] float32
        if plan.is_decode:
            ids, batch = self._decode_batch(plan.chunks)
            if self.graphs is not None and self.graphs.fits(len(plan.chunks)):
                return self.graphs.run(ids, batch)
        else:
            ids, batch = self._prefill_batch(plan.chunks)
        return self.model(ids, batch, self.cache.layers)

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if token == self.eos_token_id and not p.ignore_eos:
            return "eos"
        if token in p.stop_token_ids:
            return "stop"
        if len(seq.output_ids) >= p.max_tokens or len(seq) >= self.max_model_len:
            return "length"
        return None

    def step(self) -> list[TokenEvent]:
        """Run one forward pass; returns the tokens it produced (possibly none)."""
        plan = self.scheduler.schedule()
        if plan is None:
            return []
        logits = self._forward(plan)
        for c in plan.chunks:
            c.seq.num_cached = c.stop
        sampled = [c.seq for c in plan.chunks if c.completes]
        if not sampled:
            return []
        out = sample(
            logits,
            [s.params for s in sampled],
            [s.output_ids for s in sampled],
            [s.prompt_ids for s in sampled],
            eos_token_id=self.eos_token_id,
        )
        now = time.perf_counter()
        events = []
        for seq, token, logprobs in zip(sampled, out.token_ids, out.logprobs, strict=True):
            seq.output_ids.append(token)
            if seq.t_first_token is None:
                seq.t_first_token = now
            seq.t_last_token = now
            reason = self._finish_reason(seq, token)
            events.append(TokenEvent(self._index[seq.seq_id], token, reason, logprobs=logprobs))
            if reason is not None:
                self.scheduler.finish(seq, reason)
                del self._index[seq.seq_id]
        return events

    def warmup(self) -> float:
        """Run one two-token request now, so that kernel builds, library set-up and the first
        CUDA-graph capture happen before any timed request; returns the seconds it took. The
        engine is left as it was (no request pending, every page free)."""
        if self.has_unfinished:
            raise EngineError("warmup() needs an idle engine: requests are pending")
        start = time.perf_counter()
        self.generate([[0]], SamplingParams(max_tokens=2, ignore_eos=True))
        return time.perf_counter() - start

    # -- whole requests -------------------------------------------------------------------------
    def stream(
        self, prompts: Seq[list[int]], params: SamplingParams | Seq[SamplingParams]
    ) -> Iterator[TokenEvent]:
        """Add the prompts (indexed in order) and yield every new token until all are done."""
        self.submit(prompts, params)
        while self.has_unfinished:
            yield from self.step()

    def submit(self, prompts: Seq[list[int]], params: SamplingParams | Seq[SamplingParams]) -> list[Sequence]:
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise InputError(f"got {len(prompts)} prompts but {len(params)} SamplingParams")
        return [
            self.add_request(p, sp, index=i) for i, (p, sp) in enumerate(zip(prompts, params, strict=True))
        ]

    def generate(
        self,
        prompts: Seq[list[int]],
        params: SamplingParams | Seq[SamplingParams],
        on_token: Callable[[TokenEvent], None] | None = None,
    ) -> list[GenerationResult]:
        """Run prompts to completion; results in input order. `on_token` sees every new token."""
        seqs = self.submit(prompts, params)
        while self.has_unfinished:
            for event in self.step():
                if on_token is not None:
                    on_token(event)
        return [self.result(s) for s in seqs]

    def result(self, seq: Sequence) -> GenerationResult:
        out = seq.output_ids
        n_decode = len(out) - 1
        span = (seq.t_last_token or 0.0) - (seq.t_first_token or 0.0)
        text = None
        if self.tokenizer is not None:
            shown = out[:-1] if seq.finish_reason in ("eos", "stop") else out
            text = self.tokenizer.decode(shown)
        return GenerationResult(
            prompt_ids=list(seq.prompt_ids),
            output_ids=list(out),
            finish_reason=seq.finish_reason or "length",
            ttft_s=(seq.t_first_token or seq.t_submit) - seq.t_submit,
            decode_tokens_per_s=n_decode / span if n_decode > 0 and span > 0 else 0.0,
            text=text,
        )
