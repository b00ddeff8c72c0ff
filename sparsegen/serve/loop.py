"""One thread owns the engine; asyncio handlers talk to it through a command inbox.

HTTP handlers (on the event loop) call `submit()`, which returns a `RequestStream` at once,
and `cancel()`. The engine thread drains the inbox between steps (adding sequences, aborting
cancelled ones), runs `engine.step()` while anything is unfinished, turns each event into text
with the request's `CompletionTracker`s, and hands every step's updates back to the event loop
in one `call_soon_threadsafe`. So requests from any number of connections share one
continuous batch, and nothing but this thread drives the engine or touches the model (the event
loop only reads `LLM.stats()` for admission and /metrics). The engine is an `LLMEngine` or, with
tensor parallelism, a `TPEngine`: both offer add_request, step, abort and has_unfinished.
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

from ..engine.sampling_params import SamplingParams, TokenLogprobs
from ..errors import DistributedError, RequestError, ServerOverloaded
from ..llm import LLM
from .outputs import CompletionTracker

log = logging.getLogger("sparsegen")


@dataclass(frozen=True)
class Update:
    """New output of one completion of a request, from one engine step."""

    index: int  # the completion's index among the request's choices
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprobs, ...]
    finish_reason: str | None
    stop_reason: int | str | None = None


@dataclass(eq=False)
class RequestStream:
    """What a handler awaits: `Update`s, then None once every completion has finished."""

    request_id: str
    prompt_ids: list[list[int]]  # per choice
    trackers: list[CompletionTracker]
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    t_submit: float = field(default_factory=time.perf_counter)
    t_first: float | None = None
    error: BaseException | None = None
    done: bool = False
    seq_ids: list[int | None] = field(default_factory=list)  # engine thread only

    @property
    def completion_tokens(self) -> int:
        return sum(len(t.token_ids) for t in self.trackers)

    @property
    def prompt_tokens(self) -> int:
        # the same prompt for every choice of one prompt: count each distinct prompt once
        seen = {id(p): len(p) for p in self.prompt_ids}
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
        self._live: dict[int, tuple[RequestStream, int]] = {}  # seq_id -> (stream, choice index)
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
        choices, trackers = [], []
        for ids in prompts:
            children, ts = self.llm.trackers(params)
            for t in ts:
                t.index = len(trackers)
                trackers.append(t)
                choices.append(ids)
        rid = f"{kind}-{next(self._ids)}-{uuid.uuid4().hex[:12]}"  # the response's id, and the log line's
        stream = RequestStream(rid, choices, trackers, asyncio.get_running_loop())
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
                stream.t_first = time.perf_counter()
                if self.metrics is not None:
                    self.metrics.ttft.observe(stream.t_first - stream.t_submit)
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
            for stream in {s for s, _ in self._live.values()}:
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
                for stream in {s for s, _ in self._live.values()}:
                    self._abort(stream, out)
                self._flush(out)
                return
            if engine.has_unfinished:
                try:
                    events = engine.step()
                except DistributedError:  # a tensor-parallel engine that lost a rank is closed
                    raise  # _run fails every request and /health turns 503
                except Exception as exc:  # a failed step fails its requests, not the server
                    log.exception("engine step failed; failing %d requests", len(self._live))
                    for stream in {s for s, _ in self._live.values()}:
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

    def _add(self, stream: RequestStream, out) -> None:
        try:
            for ids, t in zip(stream.prompt_ids, stream.trackers, strict=True):
                seq = self.engine.add_request(ids, t.params)
                stream.seq_ids.append(seq.seq_id)
                self._live[seq.seq_id] = (stream, t.index)
        except DistributedError:  # a tensor-parallel engine that lost a rank is closed (see _run)
            raise
        except Exception as exc:  # checked before submit; anything left fails this request only
            stream.error = exc
            self._abort(stream, out)

    def _abort(self, stream: RequestStream, out) -> None:
        for sid in stream.seq_ids:
            if sid is not None and self._live.pop(sid, None) is not None:
                self.engine.abort(sid)
        for t in stream.trackers:
            t.abort()
        out.append((stream, None))

    def _dispatch(self, events, out) -> None:
        for ev in events:
            entry = self._live.get(ev.request_id)
            if entry is None:
                continue
            stream, choice = entry
            if ev.error is not None:  # this request failed inside the step; the others go on
                self._fail(stream, ev.error, out)
                continue
            try:
                self._book(ev, stream, choice, out)
            except DistributedError:
                raise
            except Exception as exc:  # turning its token into text failed: this request alone fails
                log.exception("request %s failed; the others go on", stream.request_id)
                self._fail(stream, exc, out)

    def _fail(self, stream: RequestStream, exc: BaseException, out) -> None:
        if not stream.done and stream.error is None:
            stream.error = exc
            self._abort(stream, out)

    def _book(self, ev, stream: RequestStream, choice: int, out) -> None:
        """One event's token into its completion's text, and the Update (and the end) it makes."""
        t = stream.trackers[choice]
        text = t.add(ev.token_id, ev.finish_reason, ev.logprobs)
        if t.finished:
            del self._live[ev.request_id]
            if ev.finish_reason is None:
                self.engine.abort(ev.request_id)  # a stop string ended it
        out.append(
            (
                stream,
                Update(
                    choice,
                    text,
                    (ev.token_id,),
                    (ev.logprobs,) if ev.logprobs is not None else (),
                    t.finish_reason,
                    t.stop_reason,
                ),
            )
        )
        if t.finished and all(x.finished for x in stream.trackers):
            out.append((stream, None))
