"""The decoding loop: `LLMEngine` turns prompts into tokens over a paged KV cache.

    engine = LLMEngine(model, tokenizer=tok)
    for event in engine.stream([[1, 2, 3]], SamplingParams(max_tokens=32)):
        print(event.index, event.token_id, event.finish_reason)
    results = engine.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=32))

Each `step()` asks the `Scheduler` for a plan (one prefill or one decode forward), has the
`ModelRunner` run it (on a GPU, decode steps replay CUDA graphs; `use_cuda_graphs=False` turns
that off), samples the rows that reached the end of their sequence, and hands the tokens back
to `Scheduler.postprocess`. With `async_decode` (the default) a decode step's successor is
launched before its tokens are read back, so the host's work overlaps the GPU's
(`engine.inflight`; greedy and seeded tokens are the same as with `async_decode=False`).
Requests may be added between steps: they join the batch as others finish. The engine itself
builds each `Sequence` and keeps the request index of each.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass, replace

import torch

from ..errors import EngineError, InputError, RequestFailedError
from ..models.phi3small import Phi3SmallForCausalLM
from .checks import check_params, check_prompt, expand_params
from .config import KERNEL_PAGE_SIZES, PREFILL_CHUNK_TOKENS, EngineConfig
from .inflight import InFlight, overlappable
from .isolation import sample_isolating
from .model_runner import ModelRunner
from .sampling import SamplingParams, TokenLogprobs
from .scheduler import Plan, Scheduler
from .sequence import Sequence


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
        max_num_batched_tokens: int = PREFILL_CHUNK_TOKENS,
        max_model_len: int | None = None,
        use_cuda_graphs: bool = True,
        compile_model: bool = False,
        async_decode: bool = True,
        kv_layout: str = "head",
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
        self.max_model_len = max_model_len or cfg.max_position_embeddings
        self.runner = ModelRunner(model, config, max_model_len=self.max_model_len)
        self.cache = self.runner.cache
        self.scheduler = Scheduler(
            self.cache,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=self.max_model_len,
            eos_token_id=tokenizer.eos_token_id if tokenizer is not None else cfg.eos_token_id,
        )
        self._index: dict[int, int] = {}  # seq_id -> request index
        self._live: dict[int, Sequence] = {}  # seq_id -> unfinished sequence
        self._ids = itertools.count()
        self._inflight: InFlight | None = None  # a launched step not yet booked (async_decode)

    @property
    def eos_token_id(self) -> int | None:
        return self.scheduler.eos_token_id

    @eos_token_id.setter
    def eos_token_id(self, value: int | None) -> None:
        self.scheduler.eos_token_id = value

    @property
    def graphs(self):
        """The runner's CUDA graphs of decode steps (None on a CPU or with use_cuda_graphs=False)."""
        return self.runner.graphs

    @property
    def kv_capacity(self) -> tuple[int, int]:
        """(pages, tokens) of KV cache that sequences can hold at once."""
        return self.runner.kv_capacity

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
        if index is not None and (isinstance(index, bool) or not isinstance(index, int)):
            raise InputError(f"index must be None or an int, got {index!r}")
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
    def _forward(self, plan: Plan) -> torch.Tensor:  # [len(plan.sampled), vocab] float32
        return self.runner.run(plan)

    @torch.inference_mode()
    def _launch(self, plan: Plan, after: InFlight | None = None) -> InFlight:
        """Run `plan`'s forward pass and sampler without reading the tokens back. `after` is the
        in-flight step whose sampled tokens are `plan`'s input ids (a lookahead plan). The sampler
        runs in inference mode too, so that those ids are inference tensors like the ids a
        synchronous step builds (torch.compile would otherwise guard on the difference and
        recompile)."""
        if after is not None:
            plan = replace(plan, input_ids=after.tokens)
        logits = self._forward(plan)
        seqs = plan.sampled
        if not seqs:
            return InFlight(plan, None, None)
        ahead = 1 if plan.lookahead else 0  # a lookahead row's previous token is not booked yet
        out = sample_isolating(  # a row whose sampling fails is named in out.failed, not raised
            logits,
            [s.params for s in seqs],
            [s.output_ids for s in seqs],
            [s.prompt_ids for s in seqs],
            eos_token_id=self.eos_token_id,
            num_generated=[len(s.output_ids) + ahead for s in seqs],
        )
        return InFlight(plan, out.token_ids, out.to_host())

    def _fail(self, seq: Sequence, why: str) -> TokenEvent | None:
        """End `seq` (its sampling failed) and free its pages; its error event, if it was live."""
        index = self._index.get(seq.seq_id, seq.seq_id)
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
        failures = [self._fail(plan.sampled[row], why) for row, why in out.failed]  # before booking
        keep = [i for i, s in enumerate(plan.sampled) if s.finish_reason is None]
        live = tuple(c for c in plan.chunks if c.seq.finish_reason is None)
        sampled = [plan.sampled[i] for i in keep]
        tokens = [out.token_ids[i] for i in keep]
        reasons = self.scheduler.postprocess(replace(plan, chunks=live, input_ids=None), tokens, now)
        events = []
        for seq, token, i, reason in zip(sampled, tokens, keep, reasons, strict=True):
            events.append(
                TokenEvent(
                    self._index[seq.seq_id], token, reason, logprobs=out.logprobs[i], request_id=seq.seq_id
                )
            )
            if reason is not None:
                del self._index[seq.seq_id]
                del self._live[seq.seq_id]
        return events + [e for e in failures if e is not None]

    def step(self) -> list[TokenEvent]:
        """Run one step and return the tokens it produced (possibly none).

        With `async_decode`, a decode step is launched before the previous one's tokens are
        read, where that is exact (see `engine.inflight`): a call launches the next decode step,
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
        caller stops early (closes the generator) or anything raises (one of these requests
        failing inside a step raises its error), this call's unfinished requests are aborted and
        their pages freed."""
        seqs = self.submit(prompts, params)
        mine = {s.seq_id for s in seqs}
        try:
            while self.has_unfinished and any(s.finish_reason is None for s in seqs):
                for event in self.step():
                    if event.request_id in mine:
                        if event.error is not None:  # failed inside a step: the call fails
                            raise event.error
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
        tokens. Any exception (from the model, from `on_token`, or the error of one of these
        requests failing inside a step) aborts this call's requests, frees their pages, and
        propagates."""
        if on_token is not None and not callable(on_token):
            raise InputError(f"on_token must be callable, got {type(on_token).__name__}")
        seqs = self.submit(prompts, params)
        mine = {s.seq_id for s in seqs}
        try:
            while self.has_unfinished and any(s.finish_reason is None for s in seqs):
                for event in self.step():
                    if event.request_id in mine and event.error is not None:
                        raise event.error  # failed inside a step: the call fails
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
