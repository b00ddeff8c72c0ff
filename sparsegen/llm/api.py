"""`sparsegen.LLM`: text in, text out, as vLLM's offline API.

    llm = sparsegen.LLM(model="path/to/Phi-3-small-8k-instruct")   # or LLM(random="tiny")
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=32))
    print(out[0].text, out[0].finish_reason)
    out = llm.chat([{"role": "user", "content": "Hi!"}], SamplingParams(max_tokens=64))

Prompts are strings (encoded with the checkpoint's tokenizer) or lists of token ids. Each
prompt's `n` completions run as separate sequences of one continuous batch; completion `i` of
a seeded request uses seed `seed + i`. The tokens that end a turn come from
`generation_config.json` (for random weights: `<|endoftext|>` and `<|end|>`, as
Phi-3-Small-instruct has them), and stop generation unless `ignore_eos`. Tokens become text,
stop strings and finish reasons in the engine's one output path (`engine.output_processor`),
which the server (`sparsegen.serve`) shares through `LLM.request`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from pathlib import Path

from ..engine.checks import check_processor_ids, check_prompt
from ..engine.output_processor import OutputProcessor, RequestState
from ..engine.outputs import Detokenizer, RequestOutput, Update
from ..engine.stats import EngineStats, engine_stats
from ..errors import InputError
from ..request.sampling_params import SEED_LIMIT, SamplingParams
from ..utf8 import check_utf8
from .build import ENGINE_OPTIONS, RANDOM_SIZES, build_engine, resolve_device, resolve_dtype
from .chat import ChatTemplate
from .requests import child_params, turn_end_ids
from .vllm_inputs import missing_folder, normalize_prompts, pick_params


class LLM:
    """Phi-3-Small through sparsegen's kernels: `model=DIR` (a local HF checkpoint) or
    `random="tiny"|"7b"`. `dtype` defaults to bf16 on a GPU and fp32 on the CPU; `device` to
    cuda when available. Other keyword arguments go to `LLMEngine` (`max_num_seqs`,
    `max_model_len`, `page_size`, `num_pages`, `kv_cache_bytes`, ...). `tensor_parallel_size=N`
    runs the model over N processes (one GPU each) below the engine (`sparsegen.parallel`);
    `close()` stops them."""

    def __init__(
        self,
        model: str | Path | None = None,
        *,
        random: str | None = None,
        tokenizer: str | Path | None = None,
        dtype=None,
        device=None,
        seed: int = 0,
        force_dense: bool = False,
        tensor_parallel_size: int = 1,
        **engine_options,
    ):
        if (model is None) == (random is None):
            raise InputError("give exactly one of model=DIR or random='tiny'|'7b'")
        if random is not None and random not in RANDOM_SIZES:
            raise InputError(f"random must be one of {RANDOM_SIZES}, got {random!r}")
        if model is not None and not isinstance(model, (str, Path)):
            raise InputError(f"model must be a checkpoint folder path, got {type(model).__name__}")
        if model is not None and not Path(model).is_dir():
            raise missing_folder(model)
        unknown = sorted(set(engine_options) - set(ENGINE_OPTIONS))
        if unknown:
            raise InputError(
                f"unknown LLM option {unknown[0]!r}; engine options are {', '.join(ENGINE_OPTIONS)}"
            )
        if "tokenizer" in engine_options:
            raise InputError("pass the tokenizer as a path with tokenizer=")
        if isinstance(tensor_parallel_size, bool) or not isinstance(tensor_parallel_size, int):
            raise InputError(f"tensor_parallel_size must be an int, got {tensor_parallel_size!r}")
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < SEED_LIMIT:
            raise InputError(f"seed must be an int in 0..2**64-1, got {seed!r:.40}")
        if not isinstance(force_dense, bool):
            raise InputError(f"force_dense must be a bool, got {force_dense!r:.40}")
        dev = resolve_device(device)
        self.engine, tok, model_config = build_engine(
            model,
            random,
            tokenizer,
            dev,
            resolve_dtype(dtype, dev),
            force_dense,
            seed,
            tensor_parallel_size,
            engine_options,
        )
        self.tensor_parallel_size = tensor_parallel_size
        self.model_name = str(model) if model is not None else f"random-{random}"
        self.tokenizer = tok
        vocab = model_config.vocab_size
        self.vocab_size = vocab
        folder = Path(model) if model is not None else None
        self.chat_template = ChatTemplate.from_folder(folder)
        # the engine's EOS first; every one of them ends a completion with stop_reason None
        self.eos_token_ids = turn_end_ids(folder, tok, self.engine.eos_token_id, vocab)
        self._ids = itertools.count()

    # -- building requests (shared with the server) --------------------------------------------
    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def stats(self) -> EngineStats:
        """The engine's queue, batch and KV-cache occupancy."""
        return engine_stats(self.engine)

    def close(self) -> None:
        """Stop the engine's tensor-parallel ranks (nothing to stop with one process)."""
        self.engine.close()

    def encode(self, prompt, where: str = "prompt", add_special_tokens: bool = False) -> list[int]:
        """Token ids of a str (encoded; `add_special_tokens` runs the tokenizer's post-processor,
        a BOS for Llama) or a list of ids (checked, taken as they are)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InputError(f"{where} is text, but this checkpoint has no tokenizer: pass token ids")
            text = check_utf8(prompt, where, InputError)
            prompt = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        elif not isinstance(prompt, (list, tuple)):
            raise InputError(f"{where} must be a str or a list of token ids, got {type(prompt).__name__}")
        ids = check_prompt(prompt, self.vocab_size, where)  # the engine's checks: ints in the vocabulary
        if len(ids) >= self.max_model_len:
            raise InputError(
                f"{where} has {len(ids)} tokens; the model takes at most {self.max_model_len - 1}"
            )
        return ids

    def use_chat_template(self, template: str, origin: str = "chat_template") -> None:
        """Render chats with `template` (Jinja, in the same sandbox) instead of the checkpoint's."""
        old = self.chat_template
        self.chat_template = ChatTemplate(template, old.bos_token, old.eos_token, origin=origin)

    def render_chat(
        self, messages, add_generation_prompt: bool = True, add_special_tokens: bool = False
    ) -> list[int]:
        """The template's text, tokenized; the template writes its own BOS, and
        `add_special_tokens` (vLLM's chat extra) adds the tokenizer's on top."""
        if self.tokenizer is None:
            raise InputError("chat needs a tokenizer, and this checkpoint has none")
        text = self.chat_template.render(messages, add_generation_prompt)
        return self.encode(text, "messages", add_special_tokens)

    def check_params(self, params, where: str = "params") -> SamplingParams:
        if not isinstance(params, SamplingParams):
            raise InputError(f"{where} must be a SamplingParams, got {type(params).__name__}")
        if params.stop and self.tokenizer is None:
            raise InputError(f"{where}.stop needs a tokenizer, and this checkpoint has none")
        bad = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad:
            raise InputError(
                f"{where}.stop_token_ids holds {bad[0]}, outside the vocabulary 0..{self.vocab_size - 1}"
            )
        check_processor_ids(params, self.vocab_size, where)
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and k > self.vocab_size:
                raise InputError(
                    f"{where}.{name} is {k}, more than the vocabulary's {self.vocab_size} tokens"
                )
        self.engine.structured.check(params)  # the grammar compiles for this tokenizer, or InputError
        return params

    def request(
        self, request_id: str, prompts: list[list[int]], params: SamplingParams, prompt: str | None = None
    ) -> RequestState:
        """A request's completions, not yet queued: each prompt's n completions in turn (choice
        i * n + j is prompt i's completion j), each with its own single-sequence parameters."""
        children = child_params(params, self.eos_token_ids[1:])
        detok = Detokenizer(self.tokenizer, frozenset(self.eos_token_ids))
        prompt_ids, completions = [], []
        for ids in prompts:
            for p in children:
                completions.append(detok.completion(len(completions), p))
                prompt_ids.append(ids)
        return RequestState(request_id, prompt_ids, completions, prompt)

    # -- offline API ---------------------------------------------------------------------------
    def generate(
        self,
        prompts,
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        on_update: Callable[[RequestState, Update], None] | None = None,
        *,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order. Everything is checked before anything runs.
        Prompts take vLLM's forms (`vllm_inputs.py`): str, token-id lists, `{"prompt": ...}`,
        `{"prompt_token_ids": [...]}`, or a list of them; `sampling_params=` is `params`.
        `on_update(request, update)` sees each new token's `Update` as it comes (the text it
        shows, held back near a possible stop string), for callers that print as they go."""
        params = pick_params(params, sampling_params)
        prompts = normalize_prompts(prompts)
        ids = [self.encode(p, f"prompts[{i}]") for i, p in enumerate(prompts)]
        texts = [p if isinstance(p, str) else None for p in prompts]
        return self._run(ids, texts, params, use_tqdm, on_update)

    def chat(
        self,
        messages,
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        on_update: Callable[[RequestState, Update], None] | None = None,
        *,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        """`messages` is one conversation (a list of {"role", "content"}) or a list of them;
        `on_update` as in `generate`; `sampling_params=` is `params`; `chat_template` (Jinja
        text) renders these conversations instead of the checkpoint's template."""
        params = pick_params(params, sampling_params)
        if chat_template is not None:
            if not isinstance(chat_template, str):
                raise InputError(f"chat_template must be a str, got {type(chat_template).__name__}")
            old = self.chat_template
            template = ChatTemplate(chat_template, old.bos_token, old.eos_token, origin="chat_template")
        else:
            template = self.chat_template
        if isinstance(messages, (list, tuple)) and messages and isinstance(messages[0], dict):
            messages = [messages]
        if not isinstance(messages, (list, tuple)) or not messages:
            raise InputError("messages must be a conversation (a list of dicts) or a list of conversations")
        if self.tokenizer is None:
            raise InputError("chat needs a tokenizer, and this checkpoint has none")
        ids = [self.encode(template.render(m, add_generation_prompt), "messages") for m in messages]
        texts = [self.tokenizer.decode(x) for x in ids]
        return self._run(ids, texts, params, use_tqdm, on_update)

    def _run(self, ids, texts, params, use_tqdm, on_update) -> list[RequestOutput]:
        if params is None:
            params = SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(ids)
        if not isinstance(params, (list, tuple)) or len(params) != len(ids):
            raise InputError(f"params must be one SamplingParams or a list of {len(ids)} (one per prompt)")
        params = [self.check_params(p, f"params[{i}]") for i, p in enumerate(params)]
        if on_update is not None and not callable(on_update):
            raise InputError(f"on_update must be callable, got {type(on_update).__name__}")
        base = next(self._ids)
        requests = [
            self.request(f"{base}-{r}", [x], p, texts[r])
            for r, (x, p) in enumerate(zip(ids, params, strict=True))
        ]
        choices = [(r, c) for r in requests for c in r.completions]
        seqs = self.engine.submit([r.prompt_ids[c.index] for r, c in choices], [c.params for _, c in choices])
        processor, done = OutputProcessor(self.engine), 0  # submit checked all, then queued all
        for r in requests:
            processor.track(r, [s.seq_id for s in seqs[done : done + len(r.completions)]])
            done += len(r.completions)
        bar = _progress(len(ids), use_tqdm)

        def updated(request: RequestState, update: Update) -> None:
            if on_update is not None:
                on_update(request, update)
            if bar is not None and update.finish_reason is not None and request.finished:
                bar.update(1)

        try:
            processor.run(requests, on_update=updated)
        finally:
            if bar is not None:
                bar.close()
        return [r.output() for r in requests]


def _progress(total: int, use_tqdm: bool):
    if not use_tqdm:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm is optional: no bar without it
        return None
    return tqdm(total=total, desc="Processed prompts", unit="prompt", dynamic_ncols=True)
