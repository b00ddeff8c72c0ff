"""`ModelRunner`: the model's side of the engine. It sizes and allocates the paged KV cache, turns
a scheduler `Plan` into token ids and a `ForwardBatch` (positions, cache slots, block tables,
the LongRoPE factor choice), runs the forward pass (replaying a CUDA graph for decode steps on
a GPU), and samples the rows that reached the end of their sequence.

    runner = ModelRunner(model, EngineConfig(page_size=16), max_model_len=4096)
    logits = runner.run(plan)                # [len(plan.sampled), vocab] float32
    step = runner.launch(plan, None, eos)    # run + sample, tokens still on the device
    step.output().token_ids                  # read back
    runner.kv_capacity                       # (pages, tokens) usable by sequences

It is the in-process `engine.executor.Executor`: `LLMEngine` calls `launch` directly. With
tensor parallelism every rank runs one over its shard (`parallel.rank`).
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import replace

import numpy as np
import torch

from ..errors import InputError
from ..log import get_logger
from ..models.batch import ForwardBatch
from ..models.memory import check_fits, gpu_cache_bytes, prefill_activation_bytes
from ..models.phi3small import Phi3SmallForCausalLM
from ..request.sequence import Chunk, Plan, Sequence
from .config import EngineConfig
from .cuda_graphs import DecodeGraphs
from .decode_inputs import DecodeInputs, padded_tables
from .inflight import InFlight
from .isolation import sample_isolating
from .kv_cache import KVCache, set_checkpoint_scales
from .prompt_logprobs import score_prompt, scored_rows
from .sampling import DeviceSample
from .transfer import packed_to_device

log = get_logger(__name__)

CPU_KV_CACHE_BYTES = 256 << 20
GPU_MEMORY_FRACTION = 0.9
# What a default-sized GPU cache leaves free: a prefill step's activations plus this (logits,
# CUDA graphs, the allocator's slack), and never less than GPU_MIN_HEADROOM_BYTES.
GPU_OVERHEAD_BYTES = 2 << 30
GPU_MIN_HEADROOM_BYTES = 6 << 30
MEMORY_ADVICE = (
    "use fewer KV pages (num_pages or kv_cache_bytes) or fewer prefill tokens a step "
    "(max_num_batched_tokens; --chunk-size on the command line)"
)


def max_step_tokens(config: EngineConfig, max_model_len: int) -> int:
    """The most tokens one prefill step holds: max_num_batched_tokens, and no more than the seats
    hold."""
    return min(config.max_num_batched_tokens, config.max_num_seqs * max_model_len)


def step_activation_bytes(model: Phi3SmallForCausalLM, prefill_tokens: int) -> int:
    return prefill_activation_bytes(model.config, model.dtype, prefill_tokens)


def kv_bytes_per_page(model: Phi3SmallForCausalLM, page_size: int, dtype: torch.dtype | None = None) -> int:
    """Bytes of one page over every layer, K and V, in the cache's `dtype` (default the model's;
    an fp8 cache counts one byte an element)."""
    cfg = model.config
    return KVCache.bytes_per_page(
        cfg.num_hidden_layers, page_size, model.local_num_kv_heads, cfg.head_dim, dtype or model.dtype
    )


def default_num_pages(
    model: Phi3SmallForCausalLM, page_size: int, kv_cache_bytes: int | None, prefill_tokens: int,
    dtype: torch.dtype | None = None, gpu_memory_utilization: float | None = None,
) -> int:  # fmt: skip
    """Pages that `kv_cache_bytes` holds; by default, on a GPU, 90 % of its free memory less a
    headroom for a prefill step of `prefill_tokens` tokens, or with `gpu_memory_utilization`
    vLLM's rule (`models.memory.gpu_cache_bytes`: that share of the whole GPU for the weights, the
    cache and the headroom); on a CPU 256 MiB (gpu_memory_utilization does not apply there)."""
    per_page = kv_bytes_per_page(model, page_size, dtype)
    if kv_cache_bytes is None:
        if model.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(model.device)
            act = step_activation_bytes(model, prefill_tokens)
            headroom = max(GPU_MIN_HEADROOM_BYTES, act + GPU_OVERHEAD_BYTES)
            if gpu_memory_utilization is not None:
                held = torch.cuda.memory_reserved(model.device)
                kv_cache_bytes = gpu_cache_bytes(free, total, held, headroom, gpu_memory_utilization)
            else:
                kv_cache_bytes = max(int(free * GPU_MEMORY_FRACTION) - headroom, 2 * per_page)
        else:
            kv_cache_bytes = CPU_KV_CACHE_BYTES
    pages = kv_cache_bytes // per_page
    if pages < 2:
        raise InputError(
            f"kv_cache_bytes={kv_cache_bytes} holds {pages} pages of {per_page} bytes; the cache needs at least 2"
        )
    return pages


COMPILE_BACKEND = "inductor"  # what compile_model uses (the CPU tests swap in "aot_eager": no codegen)


def compiled_decode(model: Phi3SmallForCausalLM) -> Callable[..., torch.Tensor]:
    """The model's forward under torch.compile(fullgraph=True), for decode steps.

    Shapes: a decode batch is padded to a few batch sizes and block-table widths (the CUDA
    graphs' buckets). dynamo compiles the first shape it sees statically (batch 1 always is: a
    size-1 dimension is specialised); when a dimension changes it recompiles once with that
    dimension symbolic (automatic dynamic shapes), so a run compiles a handful of graphs, not one
    per bucket. Nothing but tensors, ints, bools and strs reaches the registered ops.
    """
    return torch.compile(model, fullgraph=True, backend=COMPILE_BACKEND)


def token_ids(seq: Sequence, start: int, stop: int) -> np.ndarray:  # [stop - start] int64
    """Tokens start..stop-1 of `seq` (prompt then output), without building the whole token list."""
    n = len(seq.prompt_ids)
    part = seq.prompt_ids[start:stop] + seq.output_ids[max(0, start - n) : max(0, stop - n)]
    return np.array(part, dtype=np.int64)


class ModelRunner:
    def __init__(self, model: Phi3SmallForCausalLM, config: EngineConfig, *, max_model_len: int):
        self.model = model
        cfg = model.config
        if config.dense_attention:  # every layer dense causal, its features kept (EngineConfig)
            model.set_force_dense(True)
            log.info(
                "attention forced dense: every layer of %s is dense causal (dense_attention)", model.spec.name
            )
        page_size = config.page_size
        tokens = max_step_tokens(config, max_model_len)
        kv_dtype = config.cache_dtype(model.dtype)
        pages = config.num_pages or default_num_pages(
            model, page_size, config.kv_cache_bytes, tokens, kv_dtype, config.gpu_memory_utilization
        )
        need = pages * kv_bytes_per_page(model, page_size, kv_dtype)
        check_fits(
            need + step_activation_bytes(model, tokens),
            model.device,
            f"a KV cache of {pages} pages of {page_size} tokens and a prefill step of {tokens} tokens",
            MEMORY_ADVICE,
        )
        self.cache = KVCache(
            num_layers=cfg.num_hidden_layers,
            num_pages=pages,
            page_size=page_size,
            num_kv_heads=model.local_num_kv_heads,  # a tensor-parallel rank holds its own groups only
            head_dim=cfg.head_dim,
            dtype=kv_dtype,
            device=model.device,
            layout=config.kv_layout,
        )
        set_checkpoint_scales(self.cache, getattr(model, "kv_scales", None))
        self.kv_cache_bytes = need
        if model.device.type == "cuda" and model.fused:  # the model's fused rotary: build it now
            from ..kernels.fused import rotary

            k0, v0, s0 = self.cache.k[0], self.cache.v[0], self.cache.scales[0]  # s0: an fp8 cache's scales
            rotary.warm_up_rotary(
                k0, v0, self.cache.scratch_page * page_size, cfg.group_size, s0, model.dtype
            )
        usable = self.cache.allocator.capacity
        log.info(
            "KV cache: %d pages of %d tokens = %d tokens (%.2f GiB, %s) on %s",
            usable, page_size, usable * page_size, need / 2**30, kv_dtype, model.device,
        )  # fmt: skip
        rs = cfg.rope_scaling
        self.long_rope_after = rs.original_max_position_embeddings if rs is not None else None
        # Decode steps may run the model under torch.compile: the sparsegen ops stay opaque nodes,
        # inductor fuses the rest (norms, residuals, rotary, GeGeLU) and the graphs capture it.
        self.decode_forward = compiled_decode(model) if config.compile_model else model
        self.graphs = None
        if config.use_cuda_graphs and model.device.type == "cuda":
            self.graphs = DecodeGraphs(
                model, self.cache, config.max_num_seqs, max_model_len, forward=self.decode_forward
            )

    @property
    def kv_capacity(self) -> tuple[int, int]:
        """(pages, tokens) that sequences can hold at once (the scratch page left out)."""
        pages = self.cache.allocator.capacity
        return pages, pages * self.cache.page_size

    def use_long_rope(self, seq: Sequence, start: int, stop: int) -> list[bool]:
        """LongRoPE factor choice per position, as HF makes it: prompt tokens by the prompt's
        length, each generated token by the length reached with it (chunking cannot change it)."""
        limit = self.long_rope_after
        n_prompt = len(seq.prompt_ids)
        return [max(n_prompt, p + 1) > limit for p in range(start, stop)]

    def long_rope_flags(self, seq: Sequence, start: int, stop: int) -> np.ndarray:  # [stop - start] bool
        """`use_long_rope` as an array, computed without a Python loop (prefill chunks)."""
        return np.maximum(np.arange(start + 1, stop + 1), len(seq.prompt_ids)) > self.long_rope_after

    def prepare_prefill(self, chunks: Seq[Chunk]) -> tuple[torch.Tensor, ForwardBatch]:
        """A prefill step as tensors on the model's device. Built on the host with numpy (nothing
        loops per token in Python, and torch's CPU thread pool is never woken), then moved in
        non-blocking copies from pinned memory: one for the int64 fields, one for the int32 ones
        (cu_seqlens, and the page tables and lengths of the sequences whose last row is sampled,
        which the model's last layer attends from alone), one for the LongRoPE flags. The host
        never waits for the device here, so the next chunk of a long prompt is prepared while the
        GPU still computes the last one."""
        dev, cache = self.model.device, self.cache
        has_prefix = any(c.start > 0 for c in chunks)
        ids, positions, slots, gather, use_long, last_rows = [], [], [], [], [], []
        sampled = [c for c in chunks if c.completes]  # their last rows are sampled
        cu_q, cu_k = [0], [0]
        for c in chunks:
            ids.append(token_ids(c.seq, c.start, c.stop))
            positions.append(np.arange(c.start, c.stop, dtype=np.int64))
            if has_prefix:  # every key's slot; the new tokens' slots are its tail
                gather.append(cache.slot_array(c.seq.pages, 0, c.stop))
                slots.append(gather[-1][c.start :])
            else:
                slots.append(cache.slot_array(c.seq.pages, c.start, c.stop))
            if self.long_rope_after is not None:
                use_long.append(self.long_rope_flags(c.seq, c.start, c.stop))
            cu_q.append(cu_q[-1] + c.stop - c.start)
            cu_k.append(cu_k[-1] + c.stop)
            if c.completes:
                last_rows.append(cu_q[-1] - 1)
        rows = np.array(last_rows, dtype=np.int64)
        # prompt_logprobs: the scored rows follow the sampled ones, and every row then runs the
        # last layer (its attention from just the sampled rows is for one row a sequence)
        scoring = any(c.scored_positions for c in chunks)
        if scoring:
            rows = np.concatenate([rows, scored_rows(chunks, cu_q)])
        fields = [np.concatenate(f) if f else None for f in (ids, positions, slots, gather)]
        if fields[3] is not None:  # flat slots -> (pages, offsets), the cache's two indices
            fields[3] = np.concatenate([fields[3] // cache.page_size, fields[3] % cache.page_size])
        ids_d, positions_d, slots_d, gather_d, rows_d = packed_to_device([*fields, rows], torch.long, dev)
        tables = padded_tables([c.seq.pages for c in sampled], cache.scratch_page)  # [sampled, width]
        ints = [np.array(cu_q, dtype=np.int32), np.array(cu_k, dtype=np.int32), tables.reshape(-1),
                np.array([c.stop for c in sampled], dtype=np.int32)]  # fmt: skip
        cu_seqlens_q, cu_seqlens_k, tables_d, lens_d = packed_to_device(ints, torch.int32, dev)
        long_d = None
        if self.long_rope_after is not None:
            (long_d,) = packed_to_device([np.concatenate(use_long)], torch.bool, dev)
        batch = ForwardBatch(
            is_decode=False,
            positions=positions_d,  # [T]
            use_long_rope=long_d,  # [T] or None
            logits_index=rows_d,  # [rows sampled (+ rows scored)]
            cu_seqlens_q=cu_seqlens_q,  # [B+1] int32
            cu_seqlens_k=cu_seqlens_k,  # [B+1] int32
            max_seqlen_q=max(c.stop - c.start for c in chunks),
            max_seqlen_k=max(c.stop for c in chunks),
            kv_gather=None if gather_d is None else gather_d.view(2, -1),  # [2, Tk] or None
            slot_mapping=slots_d,  # [T]
            sampled_block_tables=None if scoring else tables_d.view(tables.shape),  # [sampled, width] int32
            sampled_seq_lens=None if scoring else lens_d,  # [sampled] int32
        )
        return ids_d, batch  # ids: [T]

    def decode_inputs(self, chunks: Seq[Chunk]) -> DecodeInputs:
        """A decode step's inputs as host lists (no device work yet)."""
        ps, scratch = self.cache.page_size, self.cache.scratch_page
        seqs = [c.seq for c in chunks]
        width = max(len(s.pages) for s in seqs)
        positions = [c.start for c in chunks]  # len(s) - 1, or len(s) in a lookahead step
        use_long = None
        if self.long_rope_after is not None:
            use_long = [self.use_long_rope(s, p, p + 1)[0] for s, p in zip(seqs, positions, strict=True)]
        return DecodeInputs(
            # a lookahead step's tokens are on the device (Plan.input_ids): 0 stands in here
            ids=[s.last_token if c.completes else 0 for s, c in zip(seqs, chunks, strict=True)],
            positions=positions,
            slots=[s.pages[p // ps] * ps + p % ps for s, p in zip(seqs, positions, strict=True)],
            seq_lens=[p + 1 for p in positions],
            pages=[s.pages for s in seqs],
            keys=[(s.seq_id, s.page_epoch) for s in seqs],
            width=width,
            scratch=scratch,
            use_long=use_long,
        )

    def prepare_decode(
        self, chunks: Seq[Chunk], input_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, ForwardBatch]:
        return self.decode_inputs(chunks).to_batch(self.model.device, input_ids)

    @torch.inference_mode()
    def run(self, plan: Plan) -> torch.Tensor:  # [len(plan.sampled) (+ rows scored), vocab] float32
        if plan.is_decode:
            inputs = self.decode_inputs(plan.chunks)
            if self.graphs is not None and self.graphs.fits(len(plan.chunks)):
                return self.graphs.run(inputs, plan.input_ids)
            ids, batch = inputs.to_batch(self.model.device, plan.input_ids)
            return self.decode_forward(ids, batch, self.cache.layers)
        ids, batch = self.prepare_prefill(plan.chunks)
        return self.model(ids, batch, self.cache.layers)

    @torch.inference_mode()
    def launch(
        self, plan: Plan, after: InFlight | None, eos_token_id: int | None, read_back: bool = True
    ) -> InFlight:
        """Run `plan`'s forward pass and sampler without reading the tokens back. `after` is the
        in-flight step whose sampled tokens are `plan`'s input ids (a lookahead plan). The sampler
        runs in inference mode too, so that those ids are inference tensors like the ids a
        synchronous step builds (torch.compile would otherwise guard on the difference and
        recompile). `read_back=False` leaves the tokens on the device only (a tensor-parallel rank
        whose results nobody reads)."""
        if after is not None:
            plan = replace(plan, input_ids=after.tokens)
        logits = self.run(plan)
        seqs = plan.sampled
        # prompt log-probabilities (their rows follow the sampled ones): only for a host that reads
        prompt = score_prompt(logits[len(seqs) :], plan) if read_back and plan.scores_prompt else None
        logits = logits[: len(seqs)]  # [sampled, vocab]
        if not seqs:
            if prompt is None:
                return InFlight(plan, None, None)
            out = DeviceSample(torch.zeros(0, dtype=torch.long, device=logits.device), prompt=prompt)
            return InFlight(plan, out.token_ids, out.to_host())
        ahead = 1 if plan.lookahead else 0  # a lookahead row's previous token is not booked yet
        out = sample_isolating(  # a row whose sampling fails is named in out.failed, not raised
            logits,
            [s.params for s in seqs],
            [s.output_ids for s in seqs],
            [s.prompt_ids for s in seqs],
            eos_token_id=eos_token_id,
            num_generated=[len(s.output_ids) + ahead for s in seqs],
            token_bitmask=plan.token_bitmask,
        )
        if prompt is not None:
            out = replace(out, prompt=prompt)
        return InFlight(plan, out.token_ids, out.to_host() if read_back else None)

    def close(self, kill: bool = False) -> None:
        """Nothing to stop in this process (the executor interface's close)."""
