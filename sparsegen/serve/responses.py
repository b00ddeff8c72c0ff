"""OpenAI's response JSON for one request: whole responses, stream chunks, logprobs and usage."""

from __future__ import annotations

import json
import time

from ..engine.outputs import Update
from ..llm import LLM
from .loop import RequestStream


class Formatter:
    """Builds OpenAI's JSON for one request (whole responses and stream chunks)."""

    def __init__(self, llm: LLM, stream: RequestStream, model: str, chat: bool, token_ids: bool = False):
        self.llm, self.stream, self.model, self.chat, self.token_ids = llm, stream, model, chat, token_ids
        self.id = stream.request_id
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        self._offsets = [0] * len(stream.trackers)

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

    def usage(self) -> dict:
        p, c = self.stream.prompt_tokens, self.stream.completion_tokens
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
            lp = self.logprobs(t.index, out.logprobs or [])
            reason = out.finish_reason
            if self.chat:
                choice = {"index": t.index, "message": {"role": "assistant", "content": out.text}}
            else:
                choice = {
                    "index": t.index,
                    "text": out.text if out.text is not None else "",
                }  # no tokenizer: ids only
            choice.update({"logprobs": lp, "finish_reason": reason, "stop_reason": out.stop_reason})
            if self.token_ids:
                choice["token_ids"] = out.token_ids
            choices.append(choice)
        return {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self.usage(),
        }

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
        lp = self.logprobs(u.index, u.logprobs)
        if self.chat:
            d = {"index": u.index, "delta": {"content": u.text} if u.text else {}}
        else:
            d = {"index": u.index, "text": u.text}
        d.update({"logprobs": lp, "finish_reason": u.finish_reason})
        if self.token_ids:
            d["token_ids"] = list(u.token_ids)
        if u.finish_reason is not None:
            d["stop_reason"] = u.stop_reason
        return d
