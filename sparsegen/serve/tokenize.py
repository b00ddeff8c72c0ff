"""`POST /tokenize` and `POST /detokenize` in vLLM's shapes.

    /tokenize    {"prompt": str} or {"messages": [...], "add_generation_prompt": bool}
                 -> {"count", "max_model_len", "tokens", "token_strs"}
    /detokenize  {"tokens": [int, ...]} -> {"prompt": str}
    GET /tokenizer_info  -> {"tokenizer_class", "eos_token", "bos_token", "pad_token",
                             "chat_template", "model_max_length", "vocab_size"}
                 (vLLM's route; lm-eval's `tokenizer_backend=remote` reads it, then tokenizes
                 through /tokenize and /detokenize)

`model` is optional here (vLLM's too); when given it must be the served name. A prompt longer
than the context is still tokenized: `count` against `max_model_len` is how a client finds out.
`add_special_tokens` has vLLM's meaning and defaults: for a prompt (default true) the tokenizer
adds its special tokens (a BOS for Llama), so the ids are those /v1/completions runs for the same
prompt by default; for messages (default false) the chat template writes them, and true adds the
tokenizer's on top, as /v1/chat/completions does with the same field.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import FastAPI, Request
from pydantic import Field
from starlette.concurrency import run_in_threadpool

from ..errors import InputError, RequestError
from .openai_errors import error_json
from .protocol import MAX_TOKEN_COUNT, ChatMessage, TokenId, _Strict

MAX_TEXT = 1 << 22  # characters: the body limit bounds it anyway


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: Annotated[str, Field(max_length=MAX_TEXT)] | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=4096)] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool | None = None  # None: true for a prompt, false for messages (vLLM's)
    return_token_strs: bool = False

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise RequestError("give exactly one of prompt or messages", "prompt")


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: Annotated[list[TokenId], Field(max_length=MAX_TOKEN_COUNT)]

    def check(self) -> None:
        pass


def add_tokenize_routes(app: FastAPI, llm, parse, prompt_ids) -> None:
    """The two routes on `app`; `parse` and `prompt_ids` are the app's body parser and the
    translation of bad input into a 400 naming its field."""

    def tokenizer(param: str):
        if llm.tokenizer is None:
            raise RequestError("this checkpoint has no tokenizer", param)
        return llm.tokenizer

    def tokens_of(req: TokenizeRequest) -> list[int]:
        if req.messages is not None:
            tok = tokenizer("messages")
            conversation = [m.as_dict() for m in req.messages]
            text = llm.chat_template.render(conversation, req.add_generation_prompt)
            return tok.encode(text, add_special_tokens=bool(req.add_special_tokens))
        special = True if req.add_special_tokens is None else req.add_special_tokens
        return tokenizer("prompt").encode(req.prompt, add_special_tokens=special)

    def strs(ids: list[int]) -> list[str]:
        return [llm.tokenizer.token_bytes(i).decode("utf-8", errors="replace") for i in ids]

    @app.post("/tokenize")
    async def tokenize(request: Request):
        try:
            req = await parse(request, TokenizeRequest, any_model=True)
            param = "messages" if req.messages is not None else "prompt"
            ids = await run_in_threadpool(prompt_ids, lambda: tokens_of(req), param)  # off the event loop
        except RequestError as exc:
            return error_json(exc.status, str(exc), exc.param, exc.code)
        return {
            "count": len(ids),
            "max_model_len": llm.max_model_len,
            "tokens": ids,
            "token_strs": strs(ids) if req.return_token_strs else None,
        }

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        tok = llm.tokenizer
        if tok is None:
            return error_json(404, "this checkpoint has no tokenizer")
        names = {i: s for s, i in tok.special_tokens.items()}
        added = tok.encode("", add_special_tokens=True)  # the tokenizer's own special tokens, if any
        return {
            "tokenizer_class": type(tok).__name__,
            "eos_token": names.get(tok.eos_token_id),
            "bos_token": names.get(added[0]) if added else None,  # what add_special_tokens puts first
            "pad_token": None,
            "chat_template": llm.chat_template.source,
            "model_max_length": llm.max_model_len,
            "vocab_size": llm.vocab_size,
        }

    @app.post("/detokenize")
    async def detokenize(request: Request):
        def decode(ids: list[int]) -> list[list[int]]:
            for i in ids:
                if i >= llm.vocab_size:
                    raise InputError(f"token id {i} is outside the vocabulary 0..{llm.vocab_size - 1}")
            return [ids]

        try:
            req = await parse(request, DetokenizeRequest, any_model=True)
            ids = prompt_ids(lambda: decode(req.tokens), "tokens")[0]
            text = prompt_ids(lambda: [tokenizer("tokens").decode(ids)], "tokens")[0]
        except RequestError as exc:
            return error_json(exc.status, str(exc), exc.param, exc.code)
        return {"prompt": text}
