"""`OutputProcessor`: the engine's token events in, request outputs out, for every front end.

A `RequestState` is one request: its completions (one `CompletionTracker` each, so one engine
sequence each) and their prompts. Whoever queues a request's sequences on the engine hands
their ids to `track()`; from then on `process(events)` turns each engine step's `TokenEvent`s
into `Update`s (the text each token shows, its finish reason), and aborts in the engine the
sequences that a stop string ended. `stream()` / `run()` drive the engine until some requests
are done: the one step loop behind `LLMEngine.generate/stream` and `LLM.generate/chat` (so also
`sparsegen generate`). The server's engine thread (`serve.loop`) steps the engine itself,
between its commands, and hands each step's events to `process()`.

`run_prompts()` is the engine's own whole-request call (`LLMEngine.generate`): one completion
per prompt, text from the engine's tokenizer, EOS from the engine's `eos_token_id`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from collections.abc import Sequence as Seq
from contextlib import closing
from dataclasses import dataclass, field

from .checks import expand_params
from .outputs import CompletionTracker, Detokenizer, RequestOutput, Update


@dataclass(eq=False)
class RequestState:
    """One request's completions; completion i answers `prompt_ids[i]` (a server request may
    hold several prompts, each with its n completions)."""

    request_id: str
    prompt_ids: list[list[int]]  # per completion
    completions: list[CompletionTracker]
    prompt: str | None = None  # the prompt's text, when it was given as text
    seq_ids: list[int] = field(default_factory=list)  # the engine's request id of each tracked completion

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.completions)

    def output(self) -> RequestOutput:
        """The request's result (one prompt: that of its first completion)."""
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=list(self.prompt_ids[0]),
            outputs=[c.output() for c in self.completions],
            num_cached_tokens=self.completions[0].num_cached_tokens,
            prompt_logprobs=_listed(self.completions[0].prompt_logprobs),
        )


def _listed(items: tuple | None) -> list | None:
    return list(items) if items is not None else None


class OutputProcessor:
    """Follows the tracked sequences of one engine (an `LLMEngine`, or anything with its
    `step`, `abort` and `has_unfinished`). Events of sequences it does not track are ignored."""

    def __init__(self, engine):
        self.engine = engine
        self._live: dict[int, tuple[RequestState, CompletionTracker]] = {}  # seq_id -> unfinished

    def track(self, request: RequestState, seq_ids: Seq[int]) -> None:
        """Follow `request`'s next `len(seq_ids)` completions, already queued in the engine as
        those request ids (in order); their submission time is now."""
        now = time.perf_counter()
        start = len(request.seq_ids)
        for c, sid in zip(request.completions[start : start + len(seq_ids)], seq_ids, strict=True):
            c.t_submit = now
            request.seq_ids.append(sid)
            self._live[sid] = (request, c)

    def owner(self, request_id: int) -> RequestState | None:
        """The tracked request that engine request `request_id` is a completion of (None: not
        tracked, or already finished)."""
        entry = self._live.get(request_id)
        return entry[0] if entry is not None else None

    def live_requests(self) -> list[RequestState]:
        """The requests with a tracked completion that has not finished, in tracking order."""
        return list({id(r): r for r, _ in self._live.values()}.values())

    def _one(self, event, now: float) -> tuple[RequestState, Update] | None:
        entry = self._live.get(event.request_id)
        if entry is None:
            return None
        request, c = entry
        if c.num_cached_tokens is None:
            c.num_cached_tokens = getattr(event, "num_cached_tokens", 0)
            c.t_scheduled = getattr(event, "t_scheduled", None)
        update = c.add(
            event.token_id, event.finish_reason, event.logprobs, now, getattr(event, "prompt_logprobs", None)
        )
        if c.finished:
            del self._live[event.request_id]
            if event.finish_reason is None:
                self.engine.abort(event.request_id)  # a stop string ended it
        return request, update

    def process(self, events) -> Iterator[tuple[RequestState, Update]]:
        """One step's events as (request, update) of the tracked sequences, in event order and
        one at a time: when a pair is yielded, the request holds the events up to that one
        (so `request.finished` turns True with its last completion's update). Consume it all."""
        now = time.perf_counter()
        for event in events:
            x = self._one(event, now)
            if x is not None:
                yield x

    def abort(self, request: RequestState) -> None:
        """Drop the request's unfinished sequences from the engine; its completions end "abort"."""
        for sid in request.seq_ids:
            if self._live.pop(sid, None) is not None:
                self.engine.abort(sid)
        for c in request.completions:
            c.abort()

    def stream(self, requests: Seq[RequestState]) -> Iterator[tuple[object, RequestState, Update]]:
        """Step the engine until every one of `requests` has finished, yielding (event, request,
        update) for each of their tokens. A request the engine dropped without a last token
        (aborted from outside) ends "abort" once the engine is idle. If the caller stops early
        (closes the generator) or anything raises, the unfinished requests are aborted."""
        try:
            while not all(r.finished for r in requests) and self.engine.has_unfinished:
                events = self.engine.step()
                now = time.perf_counter()
                for event in events:
                    if event.error is not None and event.request_id in self._live:
                        raise event.error  # failed inside a step: this call fails (its pages are free)
                    x = self._one(event, now)
                    if x is not None:
                        yield event, *x
        finally:
            for r in requests:
                if not r.finished:
                    self.abort(r)

    def run(
        self,
        requests: Seq[RequestState],
        on_update: Callable[[RequestState, Update], None] | None = None,
        on_event: Callable[[object], None] | None = None,
    ) -> None:
        """`stream()` to the end: `on_event` sees each of their `TokenEvent`s, then `on_update`
        its update. Any exception (also from a callback) aborts the unfinished requests."""
        with closing(self.stream(requests)) as steps:
            for event, request, update in steps:
                if on_event is not None:
                    on_event(event)
                if on_update is not None:
                    on_update(request, update)


def track_prompts(engine, prompts, params, seqs) -> tuple[OutputProcessor, list[RequestState]]:
    """A processor following `seqs`, the engine's sequences of `engine.submit(prompts, params)`:
    one request of one completion per prompt, text from `engine.tokenizer` when it has one."""
    detok = Detokenizer(engine.tokenizer, frozenset({engine.eos_token_id} - {None}))
    processor, requests = OutputProcessor(engine), []
    for i, (seq, p) in enumerate(zip(seqs, expand_params(params, len(seqs)), strict=True)):
        request = RequestState(str(i), [list(prompts[i])], [detok.completion(0, p)])
        processor.track(request, [seq.seq_id])
        requests.append(request)
    return processor, requests


def run_prompts(engine, prompts, params, on_token: Callable | None = None) -> list[RequestOutput]:
    """`LLMEngine.generate`: check and queue the prompts (all or none), run them to the end;
    one output per prompt, in input order."""
    seqs = engine.submit(prompts, params)
    processor, requests = track_prompts(engine, prompts, params, seqs)
    processor.run(requests, on_event=on_token)
    return [r.output() for r in requests]
