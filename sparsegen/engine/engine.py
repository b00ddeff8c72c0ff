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

import itertools
import time
from collections.abc import Callable, Iterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from ..errors import EngineError, InputError
from ..models.batch import ForwardBatch
from ..models.memory import check_fits
from ..models.phi3small import Phi3SmallForCausalLM
from .checks import check_params, check_prompt, expand_params
from .config import KERNEL_PAGE_SIZES, EngineConfig
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
    request_id: int = -1  # the Sequence's seq_id: what `LLMEngine.abort` takes


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
        cfg.num_hidden_layers, page_size, model.local_num_kv_heads, cfg.head_dim, model.dtype
    )
    if kv_cache_bytes is None:
        if model.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(model.device)
            kv_cache_bytes = max(int(free * GPU_MEMORY_FRACTION) - GPU_HEADROOM_BYTES, 2 * per_page)
        else:
            kv_cache_bytes = CPU_KV_CACHE_BYTES
    pages = kv_cache_bytes // per_page
    if pages < 2:
        raise InputError(
            f"kv_cache_bytes={kv_cache_bytes} holds {pages} pages of {per_page} bytes; the cache needs at least 2"
        )
    return pages


class LLMEngine:
    """Continuous batching over a paged KV cache for one model. Not thread-safe: call every
    method from the thread that runs `step()` (a server hands requests to that thread).

    Submitting: `submit(prompts, params)` checks every prompt and parameter first and then
    queues them all (or none); it returns one `Sequence` per prompt, whose `seq_id` is the
    request id. `add_request(prompt, params)` does the same for one prompt.
    Running: `step()` runs one forward pass and returns the `TokenEvent`s it produced (each
    carries `request_id`); `stream()` and `generate()` drive `step()` until their own requests
    are done. Aborting: `abort(request_id)` drops a request and frees its pages at once; an
    exception (or a closed generator) out of `generate()`/`stream()` aborts that call's requests.
    """

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
        config = EngineConfig(
            page_size=page_size,
            num_pages=num_pages,
            kv_cache_bytes=kv_cache_bytes,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            use_cuda_graphs=use_cuda_graphs,
        )
        if not isinstance(model, Phi3SmallForCausalLM):
            raise InputError(f"model must be a Phi3SmallForCausalLM, got {type(model).__name__}")
        cfg = model.config
        if max_model_len is not None and max_model_len > cfg.max_position_embeddings:
            raise InputError(
                f"max_model_len={max_model_len} exceeds the model's max_position_embeddings "
                f"({cfg.max_position_embeddings})"
            )
        kernel_decode = model.device.type == "cuda" and model.attn_impl != "reference"
        if kernel_decode and page_size not in KERNEL_PAGE_SIZES:
            raise InputError(
                f"page_size must be in {KERNEL_PAGE_SIZES.start}..{KERNEL_PAGE_SIZES.stop - 1} for the compiled "
                f"decode kernel, got {page_size}"
            )
        self.config = config
        self.model = model
        self.tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_token_id if tokenizer is not None else cfg.eos_token_id
        self.max_model_len = max_model_len or cfg.max_position_embeddings
        pages = num_pages or _default_num_pages(model, page_size, kv_cache_bytes)
        per_page = KVCache.bytes_per_page(
            cfg.num_hidden_layers, page_size, model.local_num_kv_heads, cfg.head_dim, model.dtype
        )
        check_fits(pages * per_page, model.device, f"a KV cache of {pages} pages of {page_size} tokens")
        self.cache = KVCache(
            num_layers=cfg.num_hidden_layers,
            num_pages=pages,
            page_size=page_size,
            num_kv_heads=model.local_num_kv_heads,  # a tensor-parallel rank holds its own groups only
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
        self._live: dict[int, Sequence] = {}  # seq_id -> unfinished sequence
        self._ids = itertools.count()
        self.graphs = None
        if use_cuda_graphs and model.device.type == "cuda":
            from .cuda_graphs import DecodeGraphs

            self.graphs = DecodeGraphs(model, self.cache, max_num_seqs, self.max_model_len)

    # -- requests -------------------------------------------------------------------------
    def _checked(self, prompt: object, params: object, where: str) -> tuple[list[int], SamplingParams]:
        vocab = self.model.config.vocab_size
        ids = check_prompt(prompt, vocab, where)
        params = check_params(params, vocab, f"params of {where}")
        self.scheduler.check(len(ids), params.max_tokens, where)
        return ids, params

    def _enqueue(self, ids: list[int], params: SamplingParams, index: int | None) -> Sequence:
        seq = Sequence(next(self._ids), ids, params)
        self._index[seq.seq_id] = seq.seq_id if index is None else index
        self._live[seq.seq_id] = seq
        self.scheduler.add(seq)
        return seq

    def add_request(
        self, prompt_ids: list[int], params: SamplingParams, index: int | None = None
    ) -> Sequence:
        """Check and queue one request; its events carry `index` (default: its seq_id)."""
        ids, params = self._checked(prompt_ids, params, "prompt")
        return self._enqueue(ids, params, index)

    def submit(self, prompts: Seq[list[int]], params: SamplingParams | Seq[SamplingParams]) -> list[Sequence]:
        """Check every prompt and parameter, then queue them all (index = position in `prompts`).
        Raises before queueing anything if any one is bad."""
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Seq):
            raise InputError(f"prompts must be a list of token-id lists, got {type(prompts).__name__}")
        if not prompts:
            raise InputError("prompts is empty")
        checked = [
            self._checked(p, sp, f"prompt {i}")
            for i, (p, sp) in enumerate(zip(prompts, expand_params(params, len(prompts)), strict=True))
        ]
        return [self._enqueue(ids, sp, index=i) for i, (ids, sp) in enumerate(checked)]

    def abort(self, request_id: int) -> bool:
        """Drop an unfinished request (queued or running) and free its pages now. Returns False
        if there is no such unfinished request (unknown, finished or already aborted)."""
        seq = self._live.pop(request_id, None) if isinstance(request_id, int) else None
        if seq is None:
            return False
        self._index.pop(request_id, None)
        return self.scheduler.abort(seq)

    def _abort_unfinished(self, seqs: Seq[Sequence]) -> None:
        for seq in seqs:
            if seq.finish_reason is None:
                self.abort(seq.seq_id)

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
            events.append(
                TokenEvent(self._index[seq.seq_id], token, reason, logprobs=logprobs, request_id=seq.seq_id)
            )
            if reason is not None:
                self.scheduler.finish(seq, reason)
                del self._index[seq.seq_id]
                del self._live[seq.seq_id]
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
        """Submit the prompts (indexed in order) and yield each of their new tokens until all are
        done. Other requests in the engine advance too, but their events are not yielded. If the
        caller stops early (closes the generator) or anything raises, this call's unfinished
        requests are aborted and their pages freed."""
        seqs = self.submit(prompts, params)
        mine = {s.seq_id for s in seqs}
        try:
            while self.has_unfinished and any(s.finish_reason is None for s in seqs):
                for event in self.step():
                    if event.request_id in mine:
                        yield event
        finally:
            self._abort_unfinished(seqs)

    def generate(
        self,
        prompts: Seq[list[int]],
        params: SamplingParams | Seq[SamplingParams],
        on_token: Callable[[TokenEvent], None] | None = None,
    ) -> list[GenerationResult]:
        """Run prompts to completion; results in input order. `on_token` sees each of their new
        tokens. Any exception (from the model or from `on_token`) aborts this call's requests,
        frees their pages, and propagates."""
        if on_token is not None and not callable(on_token):
            raise InputError(f"on_token must be callable, got {type(on_token).__name__}")
        seqs = self.submit(prompts, params)
        mine = {s.seq_id for s in seqs}
        try:
            while self.has_unfinished and any(s.finish_reason is None for s in seqs):
                for event in self.step():
                    if on_token is not None and event.request_id in mine:
                        on_token(event)
        finally:
            self._abort_unfinished(seqs)
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
