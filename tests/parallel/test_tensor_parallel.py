"""Tensor parallelism on the CPU (gloo): N spawned ranks give the tokens of one process.

Each tensor-parallel `LLMEngine` spawns N Python processes (a few seconds each on a 2-core
machine), so every engine here is started once and asked several things. What the ranks hold is
asked through `engine.executor.call` (functions in helpers_tp).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch
from helpers.checkpoint import write_checkpoint
from helpers.tp import WIDE_HF_CONFIG, die_on_forward, exited, hang_on_forward, last_logits, rank_facts

from sparsegen import DistributedError
from sparsegen.engine import LLMEngine, SamplingParams
from sparsegen.engine.stats import engine_stats
from sparsegen.models import load_checkpoint
from sparsegen.parallel.source import ModelSource

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("single_thread")]  # each test spawns ranks

# Longer than local_blocks * block_size = 32 tokens, so that vertical-stride blocks (whose
# offsets follow the global head numbers) decide what the sparse layers see.
PROMPTS = [list(range(1, 90)), [5, 6, 7], [(7 * i) % 250 for i in range(61)]]
ENGINE = dict(max_num_batched_tokens=64, page_size=16)  # 89 tokens: a chunked prefill over a prefix
GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.9, top_k=40, seed=1234)


def tp_engine(folder, tp: int, **kw) -> LLMEngine:
    return LLMEngine(
        ModelSource(model_dir=str(folder)), tensor_parallel_size=tp, device="cpu", **ENGINE, **kw
    )


def reference(folder, params):
    engine = LLMEngine(load_checkpoint(folder, dtype=torch.float32), **ENGINE)
    return [r.token_ids for r in engine.generate(PROMPTS, params)]


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    # Its own lm_head: tied to random embeddings, greedy decoding would only repeat the last token.
    return write_checkpoint(tmp_path_factory.mktemp("tp-tiny"), with_lm_head=True, seed=3)


@pytest.fixture(scope="module")
def tp2(tiny_ckpt):
    with tp_engine(tiny_ckpt, 2) as engine:
        yield engine


def test_tp2_greedy_and_seeded_tokens_equal_one_process(tp2, tiny_ckpt):
    want_greedy, want_sampled = reference(tiny_ckpt, GREEDY), reference(tiny_ckpt, SAMPLED)
    assert len({tuple(t) for t in want_greedy}) == 3 and len(set(want_greedy[0])) > 3  # not degenerate
    events = []
    got = tp2.generate(PROMPTS, GREEDY, on_token=events.append)
    assert [r.token_ids for r in got] == want_greedy
    assert [r.prompt_token_ids for r in got] == PROMPTS
    assert sorted((e.index, e.token_id) for e in events) == sorted(
        (i, t) for i, ids in enumerate(want_greedy) for t in ids
    )
    assert [r.token_ids for r in tp2.generate(PROMPTS, SAMPLED)] == want_sampled


def test_tp2_refused_requests_and_aborts_keep_the_ranks_in_step(tp2, tiny_ckpt):
    from sparsegen import InputError

    with pytest.raises(InputError, match="prompt 1 token 999"):  # every rank refuses it alike and goes on
        tp2.submit([[1, 2], [5, 999]], GREEDY)
    seen = []

    def stop_second_after_three(event):  # as a stop string does: abort from the callback
        if event.index == 1:
            seen.append(event.token_id)
            if len(seen) == 3:
                assert tp2.abort(event.request_id)

    got = [r.token_ids for r in tp2.generate(PROMPTS, GREEDY, on_token=stop_second_after_three)]
    want = reference(tiny_ckpt, GREEDY)
    assert got[1] == want[1][:3] and got[0] == want[0] and got[2] == want[2]
    stats = engine_stats(tp2)  # the refused and the aborted requests hold no page
    assert stats.kv_pages_used == 0 and stats.running == stats.waiting == 0 and not tp2.has_unfinished
    assert [r.token_ids for r in tp2.generate(PROMPTS, GREEDY)] == want  # still in step


def test_tp2_what_cannot_be_pickled_is_an_error_not_a_hang(tp2):
    from helpers.tp import unpicklable_result

    from sparsegen import InputError

    with pytest.raises(InputError, match="cannot be sent between tensor-parallel processes"):
        tp2.executor.call(lambda ctx: 1)  # refused before it is sent
    with pytest.raises(InputError, match="the result of 'call' cannot be sent"):
        tp2.executor.call(unpicklable_result)
    assert [f["rank"] for f in tp2.executor.call(rank_facts)] == [0, 1]  # every rank went on


def test_tp2_logits_match_the_whole_model(tp2, tiny_ckpt):
    whole = load_checkpoint(tiny_ckpt, dtype=torch.float32)
    from sparsegen.models import ForwardBatch

    with torch.inference_mode():
        want = whole(torch.tensor(PROMPTS[0]), ForwardBatch.whole_sequences([len(PROMPTS[0])]))[-1]
    got = tp2.executor.call(last_logits, PROMPTS[0])
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_tp2_ranks_hold_global_heads_and_their_own_kv_groups(tp2):
    facts = tp2.executor.call(rank_facts)
    assert [f["rank"] for f in facts] == [0, 1]
    whole = facts[0]["global_offsets"]
    assert whole == facts[1]["global_offsets"]
    assert whole[0] == [0, 1, 2, 3]  # layer 0 is sparse: offsets h * 1 of the 4 global heads
    for f in facts:
        r = f["rank"]
        # rank r holds global heads 2r, 2r+1 (KV group r): its offsets are theirs, not 0, 1
        assert f["offsets"] == [layer[2 * r : 2 * r + 2] for layer in whole]
        assert f["attn_layer_offsets"] == f["offsets"]
        assert f["num_heads"] == 2
        assert f["kv_cache_shape"][2] == 1  # one of the 2 KV heads
        assert f["lm_head_rows"] == 272 // 2
    assert facts[1]["offsets"][0] == [2, 3]
    assert facts[0]["num_pages"] == facts[1]["num_pages"]


def test_tp4_wide_config_with_padded_vocab(tmp_path):
    folder = write_checkpoint(tmp_path / "wide", cfg=WIDE_HF_CONFIG, with_lm_head=True, seed=5)
    want = reference(folder, GREEDY)
    with tp_engine(folder, 4) as engine:
        got = [r.token_ids for r in engine.generate(PROMPTS, GREEDY)]
        facts = engine.executor.call(rank_facts)
    assert got == want
    assert [f["offsets"][0] for f in facts] == [[0, 1], [2, 3], [0, 1], [2, 3]]  # global h % 4
    assert [f["kv_cache_shape"][2] for f in facts] == [1, 1, 1, 1]
    assert {f["lm_head_rows"] for f in facts} == {68}  # ceil(270 / 4); the last rank pads 2 rows


def _all_gone(engine) -> bool:
    return all(p.exitcode is not None for p in engine.executor.procs)


def test_a_rank_that_dies_stops_the_others_with_a_clear_error(tiny_ckpt):
    engine = tp_engine(tiny_ckpt, 2)
    try:
        engine.executor.call(die_on_forward, 1, 3, 7)
        start = time.monotonic()
        with pytest.raises(DistributedError, match=r"rank 1 exited with code 7") as info:
            engine.generate(PROMPTS, GREEDY)
        assert time.monotonic() - start < 15
        assert "stopped" in str(info.value)
        assert _all_gone(engine)
        with pytest.raises(DistributedError, match="closed"):
            engine.generate(PROMPTS, GREEDY)
        assert not engine.has_unfinished  # the failed call's requests were aborted in the driver
        assert engine.cache.allocator.num_free == engine.cache.allocator.capacity
    finally:
        engine.close(kill=True)


def test_a_rank_that_hangs_is_ended_by_the_collective_timeout(tiny_ckpt):
    engine = tp_engine(tiny_ckpt, 2, collective_timeout_s=3)
    try:
        engine.executor.call(hang_on_forward, 1)
        start = time.monotonic()
        with pytest.raises(DistributedError, match=r"rank 0: all-reduce failed"):
            engine.generate(PROMPTS, GREEDY)
        assert time.monotonic() - start < 3 + 15
        assert _all_gone(engine)  # the stalled rank was stopped too
    finally:
        engine.close(kill=True)


def test_cli_generate_tp2_prints_the_tokens_of_tp1():
    from click.testing import CliRunner

    from sparsegen.cli import cli

    args = ["generate", "--random", "tiny", "--prompt", "hello world, " * 4, "--prompt-ids", "1,2,3",
            "--max-tokens", "6", "--json", "--device", "cpu", "--ignore-eos", "--no-warmup"]  # fmt: skip
    one = CliRunner().invoke(cli, args, catch_exceptions=False)
    two = CliRunner().invoke(cli, [*args, "--tp", "2"], catch_exceptions=False)
    assert one.exit_code == 0 and two.exit_code == 0, (one.output, two.output)
    rows = [[json.loads(line) for line in r.stdout.splitlines()] for r in (one, two)]
    assert [x["output_ids"] for x in rows[0]] == [x["output_ids"] for x in rows[1]]
    assert len(rows[1]) == 2 and all(len(x["output_ids"]) == 6 for x in rows[1])


def test_a_tp2_command_ends_without_a_leaked_semaphore_warning():
    """The ranks log through tqdm (torch loads it), whose default lock is a named semaphore
    registered with the driver's resource tracker; a rank that left without unregistering it made
    the tracker warn at the driver's exit."""
    env = {k: v for k, v in os.environ.items() if k != "SPARSEGEN_QUIET"}
    env["SPARSEGEN_LOG_LEVEL"] = "info"  # the ranks log their KV cache: the lines that took the lock
    args = [sys.executable, "-m", "sparsegen", "generate", "--random", "tiny", "--prompt-ids", "1,2,3",
            "--tp", "2", "--device", "cpu", "--max-tokens", "3", "--no-warmup", "--json"]  # fmt: skip
    res = subprocess.run(args, capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stderr
    assert len(json.loads(res.stdout)["output_ids"]) == 3
    assert res.stderr.count("KV cache:") == 2  # both ranks logged
    assert "leaked" not in res.stderr and "resource_tracker" not in res.stderr, res.stderr


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads process states from /proc")
def test_ranks_exit_when_their_driver_is_killed():
    driver = (
        "import os\n"
        "from sparsegen.engine import LLMEngine\n"
        "from sparsegen.parallel.source import ModelSource\n"
        "engine = LLMEngine(ModelSource(random='tiny'), tensor_parallel_size=2, device='cpu')\n"
        "print(' '.join(str(p.pid) for p in engine.executor.procs), flush=True)\n"
        "os._exit(9)\n"  # like a SIGKILL: no finalizer stops the ranks
    )
    res = subprocess.run([sys.executable, "-c", driver], capture_output=True, text=True, timeout=120,
                         env={**os.environ})  # fmt: skip
    assert res.returncode == 9, res.stderr
    pids = [int(p) for p in res.stdout.split()]
    assert len(pids) == 2
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and not all(exited(p) for p in pids):
        time.sleep(0.2)
    assert all(exited(p) for p in pids), "ranks outlived their driver"


def test_llm_tensor_parallel_size_2_equals_one_process():
    from sparsegen import LLM
    from sparsegen.engine import SamplingParams as SP

    prompts = ["the quick brown fox " * 4, [1, 2, 3]]
    plain = SP(max_tokens=8, ignore_eos=True)
    one = LLM(random="tiny", device="cpu")
    want = [o.token_ids for o in one.generate(prompts, plain, use_tqdm=False)]
    text = one.generate(prompts[:1], plain, use_tqdm=False)[0].text
    stop = SP(max_tokens=8, ignore_eos=True, stop=[text[3:5]])  # a stop string inside the text
    want_stop = one.generate(prompts[:1], stop, use_tqdm=False)[0]
    two = LLM(random="tiny", device="cpu", tensor_parallel_size=2)
    try:
        assert [o.token_ids for o in two.generate(prompts, plain, use_tqdm=False)] == want
        got = two.generate(prompts[:1], stop, use_tqdm=False)[0]  # the LLM aborts on the stop string
        assert (
            (got.text, got.finish_reason) == (want_stop.text, want_stop.finish_reason) == (text[:3], "stop")
        )
        assert [o.token_ids for o in two.generate(prompts, plain, use_tqdm=False)] == want
    finally:
        two.close()
