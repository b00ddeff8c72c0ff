"""`sparsegen.LLM`: text in, text out, as vLLM's offline API.

    llm = sparsegen.LLM(model="path/to/Phi-3-small-8k-instruct")   # or LLM(random="tiny")
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=32))
    print(out[0].text, out[0].finish_reason)
    out = llm.chat([{"role": "user", "content": "Hi!"}], SamplingParams(max_tokens=64))

Prompts are strings (encoded with the checkpoint's tokenizer) or lists of token ids. Each
prompt's `n` completions run as separate sequences of one continuous batch; completion `i` of
a seeded request uses seed `seed + i`. The tokens that end a turn come from
`generation_config.json` (for random weights: `<|endoftext|>` and `<|end|>`, as
Phi-3-Small-instruct has them), and stop generation unless `ignore_eos`.
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
from collections.abc import Sequence
from pathlib import Path

import torch

from .engine import LLMEngine
from .engine.checks import check_prompt
from .engine.sampling_params import SEED_LIMIT, SamplingParams
from .engine_stats import EngineStats, engine_stats
from .errors import InputError
from .serve.chat import ChatTemplate, eos_token_ids
from .serve.outputs import CompletionTracker, RequestOutput
from .utf8 import check_utf8

DTYPE_NAMES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
}
RANDOM_SIZES = ("tiny", "7b")
ENGINE_OPTIONS = tuple(
    p for p in inspect.signature(LLMEngine.__init__).parameters if p not in ("self", "model")
)


def resolve_device(device) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not isinstance(device, (str, torch.device)):
        raise InputError(f"device must be a str or torch.device, got {type(device).__name__}")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise InputError(f"device {device!r} is not a torch device (use 'cuda', 'cuda:N' or 'cpu')") from None
    if dev.type not in ("cpu", "cuda"):
        raise InputError(f"device must be cpu or cuda, got {device!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InputError(f"device {device!r} was asked for, but torch sees no CUDA GPU")
    return dev


def resolve_dtype(dtype, device: torch.device) -> torch.dtype:
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype) and dtype in DTYPE_NAMES.values():
        return dtype
    if isinstance(dtype, str) and dtype in DTYPE_NAMES:
        return DTYPE_NAMES[dtype]
    raise InputError(f"dtype must be one of {sorted(DTYPE_NAMES)} or 'auto', got {dtype!r}")


def build_tokenizer(model_dir, random, tokenizer_path):
    """The tokenizer for a checkpoint folder (None if it has none) or a named random size."""
    from .models import named_config
    from .models.config import TINY_SPECIAL_TOKENS
    from .tokenizer import PHI3SMALL_SPECIAL_TOKENS, ByteTokenizer, find_tiktoken_file, load_tokenizer

    if tokenizer_path is not None:
        return load_tokenizer(tokenizer_path)
    if model_dir is not None:
        return load_tokenizer(model_dir) if find_tiktoken_file(model_dir) is not None else None
    config = named_config(random)
    if random == "tiny":
        return ByteTokenizer(TINY_SPECIAL_TOKENS, config.vocab_size)
    # bytes plus Phi-3-Small's named special tokens; every other id is masked out
    named = {k: v for k, v in PHI3SMALL_SPECIAL_TOKENS.items() if "dummy_id" not in k}
    return ByteTokenizer(named, config.vocab_size)


def build_model(model_dir, random, tokenizer_path, device, dtype, force_dense=False, seed=0):
    """(model, tokenizer or None) for a checkpoint folder or a named random size."""
    from .models import load_checkpoint, named_config, random_model

    tokenizer = build_tokenizer(model_dir, random, tokenizer_path)
    if model_dir is not None:
        dummies = tokenizer.dummy_token_indices if tokenizer is not None else ()
        model = load_checkpoint(
            model_dir, device=device, dtype=dtype, force_dense=force_dense, dummy_token_indices=dummies
        )
        return model, tokenizer
    config = named_config(random)
    model = random_model(
        config,
        device=device,
        dtype=dtype,
        seed=seed,
        force_dense=force_dense,
        dummy_token_indices=tokenizer.dummy_token_indices,
    )
    return model, tokenizer


def turn_end_ids(folder: Path | None, tokenizer, eos_token_id: int, vocab_size: int) -> tuple[int, ...]:
    """The engine's EOS first, then `generation_config.json`'s eos_token_id list; for random
    weights (no folder), `<|end|>` too, as Phi-3-Small-instruct's generation_config has it."""
    eos = eos_token_ids(folder, vocab_size)
    if eos is None:
        eos = ()
        end = tokenizer.special_tokens.get("<|end|>") if tokenizer is not None and folder is None else None
        if end is not None:
            eos = (end,)
    return tuple(dict.fromkeys((eos_token_id, *eos)))


def child_params(params: SamplingParams, extra_stop_ids: tuple[int, ...]) -> list[SamplingParams]:
    """The n single-sequence SamplingParams of one request: seeds `seed + i`, and the turn-ending
    tokens added to `stop_token_ids` (unless `ignore_eos`)."""
    stops = params.stop_token_ids
    if not params.ignore_eos:
        stops = stops + tuple(t for t in extra_stop_ids if t not in stops)
    out = []
    for i in range(params.n):
        seed = None if params.seed is None else (params.seed + i) % SEED_LIMIT
        out.append(dataclasses.replace(params, n=1, seed=seed, stop_token_ids=stops))
    return out


class LLM:
    """Phi-3-Small through sparsegen's kernels: `model=DIR` (a local HF checkpoint) or
    `random="tiny"|"7b"`. `dtype` defaults to bf16 on a GPU and fp32 on the CPU; `device` to
    cuda when available. Other keyword arguments go to `LLMEngine` (`max_num_seqs`,
    `max_model_len`, `page_size`, `num_pages`, `kv_cache_bytes`, ...). `tensor_parallel_size=N`
    runs the model over N processes (one GPU each), driven from this one (`sparsegen.tp_engine`)."""

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
            raise InputError(f"model={str(model)!r} is not a folder")
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
        if tensor_parallel_size != 1:  # ranks in their own processes (sparsegen.tp_engine)
            from .tp_engine import tp_engine_for

            self.engine = tp_engine_for(model, random, tokenizer, dev, resolve_dtype(dtype, dev), force_dense,
                                        seed, tensor_parallel_size, engine_options)  # fmt: skip
            tok, model_config = self.engine.tokenizer, self.engine.model_config
        else:
            net, tok = build_model(
                model, random, tokenizer, dev, resolve_dtype(dtype, dev), force_dense, seed
            )
            self.engine, model_config = LLMEngine(net, tokenizer=tok, **engine_options), net.config
        self.tensor_parallel_size = tensor_parallel_size
        self.model_name = str(model) if model is not None else f"random-{random}"
        self.tokenizer = tok
        vocab = model_config.vocab_size
        self.vocab_size = vocab
        folder = Path(model) if model is not None else None
        self.chat_template = ChatTemplate.from_folder(folder)
        self.eos_token_ids = turn_end_ids(folder, tok, self.engine.eos_token_id, vocab)
        self.special_ids = frozenset(tok.special_tokens.values()) if tok is not None else frozenset()
        self._ids = itertools.count()

    # -- building requests (shared with the server) --------------------------------------------
    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def stats(self) -> EngineStats:
        """The engine's queue, batch and KV-cache occupancy (with tensor parallelism, rank 0's
        after the last call)."""
        return self.engine.stats() if self.tensor_parallel_size != 1 else engine_stats(self.engine)

    def encode(self, prompt, where: str = "prompt") -> list[int]:
        """Token ids of a str (encoded) or a list of ids (checked)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InputError(f"{where} is text, but this checkpoint has no tokenizer: pass token ids")
            prompt = self.tokenizer.encode(check_utf8(prompt, where, InputError))
        elif not isinstance(prompt, (list, tuple)):
            raise InputError(f"{where} must be a str or a list of token ids, got {type(prompt).__name__}")
        ids = check_prompt(prompt, self.vocab_size, where)  # the engine's checks: ints in the vocabulary
        if len(ids) >= self.max_model_len:
            raise InputError(
                f"{where} has {len(ids)} tokens; the model takes at most {self.max_model_len - 1}"
            )
        return ids

    def render_chat(self, messages, add_generation_prompt: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise InputError("chat needs a tokenizer, and this checkpoint has none")
        return self.encode(self.chat_template.render(messages, add_generation_prompt), "messages")

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
        return params

    def trackers(self, params: SamplingParams) -> tuple[list[SamplingParams], list[CompletionTracker]]:
        children = child_params(params, self.eos_token_ids[1:])
        eos = frozenset(self.eos_token_ids)
        return children, [
            CompletionTracker(i, p, self.tokenizer, eos, self.special_ids) for i, p in enumerate(children)
        ]

    # -- offline API ---------------------------------------------------------------------------
    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order. Everything is checked before anything runs."""
        if isinstance(prompts, str):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise InputError("prompts must be a str, a non-empty list of str, or a list of token-id lists")
        if all(isinstance(p, int) and not isinstance(p, bool) for p in prompts):
            raise InputError("prompts is a flat list of ints: pass token ids as a list of lists, [[1, 2, 3]]")
        ids = [self.encode(p, f"prompts[{i}]") for i, p in enumerate(prompts)]
        texts = [p if isinstance(p, str) else None for p in prompts]
        return self._run(ids, texts, params, use_tqdm)

    def chat(
        self,
        messages,
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """`messages` is one conversation (a list of {"role", "content"}) or a list of them."""
        if isinstance(messages, (list, tuple)) and messages and isinstance(messages[0], dict):
            messages = [messages]
        if not isinstance(messages, (list, tuple)) or not messages:
            raise InputError("messages must be a conversation (a list of dicts) or a list of conversations")
        ids = [self.render_chat(m, add_generation_prompt) for m in messages]
        texts = [self.tokenizer.decode(x) for x in ids]
        return self._run(ids, texts, params, use_tqdm)

    def _run(self, ids, texts, params, use_tqdm) -> list[RequestOutput]:
        if params is None:
            params = SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(ids)
        if not isinstance(params, (list, tuple)) or len(params) != len(ids):
            raise InputError(f"params must be one SamplingParams or a list of {len(ids)} (one per prompt)")
        params = [self.check_params(p, f"params[{i}]") for i, p in enumerate(params)]
        flat_ids, flat_params, owners, trackers = [], [], [], []
        for r, (x, p) in enumerate(zip(ids, params, strict=True)):
            children, ts = self.trackers(p)
            flat_ids += [x] * len(children)
            flat_params += children
            owners += [r] * len(children)
            trackers += ts
        engine = self.engine
        seqs = engine.submit(flat_ids, flat_params)  # checks all, then queues all
        live = {i for i in range(len(seqs))}
        bar = _progress(len(ids), use_tqdm)
        left = [len(self.trackers_of(owners, r)) for r in range(len(ids))]
        try:
            while live:
                for event in engine.step():
                    i = event.index
                    if i not in live:
                        continue
                    if event.error is not None:  # failed inside a step: the call fails
                        raise event.error
                    t = trackers[i]
                    t.add(event.token_id, event.finish_reason, event.logprobs)
                    if t.finished:
                        live.discard(i)
                        if event.finish_reason is None:
                            engine.abort(seqs[i].seq_id)  # a stop string ended it
                        left[owners[i]] -= 1
                        if bar is not None and left[owners[i]] == 0:
                            bar.update(1)
        finally:
            for i in live:
                engine.abort(seqs[i].seq_id)
            if bar is not None:
                bar.close()
        if self.tensor_parallel_size != 1:
            engine.results(seqs)  # the ranks keep each submitted request until its result is taken
        base = next(self._ids)
        return [
            RequestOutput(
                request_id=f"{base}-{r}",
                prompt=texts[r],
                prompt_token_ids=list(ids[r]),
                outputs=[trackers[i].output() for i in self.trackers_of(owners, r)],
            )
            for r in range(len(ids))
        ]

    @staticmethod
    def trackers_of(owners: list[int], r: int) -> list[int]:
        return [i for i, o in enumerate(owners) if o == r]


def _progress(total: int, use_tqdm: bool):
    if not use_tqdm:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm is optional: no bar without it
        return None
    return tqdm(total=total, desc="Processed prompts", unit="prompt", dynamic_ncols=True)
