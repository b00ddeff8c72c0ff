"""The decoding loop: `LLMEngine` turns prompts into tokens over a paged KV cache.

    engine = LLMEngine(model, tokenizer=tok)
    for event in engine.stream([[1, 2, 3]], SamplingParams(max_tokens=32)):
        print(event.index, event.token_id, event.finish_reason)
    outputs = engine.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=32))  # RequestOutputs

Each `step()` asks the `Scheduler` for a plan (one prefill or one decode forward) and hands it
to the engine's executor (`engine.executor`), which runs the forward pass (on a GPU, decode
steps replay CUDA graphs; `use_cuda_graphs=False` turns that off) and samples the rows that
reached the end of their sequence; the tokens go back to `Scheduler.postprocess`. The executor
is this process's `ModelRunner`, or with `tensor_parallel_size=N` the driver of N rank
processes that each run one over a shard of the model (`parallel.executor`); nothing else in the
engine changes. With `async_decode` (the default) a decode step's successor is launched before
its tokens are read back, so the host's work overlaps the GPU's (`runner.inflight`; greedy and
seeded tokens are the same as with `async_decode=False`). Requests may be added between steps:
they join the batch as others finish. The engine itself builds each `Sequence` and keeps the
request index of each. `stream()` and `generate()` drive `step()` through the one output
path (`engine.output_processor`), which also turns tokens into text and outputs.

    engine = LLMEngine(ModelSource(random="tiny"), tensor_parallel_size=2, device="cpu")
    with engine:  # close() stops the ranks
        results = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=8))
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from collections.abc import Sequence as Seq
from contextlib import closing
from dataclasses import dataclass, field, replace

from ..errors import EngineError, InputError, RequestFailedError
from ..models.phi3small import Phi3SmallForCausalLM
from ..parallel.source import ModelSource
from ..request.sampling_params import SamplingParams, TokenLogprobs
from ..request.sequence import Sequence
from ..runner.config import KERNEL_PAGE_SIZES, PREFILL_CHUNK_TOKENS, EngineConfig
from ..runner.inflight import InFlight, overlappable
from ..runner.model_runner import ModelRunner
from .checks import check_params, check_prompt, expand_params
from .executor import model_facts, open_executor
from .output_processor import run_prompts, track_prompts
from .outputs import RequestOutput
from .prefix_cache import cache_salt
from .prompt_scores import book_prompt_logprobs, first_prompt_logprobs
from .scheduler import Plan, Scheduler
from .structured_output import StructuredOutputs, copies


@dataclass(frozen=True)
class TokenEvent:
    """One new token of request `index` (the order requests were given in), or its failure:
    finish_reason "error" with `error` set (and token_id -1) when the request failed inside a
    step; its pages are freed and the other requests of the step go on."""

    index: int
    token_id: int
    finish_reason: str | None  # set on the request's last token
    logprobs: TokenLogprobs | None = None  # when the request's SamplingParams.logprobs is set
    request_id: int = -1  # the Sequence's seq_id: what `LLMEngine.abort` takes
    error: RequestFailedError | None = None  # why the request failed (finish_reason "error")
    num_cached_tokens: int = 0  # prompt tokens the request found in the prefix cache
    # on a request's first token, when its SamplingParams.prompt_logprobs is set: one entry per
    # prompt token, the first None
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None
    # when the request first joined the batch (time.perf_counter; a timing, not compared)
    t_scheduled: float | None = field(default=None, compare=False)


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

    `model` is a model in this process, or a `ModelSource` that the engine builds here, or in
    `tensor_parallel_size` rank processes (one GPU each) on `device`'s type. `close()` (or a
    `with` block) stops the ranks; it does nothing for a model in this process.
    """

    def __init__(
        self,
        model: Phi3SmallForCausalLM | ModelSource,
        *,
        tokenizer=None,
        device=None,
        page_size: int = 16,
        num_pages: int | None = None,
        kv_cache_bytes: int | None = None,
        max_num_seqs: int = 32,
        max_num_batched_tokens: int = PREFILL_CHUNK_TOKENS,
        max_model_len: int | None = None,
        use_cuda_graphs: bool = True,
        compile_model: bool = False,
        async_decode: bool = True,
        kv_layout: str = "head",
        kv_cache_dtype: str = "auto",
        tensor_parallel_size: int = 1,
        collective_timeout_s: float | None = None,
        enable_prefix_caching: bool = True,
        dense_attention: bool = False,
        gpu_memory_utilization: float | None = None,
    ):
        config = EngineConfig(
            page_size=page_size,
            num_pages=num_pages,
            kv_cache_bytes=kv_cache_bytes,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            use_cuda_graphs=use_cuda_graphs,
            compile_model=compile_model,
            async_decode=async_decode,
            kv_layout=kv_layout,
            kv_cache_dtype=kv_cache_dtype,
            tensor_parallel_size=tensor_parallel_size,
            collective_timeout_s=collective_timeout_s,
            enable_prefix_caching=enable_prefix_caching,
            dense_attention=dense_attention,
            gpu_memory_utilization=gpu_memory_utilization,
        )
        facts = model_facts(model, config, device)  # reads nothing but a config.json
        cfg = self.model_config = facts.config
        if max_model_len is not None and max_model_len > cfg.max_position_embeddings:
            raise InputError(
                f"max_model_len={max_model_len} exceeds the model's max_position_embeddings "
                f"({cfg.max_position_embeddings})"
            )
        kernel_decode = facts.device.type == "cuda" and facts.attn_impl != "reference"
        if kernel_decode and page_size not in KERNEL_PAGE_SIZES:
            raise InputError(
                f"page_size must be in {KERNEL_PAGE_SIZES.start}..{KERNEL_PAGE_SIZES.stop - 1} for the compiled "
                f"decode kernel, got {page_size}"
            )
        self.config = config
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len or cfg.max_position_embeddings
        self.executor = open_executor(model, facts, config, self.max_model_len)
        # the model and its runner when they are in this process (None with tensor parallelism)
        self.runner = self.executor if isinstance(self.executor, ModelRunner) else None
        self.model: Phi3SmallForCausalLM | None = self.runner.model if self.runner is not None else None
        self.cache = self.executor.cache  # the pages the scheduler hands out
        self.scheduler = Scheduler(
            self.cache,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=self.max_model_len,
            eos_token_id=tokenizer.eos_token_id if tokenizer is not None else cfg.eos_token_id,
            prefix_caching=config.enable_prefix_caching,
            cache_salt=self._cache_salt(model),
            long_rope_after=cfg.rope_scaling.original_max_position_embeddings if cfg.rope_scaling else None,
        )
        self._index: dict[int, int] = {}  # seq_id -> request index
        self._live: dict[int, Sequence] = {}  # seq_id -> unfinished sequence
        self._ids = itertools.count()
        self._inflight: InFlight | None = None  # a launched step not yet booked (async_decode)
        # grammar matchers of constrained requests (SamplingParams.structured_outputs)
        self.structured = StructuredOutputs(lambda: self.tokenizer, cfg.vocab_size, lambda: self.eos_token_id)

    def _cache_salt(self, model) -> bytes:
        """What, besides the tokens, decides a KV page's content: the cache's dtype (fp8 pages
        never hit bf16 ones) and the page size."""
        pools = getattr(self.cache, "k", None)
        kv_dtype = pools[0].dtype if pools else getattr(model, "dtype", None)
        facts = {"kv_dtype": kv_dtype, "page_size": self.cache.page_size}
        facts["kv_cache_dtype"] = getattr(self.config, "kv_cache_dtype", None)
        return cache_salt(**facts)

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (pages held by running sequences keep theirs); returns how
        many cached pages were dropped."""
        return self.cache.allocator.reset_prefix_cache()

    @property
    def eos_token_id(self) -> int | None:
        return self.scheduler.eos_token_id

    @eos_token_id.setter
    def eos_token_id(self, value: int | None) -> None:
        self.scheduler.eos_token_id = value

    @property
    def graphs(self):
        """The runner's CUDA graphs of decode steps (None on a CPU, with use_cuda_graphs=False, or
        when the model runs in tensor-parallel ranks)."""
        return self.runner.graphs if self.runner is not None else None

    @property
    def kv_capacity(self) -> tuple[int, int]:
        """(pages, tokens) of KV cache that sequences can hold at once."""
        pages = self.cache.allocator.capacity
        return pages, pages * self.cache.page_size

    def close(self, kill: bool = False) -> None:
        """Stop the executor's rank processes (`kill`: without waiting for them); the engine
        cannot step after it. Nothing to stop for a model in this process."""
        self.executor.close(kill)

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close(kill=exc[0] is not None)

    # -- requests -------------------------------------------------------------------------
    def _checked(self, prompt: object, params: object, where: str) -> tuple[list[int], SamplingParams]:
        vocab = self.model_config.vocab_size
        ids = check_prompt(prompt, vocab, where)
        params = check_params(params, vocab, f"params of {where}")
        self.scheduler.check(len(ids), params.max_tokens, where)
        return ids, params

    def _enqueue(self, ids: list[int], params: SamplingParams, index: int | None, matcher=None) -> Sequence:
        seq = Sequence(next(self._ids), ids, params)
        self._index[seq.seq_id] = seq.seq_id if index is None else index
        self._live[seq.seq_id] = seq
        if matcher is not None:
            self.structured.add(seq.seq_id, matcher)
        self.scheduler.add(seq)
        return seq

    def add_request(
        self, prompt_ids: list[int], params: SamplingParams, index: int | None = None
    ) -> Sequence:
        """Check and queue one request; its events carry `index` (default: its seq_id)."""
        if index is not None and (isinstance(index, bool) or not isinstance(index, int)):
            raise InputError(f"index must be None or an int, got {index!r}")
        ids, params = self._checked(prompt_ids, params, "prompt")
        (matcher,) = copies(self.structured, [params])
        return self._enqueue(ids, params, index, matcher)

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
        matchers = copies(
            self.structured, [sp for _, sp in checked]
        )  # every grammar compiles, or none queues
        return [
            self._enqueue(ids, sp, i, m)
            for i, ((ids, sp), m) in enumerate(zip(checked, matchers, strict=True))
        ]

    def abort(self, request_id: int) -> bool:
        """Drop an unfinished request (queued or running) and free its pages now. Returns False
        if there is no such unfinished request (unknown, finished or already aborted)."""
        seq = self._live.pop(request_id, None) if isinstance(request_id, int) else None
        if seq is None:
            return False
        self._index.pop(request_id, None)
        self.structured.drop(request_id)
        return self.scheduler.abort(seq)

    @property
    def has_unfinished(self) -> bool:
        return not self.scheduler.idle

    # -- one step ---------------------------------------------------------------------------
    def _launch(self, plan: Plan, after: InFlight | None = None) -> InFlight:
        """Hand `plan` to the executor: its forward pass and sampler run without the tokens being
        read back. `after` is the in-flight step whose sampled tokens are `plan`'s input ids (a
        lookahead plan). Constrained rows get their grammar masks here (never in a lookahead
        plan: `overlappable` keeps them out)."""
        if after is None and len(self.structured):
            plan = replace(plan, token_bitmask=self.structured.bitmask(plan.sampled))
        return self.executor.launch(plan, after, self.eos_token_id)

    def _fail(self, seq: Sequence, why: str) -> TokenEvent | None:
        """End `seq` (its sampling failed) and free its pages; its error event, if it was live."""
        index = self._index.get(seq.seq_id, seq.seq_id)
        why = self.structured.error_of(seq.seq_id) or why
        if not self.abort(seq.seq_id):
            return None
        seq.finish_reason = "error"
        exc = RequestFailedError(f"request {seq.seq_id} failed inside a step: {why}")
        return TokenEvent(index, -1, "error", request_id=seq.seq_id, error=exc)

    def _complete(self, done: InFlight) -> list[TokenEvent]:
        """Read `done`'s tokens and book them. Rows whose sequence ended while the step was in
        flight (it finished at the step before, or was aborted) are dropped: their token is
        never emitted, and their pages were freed when they ended."""
        out = done.output()
        plan, now = done.plan, time.perf_counter()
        book_prompt_logprobs(plan, out.prompt_logprobs)
        failures = [self._fail(plan.sampled[row], why) for row, why in out.failed]  # before booking
        keep = [i for i, s in enumerate(plan.sampled) if s.finish_reason is None]
        live = tuple(c for c in plan.chunks if c.seq.finish_reason is None)
        sampled = [plan.sampled[i] for i in keep]
        tokens = [out.token_ids[i] for i in keep]
        reasons = self.scheduler.postprocess(replace(plan, chunks=live, input_ids=None), tokens, now)
        events = []
        for seq, token, i, reason in zip(sampled, tokens, keep, reasons, strict=True):
            if seq.seq_id in self.structured:  # its grammar takes the token (or fails it alone)
                reason, why = self.structured.book(seq, token, reason, self.scheduler.finish)
                if why is not None:
                    failures.append(self._fail(seq, why))
                    continue
            events.append(
                TokenEvent(
                    self._index[seq.seq_id],
                    token,
                    reason,
                    logprobs=out.logprobs[i],
                    request_id=seq.seq_id,
                    num_cached_tokens=seq.num_cached_tokens or 0,
                    prompt_logprobs=first_prompt_logprobs(seq),
                    t_scheduled=seq.t_scheduled,
                )
            )
            if reason is not None:
                del self._index[seq.seq_id]
                del self._live[seq.seq_id]
        return events + [e for e in failures if e is not None]

    def step(self) -> list[TokenEvent]:
        """Run one step and return the tokens it produced (possibly none).

        With `async_decode`, a decode step is launched before the previous one's tokens are
        read, where that is exact (see `runner.inflight`): a call launches the next decode step,
        then reads and books the step in flight and returns its events. Each call still returns
        one step's tokens; at most one step is left in flight between calls."""
        if self._inflight is None:
            plan = self.scheduler.schedule()
            if plan is None:
                return []
            self._inflight = self._launch(plan)
        done, self._inflight = self._inflight, None
        if self.config.async_decode and overlappable(done.plan):
            nxt = self.scheduler.schedule_lookahead(done.plan)
            if nxt is not None:
                self._inflight = self._launch(nxt, after=done)
        try:
            return self._complete(done)
        except BaseException:
            # the launched step assumed `done`'s tokens booked; without them it is dropped too
            # (its sequences are as before it: the next step recomputes the same position)
            self._inflight = None
            raise

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
        requests are aborted and their pages freed. Stop strings end a sequence when the engine
        has a tokenizer (`engine.output_processor`)."""
        seqs = self.submit(prompts, params)
        processor, requests = track_prompts(self, prompts, params, seqs)
        with closing(processor.stream(requests)) as steps:
            for event, _, _ in steps:
                yield event

    def generate(
        self,
        prompts: Seq[list[int]],
        params: SamplingParams | Seq[SamplingParams],
        on_token: Callable[[TokenEvent], None] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion; one `RequestOutput` per prompt, in input order (its text
        decoded with the engine's tokenizer, None without one). `on_token` sees each of their new
        tokens. Any exception (from the model or from `on_token`) aborts this call's requests,
        frees their pages, and propagates."""
        if on_token is not None and not callable(on_token):
            raise InputError(f"on_token must be callable, got {type(on_token).__name__}")
        return run_prompts(self, prompts, params, on_token)
