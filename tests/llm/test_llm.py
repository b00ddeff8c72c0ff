"""`sparsegen.LLM`: prompts in, text out; stop strings, n with seeds, logprobs, chat templates."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.checkpoint import write_bpe_file, write_checkpoint

import sparsegen
from sparsegen import LLM, SamplingParams
from sparsegen.errors import InputError
from sparsegen.llm.chat import PHI3SMALL_CHAT_TEMPLATE, ChatTemplate
from sparsegen.models import ForwardBatch

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def llm():
    return LLM(random="tiny", max_num_seqs=8)


def ascii_run(ids: list[int], length: int) -> int:
    """Index j such that ids[j-length+1..j] are printable ASCII bytes, preceded by byte tokens only."""
    for j in range(length - 1, len(ids)):
        if all(t < 256 for t in ids[: j + 1]) and all(32 <= t < 127 for t in ids[j - length + 1 : j + 1]):
            return j
    raise AssertionError(f"no ASCII run of {length} in {ids}")


def test_generate_returns_text_and_ids_in_order(llm):
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    outs = llm.generate(["Hello", "abc", "Hello"], params, use_tqdm=False)
    assert [o.prompt for o in outs] == ["Hello", "abc", "Hello"]
    assert outs[0].prompt_token_ids == list(b"Hello")
    assert outs[0].token_ids == outs[2].token_ids and len(outs[0].token_ids) == 10
    assert outs[0].finish_reason == "length" and outs[0].outputs[0].index == 0
    ids_out = llm.generate([list(b"Hello")], params, use_tqdm=False)[0]
    assert ids_out.token_ids == outs[0].token_ids and ids_out.prompt is None
    direct = llm.engine.generate([list(b"Hello")], params)[0].token_ids  # the token engine itself
    assert outs[0].token_ids == direct
    text = b"".join(bytes([t]) for t in direct if t < 256).decode("utf-8", errors="replace")
    assert outs[0].text == text
    assert sparsegen.LLM is LLM and sparsegen.SamplingParams is SamplingParams


def test_stop_string_spanning_two_tokens(llm):
    prompt = "The quick brown fox"
    base = llm.generate(prompt, SamplingParams(max_tokens=48, ignore_eos=True), use_tqdm=False)[0]
    ids = base.token_ids
    j = ascii_run(ids, 2)  # one token per byte: the stop string spans tokens j-1 and j
    stop = bytes(ids[j - 1 : j + 1]).decode()
    upto = b"".join(bytes([t]) for t in ids[: j + 1]).decode("utf-8", errors="replace")
    first = upto.find(stop)
    got = llm.generate(
        prompt, SamplingParams(max_tokens=48, ignore_eos=True, stop=["\x00never", stop]), use_tqdm=False
    )[0]
    out = got.outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == upto[:first] and stop not in out.text
    assert out.token_ids == ids[: len(out.token_ids)] and len(out.token_ids) <= j + 1
    assert llm.engine.cache.allocator.num_free == llm.engine.cache.allocator.capacity  # aborted, pages back
    late = SamplingParams(max_tokens=48, ignore_eos=True, stop=[stop], min_tokens=j + 2)
    longer = llm.generate(prompt, late, use_tqdm=False)[0]  # no stop string before min_tokens (vLLM)
    assert len(longer.token_ids) > j + 1 and longer.token_ids == ids[: len(longer.token_ids)]


def test_n_completions_with_a_seed_are_reproducible(llm):
    params = SamplingParams(n=3, max_tokens=12, temperature=1.0, seed=5, ignore_eos=True)
    a = llm.generate(["Once upon"], params, use_tqdm=False)[0]
    b = llm.generate(["Once upon"], params, use_tqdm=False)[0]
    assert len(a.outputs) == 3 and [o.index for o in a.outputs] == [0, 1, 2]
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert len({tuple(o.token_ids) for o in a.outputs}) == 3  # seeds 5, 6, 7 differ
    single = SamplingParams(max_tokens=12, temperature=1.0, seed=6, ignore_eos=True)
    assert llm.generate(["Once upon"], single, use_tqdm=False)[0].token_ids == a.outputs[1].token_ids
    mixed = llm.generate(["xyz", "Once upon"], [SamplingParams(max_tokens=3), params], use_tqdm=False)
    assert [o.token_ids for o in mixed[1].outputs] == [o.token_ids for o in a.outputs]


def test_logprobs_match_a_reference_log_softmax(llm):
    prompt = list(b"logprobs!")
    params = SamplingParams(max_tokens=6, logprobs=3, ignore_eos=True)
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == len(out.token_ids) == 6
    model = llm.engine.model
    seq = list(prompt)
    total = 0.0
    for tok, lp in zip(out.token_ids, out.logprobs, strict=True):
        with torch.inference_mode():
            logits = model(torch.tensor(seq), ForwardBatch.whole_sequences([len(seq)]))[-1]
        ref = torch.log_softmax(logits.double(), dim=-1)
        assert lp.token_id == tok and lp.logprob <= 0
        assert lp.logprob == pytest.approx(float(ref[tok]), abs=1e-4)
        assert [t for t, _ in lp.top] == ref.topk(3).indices.tolist()
        assert [x for _, x in lp.top] == pytest.approx(ref.topk(3).values.tolist(), abs=1e-4)
        total += lp.logprob
        seq.append(tok)
    assert out.cumulative_logprob == pytest.approx(total) and total <= 0


def test_chat_uses_phi3_format_by_default_and_stops_on_end(llm):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = ChatTemplate(PHI3SMALL_CHAT_TEMPLATE).render(msgs)
    assert text == "<|endoftext|><|system|>\nBe brief.<|end|>\n<|user|>\nHi<|end|>\n<|assistant|>\n"
    out = llm.chat(msgs, SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    assert out.prompt_token_ids == llm.tokenizer.encode(text)
    end = llm.tokenizer.special_tokens["<|end|>"]
    assert llm.eos_token_ids == (256, end)  # random weights: as Phi-3-Small-instruct's generation_config
    two = llm.chat([msgs, msgs[1:]], SamplingParams(max_tokens=4), use_tqdm=False)
    assert len(two) == 2 and two[0].prompt_token_ids == out.prompt_token_ids


def test_checkpoint_chat_template_and_generation_config(tmp_path):
    folder = write_checkpoint(tmp_path / "ckpt")
    write_bpe_file(folder / "tiny.tiktoken")
    template = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}>>{% endif %}"
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    llm = LLM(model=folder)
    msgs = [{"role": "user", "content": "hello world"}]
    assert llm.render_chat(msgs) == llm.tokenizer.encode("[user]hello world>>")
    free = llm.generate("hello", SamplingParams(max_tokens=20, ignore_eos=True), use_tqdm=False)[0].token_ids
    stop = next(t for t in free[2:] if t != llm.engine.eos_token_id)
    k = free.index(stop)
    (folder / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [llm.engine.eos_token_id, stop]})
    )
    llm2 = LLM(model=folder)
    assert llm2.eos_token_ids == (llm.engine.eos_token_id, stop)
    got = llm2.generate("hello", SamplingParams(max_tokens=20), use_tqdm=False)[0]
    assert (
        got.token_ids == free[: k + 1] and got.finish_reason == "stop" and got.outputs[0].stop_reason is None
    )
    ignored = llm2.generate("hello", SamplingParams(max_tokens=20, ignore_eos=True), use_tqdm=False)[0]
    assert ignored.token_ids == free  # ignore_eos also ignores generation_config's EOS list
    early = llm2.generate("hello", SamplingParams(max_tokens=20, min_tokens=k + 1), use_tqdm=False)[0]
    assert len(early.token_ids) > k + 1 and stop not in early.token_ids[: k + 1]


def test_bad_arguments_are_typed_errors(llm, tmp_path):
    cases = [
        lambda: LLM(),
        lambda: LLM(random="huge"),
        lambda: LLM(random="tiny", model=tmp_path),
        lambda: LLM(model=tmp_path / "missing"),
        lambda: LLM(random="tiny", dtype="int8"),
        lambda: LLM(random="tiny", device="tpu"),
        lambda: LLM(random="tiny", max_num_seq=3),
        lambda: llm.generate([], use_tqdm=False),
        lambda: llm.generate([1, 2, 3], use_tqdm=False),
        lambda: llm.generate([[1, 2], [3, 99999]], use_tqdm=False),
        lambda: llm.generate([[1, True]], use_tqdm=False),
        lambda: llm.generate([""], use_tqdm=False),
        lambda: llm.generate(["a"], SamplingParams(stop_token_ids=(10**6,)), use_tqdm=False),
        lambda: llm.generate(["a", "b"], [SamplingParams()], use_tqdm=False),
        lambda: llm.generate(["a"], {"max_tokens": 3}, use_tqdm=False),
        lambda: llm.generate(["x" * 5000], use_tqdm=False),
        lambda: llm.chat([{"role": "robot", "content": "hi"}], use_tqdm=False),
        lambda: llm.chat([{"role": "user", "content": 3}], use_tqdm=False),
        lambda: llm.chat([], use_tqdm=False),
    ]
    for i, case in enumerate(cases):
        with pytest.raises(InputError):
            case()
        assert llm.engine.cache.allocator.num_free == llm.engine.cache.allocator.capacity, i
        assert not llm.engine.has_unfinished, i


def test_sandboxed_template_cannot_reach_python():
    evil = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(InputError, match="chat template"):
        ChatTemplate(evil).render([{"role": "user", "content": "x"}])
    with pytest.raises(InputError, match="does not compile"):
        ChatTemplate("{% for %}")
    with pytest.raises(InputError, match="failed"):
        ChatTemplate("{{ raise_exception('no system role') }}").render([{"role": "user", "content": "x"}])


def test_penalties_min_p_and_top_k_run_through_the_engine(llm):
    prompt = [list(b"aaaa")]
    plain = llm.generate(prompt, SamplingParams(max_tokens=24, ignore_eos=True), use_tqdm=False)[0].token_ids
    rep = SamplingParams(max_tokens=24, ignore_eos=True, repetition_penalty=5.0, frequency_penalty=2.0)
    penalised = llm.generate(prompt, rep, use_tqdm=False)[0].token_ids
    assert len(set(penalised)) > len(set(plain))  # fewer repeats
    hot = SamplingParams(max_tokens=8, temperature=1.0, top_k=-1, min_p=0.5, seed=3, ignore_eos=True)
    a = llm.generate(prompt, hot, use_tqdm=False)[0].token_ids
    assert a == llm.generate(prompt, hot, use_tqdm=False)[0].token_ids
    assert llm.engine.cache.allocator.num_free == llm.engine.cache.allocator.capacity


def test_a_checkpoint_without_a_tokenizer_takes_and_gives_token_ids(tmp_path):
    llm = LLM(model=write_checkpoint(tmp_path / "bare"))
    assert llm.tokenizer is None
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.token_ids) == 4 and out.text is None
    for bad in (lambda: llm.generate("text"), lambda: llm.chat([{"role": "user", "content": "x"}]),
                lambda: llm.generate([[1]], SamplingParams(stop=["x"]))):  # fmt: skip
        with pytest.raises(InputError, match="tokenizer"):
            bad()
