"""One thread owns the engine; asyncio handlers talk to it through a command inbox.

HTTP handlers (on the event loop) call `submit()`, which returns a `RequestStream` at once,
and `cancel()`. The engine thread drains the inbox between steps (adding sequences, aborting
cancelled ones), runs `engine.step()` while anything is unfinished, turns each step's events into
`Update`s with the engine's one output path (`engine.output_processor`, the same as
`LLM.generate`'s), and hands every step's updates back to the event loop in one
`call_soon_threadsafe`. So requests from any number of connections share one
continuous batch, and nothing but this thread drives the engine or touches the model (the event
loop only reads `LLM.stats()` for admission and /metrics). The engine is the `LLMEngine`,
whether its model runs in this process or in tensor-parallel ranks below it.
A request that fails inside a step (an error event from the engine, or its text tracking
raising) fails alone: its stream gets the error and the others go on. A step that fails as a
whole fails the requests in it, and only a lost rank stops the engine thread.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field

from ..engine.output_processor import OutputProcessor, RequestState
from ..engine.outputs import CompletionTracker, Update
from ..errors import DistributedError, RequestError, ServerOverloaded
from ..llm import LLM
from ..request.sampling_params import SamplingParams

log = logging.getLogger("sparsegen")


@dataclass(eq=False)
class RequestStream:
    """What a handler awaits: `Update`s, then None once every completion has finished."""

    request: RequestState  # its completions (choices), built by `LLM.request`
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    t_submit: float = field(default_factory=time.perf_counter)
    t_first: float | None = None
    t_last: float | None = None  # when the latest update came (inter-token latency)
    error: BaseException | None = None
    done: bool = False

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prompt_ids(self) -> list[list[int]]:  # per choice
        return self.request.prompt_ids

    @property
    def trackers(self) -> list[CompletionTracker]:  # per choice
        return self.request.completions

    @property
    def completion_tokens(self) -> int:
        return sum(len(t.token_ids) for t in self.trackers)

    @property
    def prompt_tokens(self) -> int:
        # the same prompt for every choice of one prompt: count each distinct prompt once
        seen = {id(p): len(p) for p in self.prompt_ids}
        return sum(seen.values())

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens found in the prefix cache: per distinct prompt, its first choice's."""
        seen: dict[int, int] = {}
        for p, t in zip(self.prompt_ids, self.trackers, strict=True):
            seen.setdefault(id(p), t.num_cached_tokens or 0)
        return sum(seen.values())

    async def updates(self):
        """Async iterator over Updates; raises the engine's error if the request failed."""
        while True:
            item = await self.queue.get()
            if item is None:
                if self.error is not None:
                    raise self.error
                return
            yield item


class AsyncEngine:
    def __init__(self, llm: LLM, *, max_queue: int = 256, metrics=None):
        self.llm = llm
        self.engine = llm.engine
        self.max_queue = max_queue
        self.capacity = llm.stats().max_num_seqs + max_queue
        self.metrics = metrics
        self.inflight = 0  # sequences submitted and not finished (event-loop thread only)
        self.accepting = True
        self._inbox: deque = deque()
        self._taken: list = []  # the commands the engine thread took from the inbox last
        self._cv = threading.Condition()
        self._stop = False
        self._processor = OutputProcessor(self.engine)  # engine thread only
        self._streams: dict[RequestState, RequestStream] = {}  # added and not yet closed (engine thread)
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._run, name="sparsegen-engine", daemon=True)
        self.failed: BaseException | None = None

    # -- event-loop side ---------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.failed is None

    def submit(self, prompts: list[list[int]], params: SamplingParams, kind: str = "cmpl") -> RequestStream:
        """Queue len(prompts) * params.n sequences; choice i*n + j is prompt i's completion j."""
        per_prompt = params.n
        want = len(prompts) * per_prompt
        if not self.accepting or not self.alive:
            raise ServerOverloaded(
                "the server is shutting down" if not self.accepting else "the engine stopped"
            )
        if want > self.capacity:
            raise RequestError(
                f"the request asks for {want} sequences ({len(prompts)} prompts x n={per_prompt}); this server "
                f"takes at most {self.capacity} at once",
                "n" if per_prompt > 1 else "prompt",
            )
        if self.inflight + want > self.capacity:
            raise ServerOverloaded(
                f"the queue is full ({self.inflight} sequences in flight, room for {self.capacity}); retry later"
            )
        rid = f"{kind}-{next(self._ids)}-{uuid.uuid4().hex[:12]}"  # the response's id, and the log line's
        stream = RequestStream(self.llm.request(rid, prompts, params), asyncio.get_running_loop())
        self.inflight += want
        self._send(("add", stream))
        return stream

    def cancel(self, stream: RequestStream) -> None:
        if not stream.done:
            self._send(("abort", stream))

    def _send(self, command) -> None:
        with self._cv:
            self._inbox.append(command)
            self._cv.notify()

    def _deliver(self, batch: list[tuple[RequestStream, Update | None]]) -> None:
        """On the event loop: put each update into its stream's queue; close finished streams."""
        for stream, item in batch:
            if stream.done:
                continue
            if item is None:
                stream.done = True
                self.inflight -= len(stream.trackers)
                self._log_done(stream)
            elif stream.t_first is None:
                stream.t_first = stream.t_last = time.perf_counter()
                if self.metrics is not None:
                    self.metrics.ttft.observe(stream.t_first - stream.t_submit)
                    self.metrics.vllm.ttft.observe(stream.t_first - stream.t_submit)
            elif self.metrics is not None and item.token_ids:
                now = time.perf_counter()
                self.metrics.vllm.itl.observe(now - stream.t_last)
                stream.t_last = now
            stream.queue.put_nowait(item)

    def _log_done(self, stream: RequestStream) -> None:
        wall = time.perf_counter() - stream.t_submit
        ttft = (stream.t_first or time.perf_counter()) - stream.t_submit
        reasons = ",".join(str(t.finish_reason) for t in stream.trackers)
        log.info(
            "request %s: %d prompt + %d completion tokens, ttft %.3f s, latency %.3f s, finish %s",
            stream.request_id, stream.prompt_tokens, stream.completion_tokens, ttft, wall, reasons,
        )  # fmt: skip
        if self.metrics is not None:
            self.metrics.latency.observe(wall)
            self.metrics.prompt_tokens.inc(stream.prompt_tokens)
            self.metrics.generation_tokens.inc(stream.completion_tokens)
            v = self.metrics.vllm
            v.e2e.observe(wall)
            v.prompt_tokens.inc(stream.prompt_tokens)
            v.generation_tokens.inc(stream.completion_tokens)
            for t in stream.trackers:
                v.finished(t.finish_reason)
                if t.t_scheduled is not None:  # same clock (perf_counter), same process
                    v.queue_time.observe(max(0.0, t.t_scheduled - stream.t_submit))

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the thread: whatever is still running is aborted (uvicorn drained it first)."""
        self.accepting = False
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout)

    # -- engine thread -----------------------------------------------------------------------------
    @property
    def queue_depth(self) -> int:
        return self.llm.stats().waiting + len(self._inbox)

    @property
    def running(self) -> int:
        return self.llm.stats().running

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # a bug here must not leave handlers waiting forever
            log.exception("the engine thread stopped")
            self.failed = exc
            out: list = []
            for stream in self._live_streams():
                stream.error = exc
                out.append((stream, None))
            with self._cv:  # the commands queued, and those taken but not done (a stream twice is fine)
                waiting = [s for _, s in (*self._taken, *self._inbox)]
                self._inbox.clear()
            for stream in waiting:
                stream.error = exc
                out.append((stream, None))
            self._flush(out)

    def _loop(self) -> None:
        engine = self.engine
        while True:
            with self._cv:
                while not self._inbox and not engine.has_unfinished and not self._stop:
                    self._cv.wait()
                commands = self._taken = list(self._inbox)
                self._inbox.clear()
                stop = self._stop
            out: list[tuple[RequestStream, Update | None]] = []
            for op, stream in commands:
                if op == "add":
                    self._add(stream, out)
                else:
                    self._abort(stream, out)
            if stop:
                for stream in self._live_streams():
                    self._abort(stream, out)
                self._flush(out)
                return
            if engine.has_unfinished:
                try:
                    events = engine.step()
                except DistributedError:  # a tensor-parallel engine that lost a rank is closed
                    raise  # _run fails every request and /health turns 503
                except Exception as exc:  # a failed step fails its requests, not the server
                    streams = self._live_streams()
                    log.exception("engine step failed; failing %d requests", len(streams))
                    for stream in streams:
                        stream.error = exc
                        self._abort(stream, out)
                    self._flush(out)
                    continue
                self._dispatch(events, out)
            self._flush(out)

    def _flush(self, out) -> None:
        if out:
            loop = out[0][0].loop
            try:
                loop.call_soon_threadsafe(self._deliver, list(out))
            except RuntimeError:  # the event loop is closed: nobody is waiting any more
                pass
            out.clear()

    def _live_streams(self) -> list[RequestStream]:
        """The streams with a completion still running in the engine."""
        return [self._streams[r] for r in self._processor.live_requests()]

    def _add(self, stream: RequestStream, out) -> None:
        request, seq_ids = stream.request, []
        self._streams[request] = stream
        try:
            for ids, t in zip(request.prompt_ids, request.completions, strict=True):
                seq_ids.append(self.engine.add_request(ids, t.params).seq_id)
        except DistributedError:  # a tensor-parallel engine that lost a rank is closed (see _run)
            raise
        except Exception as exc:  # checked before submit; anything left fails this request only
            stream.error = exc
            self._processor.track(request, seq_ids)
            self._abort(stream, out)
        else:
            self._processor.track(request, seq_ids)

    def _abort(self, stream: RequestStream, out) -> None:
        self._processor.abort(stream.request)
        self._streams.pop(stream.request, None)
        out.append((stream, None))

    def _dispatch(self, events, out) -> None:
        for ev in events:
            request = self._processor.owner(ev.request_id)
            if request is None:
                continue
            stream = self._streams[request]
            if ev.error is not None:  # this request failed inside the step; the others go on
                self._fail(stream, ev.error, out)
                continue
            try:
                for request, update in self._processor.process((ev,)):
                    out.append((stream, update))
                    if update.finish_reason is not None and request.finished:
                        del self._streams[request]
                        out.append((stream, None))
            except DistributedError:
                raise
            except Exception as exc:  # turning its token into text failed: this request alone fails
                log.exception("request %s failed; the others go on", stream.request_id)
                self._fail(stream, exc, out)

    def _fail(self, stream: RequestStream, exc: BaseException, out) -> None:
        if not stream.done and stream.error is None:
            stream.error = exc
            self._abort(stream, out)
