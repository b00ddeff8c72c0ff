"""OpenAI's response JSON for one request: whole responses, stream chunks, logprobs and usage.

With `echo` (completions), each choice's text starts with its prompt, and with `logprobs` its
log-probabilities start with the prompt tokens' (`SamplingParams.prompt_logprobs`): the first
token's `token_logprobs` and `top_logprobs` entries are null (nothing comes before it), and each
later prompt token's `top_logprobs` holds the top k and the token itself, as vLLM's. A stream sends
the prompt with the choice's first chunk. Echo without generation (`max_tokens: 0`, lm-eval's
scoring) runs one token and leaves it out: the choice is the prompt alone, and it counts no
completion tokens.

vLLM's `prompt_logprobs: k` adds each prompt token's scores in vLLM's shape: a list with one
entry per prompt token, the first null, each other a dict from the token id (a string) to
`{"logprob", "rank", "decoded_token"}` holding the prompt token itself and the k most likely
tokens (`rank` 1 is the most likely). Completions put it in each choice; chat puts it on the
response, as vLLM does. A chat request with `echo` (vLLM's meaning) starts the reply with the
last message's content when that message is what the reply continues (`chat_echo_text`).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from ..engine.outputs import Update
from ..llm import LLM
from .loop import RequestStream


@dataclass(frozen=True)
class Echo:
    """A completion request's `echo`: each choice's prompt text, and whether the generated token
    is left out (`max_tokens: 0`)."""

    texts: tuple[str, ...]  # per choice
    only: bool


class Formatter:
    """Builds OpenAI's JSON for one request (whole responses and stream chunks)."""

    def __init__(
        self, llm: LLM, stream: RequestStream, model: str, chat: bool, token_ids: bool = False,
        echo: Echo | None = None, prompt_logprobs: int | None = None, chat_echo: str = "",
    ):  # fmt: skip
        self.llm, self.stream, self.model, self.chat, self.token_ids = llm, stream, model, chat, token_ids
        self.echo, self.prompt_k, self.chat_echo = echo, prompt_logprobs, chat_echo
        self.id = stream.request_id
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        self._offsets = [0] * len(stream.trackers)
        self._echoed: set[int] = set()  # choices whose stream has sent the prompt

    def _bytes(self, token_id: int) -> bytes:
        tok = self.llm.tokenizer
        return tok.token_bytes(token_id) if tok is not None else b""

    def _token(self, token_id: int) -> str:
        """The token's text; a token that is not whole UTF-8 is spelled `bytes:\\xNN...` (as
        OpenAI does), and without a tokenizer `token_id:N`."""
        if self.llm.tokenizer is None:
            return f"token_id:{token_id}"
        raw = self._bytes(token_id)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    def logprobs(self, index: int, items) -> dict | None:
        if self.stream.trackers[index].params.logprobs is None:
            return None
        if self.chat:
            content = []
            for lp in items:
                content.append(
                    {
                        "token": self._token(lp.token_id),
                        "logprob": lp.logprob,
                        "bytes": list(self._bytes(lp.token_id)),
                        "top_logprobs": [
                            {"token": self._token(i), "logprob": x, "bytes": list(self._bytes(i))}
                            for i, x in lp.top
                        ],
                    }
                )
            return {"content": content}
        tokens = [self._token(lp.token_id) for lp in items]
        offsets = []
        for t in tokens:
            offsets.append(self._offsets[index])
            self._offsets[index] += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in items],
            "top_logprobs": [{self._token(i): x for i, x in lp.top} for lp in items],
            "text_offset": offsets,
        }

    def _prompt_logprobs(self, index: int) -> dict:
        """The prompt's part of choice `index`'s completion logprobs (text offsets from 0)."""
        t = self.stream.trackers[index]
        ids, scores = self.stream.prompt_ids[index], t.prompt_logprobs or ()
        k = t.params.logprobs  # the engine may have scored more (a larger prompt_logprobs)
        tokens, values, tops, offsets = [], [], [], []
        for i, tok in enumerate(ids):
            tokens.append(self._token(tok))
            lp = scores[i] if i < len(scores) else None
            values.append(lp.logprob if lp is not None else None)
            if lp is None:
                tops.append(None)
            else:
                top = {self._token(j): x for j, x in lp.top[:k]}
                top[tokens[-1]] = lp.logprob
                tops.append(top)
            offsets.append(self._offsets[index])
            self._offsets[index] += len(tokens[-1])
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}

    def _echoed_logprobs(self, index: int, items) -> dict | None:
        """Choice `index`'s completion logprobs of `items`, after its prompt's if not yet sent."""
        if self.stream.trackers[index].params.logprobs is None:
            return None
        head = None
        if index not in self._echoed:
            head = self._prompt_logprobs(index)
        body = self.logprobs(index, [] if self.echo.only else items)
        if head is None:
            return body
        return {key: head[key] + body[key] for key in head}

    def vllm_prompt_logprobs(self, index: int) -> list[dict | None] | None:
        """Choice `index`'s prompt scores in vLLM's `prompt_logprobs` shape (None if not asked)."""
        if self.prompt_k is None:
            return None
        ids = self.stream.prompt_ids[index]
        scores = self.stream.trackers[index].prompt_logprobs or ()
        out: list[dict | None] = []
        for i in range(len(ids)):
            lp = scores[i] if i < len(scores) else None
            if lp is None:
                out.append(None)
                continue
            entry = {str(lp.token_id): self._scored(lp.logprob, lp.rank, lp.token_id)}
            for rank, (j, x) in enumerate(lp.top[: self.prompt_k], start=1):
                entry.setdefault(str(j), self._scored(x, rank, j))
            out.append(entry)
        return out

    def _scored(self, logprob: float, rank: int | None, token_id: int) -> dict:
        return {"logprob": logprob, "rank": rank, "decoded_token": self._token(token_id)}

    def pending_echo(self, index: int) -> bool:
        """Choice `index` still has its echoed prompt to send."""
        return self.echo is not None and index not in self._echoed

    def usage(self) -> dict:
        p, c = self.stream.prompt_tokens, self.stream.completion_tokens
        if self.echo is not None and self.echo.only:
            c = 0  # the one token run is not returned
        return {
            "prompt_tokens": p,
            "completion_tokens": c,
            "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": self.stream.cached_tokens},
        }

    def whole(self) -> dict:
        choices = []
        for t in self.stream.trackers:
            out = t.output()
            reason = out.finish_reason
            if self.chat:
                lp = self.logprobs(t.index, out.logprobs or [])
                text = out.text if not self.chat_echo else self.chat_echo + (out.text or "")
                choice = {"index": t.index, "message": {"role": "assistant", "content": text}}
            elif self.echo is not None:
                lp = self._echoed_logprobs(t.index, out.logprobs or [])
                self._echoed.add(t.index)
                text = "" if self.echo.only or out.text is None else out.text
                choice = {"index": t.index, "text": self.echo.texts[t.index] + text}
            else:
                lp = self.logprobs(t.index, out.logprobs or [])
                choice = {
                    "index": t.index,
                    "text": out.text if out.text is not None else "",
                }  # no tokenizer: ids only
            choice.update({"logprobs": lp, "finish_reason": reason, "stop_reason": out.stop_reason})
            if self.prompt_k is not None and not self.chat:
                choice["prompt_logprobs"] = self.vllm_prompt_logprobs(t.index)
            if self.token_ids:
                choice["token_ids"] = out.token_ids
            choices.append(choice)
        body = {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self.usage(),
        }
        if self.prompt_k is not None and self.chat:  # one prompt for every choice
            body["prompt_logprobs"] = self.vllm_prompt_logprobs(0)
        return body

    def chunk(self, choices: list[dict], usage: dict | None = None) -> str:
        body = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if usage is not None:
            body["usage"] = usage
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    def delta(self, u: Update) -> dict:
        if self.chat:
            lp = self.logprobs(u.index, u.logprobs)
            d = {"index": u.index, "delta": {"content": u.text} if u.text else {}}
        elif self.echo is not None:
            head = self.echo.texts[u.index] if u.index not in self._echoed else ""
            lp = self._echoed_logprobs(u.index, u.logprobs)
            self._echoed.add(u.index)
            d = {"index": u.index, "text": head + ("" if self.echo.only else u.text)}
        else:
            lp = self.logprobs(u.index, u.logprobs)
            d = {"index": u.index, "text": u.text}
        d.update({"logprobs": lp, "finish_reason": u.finish_reason})
        if self.token_ids:
            d["token_ids"] = list(u.token_ids)
        if u.finish_reason is not None:
            d["stop_reason"] = u.stop_reason
        return d
