"""The one output path (`engine.outputs`, `engine.output_processor`) over a scripted engine:
stop strings across tokens, UTF-8 split over tokens, finish reasons, logprobs, aborts."""

from __future__ import annotations

import pytest

from sparsegen.commands.generate import cli_finish_reason
from sparsegen.engine import TokenEvent
from sparsegen.engine.output_processor import OutputProcessor, RequestState
from sparsegen.engine.outputs import Detokenizer
from sparsegen.errors import InputError
from sparsegen.request.sampling_params import SamplingParams, TokenLogprobs

EOS, END, USER = 100, 101, 102  # <|endoftext|>, <|end|> (a turn end), <|user|> (another special)


class Tok:
    """Token i is the bytes VOCAB[i]; three special tokens above 99."""

    VOCAB = {0: b"hel", 1: b"lo", 2: b" w", 3: b"orld", 4: b"\xc3", 5: b"\xa9", 6: b"!", 7: b"l"}
    special_tokens = {"<|endoftext|>": EOS, "<|end|>": END, "<|user|>": USER}

    def token_bytes(self, token_id: int) -> bytes:
        names = {i: s.encode() for s, i in self.special_tokens.items()}
        return names.get(token_id) or self.VOCAB[token_id]


class ScriptedEngine:
    """`steps[k]` is what step k returns, as (seq_id, token, engine reason); aborted sequences
    emit nothing more."""

    def __init__(self, steps, logprobs=False):
        self.steps = [list(s) for s in steps]
        self.aborted: list[int] = []
        self.logprobs = logprobs

    @property
    def has_unfinished(self) -> bool:
        return any(sid not in self.aborted for step in self.steps for sid, _, _ in step)

    def step(self) -> list[TokenEvent]:
        step = self.steps.pop(0)
        out = []
        for sid, tok, reason in step:
            if sid in self.aborted:
                continue
            lp = TokenLogprobs(tok, -0.5 * (len(out) + 1), ((tok, -0.1),)) if self.logprobs else None
            out.append(TokenEvent(sid, tok, reason, logprobs=lp, request_id=sid))
        return out

    def abort(self, seq_id: int) -> bool:
        self.aborted.append(seq_id)
        return True


def request(n=1, eos=(EOS,), **params) -> RequestState:
    detok = Detokenizer(Tok(), frozenset(eos))
    p = SamplingParams(max_tokens=50, **params)
    return RequestState("r", [[1]] * n, [detok.completion(i, p) for i in range(n)])


def run(engine, req, seq_ids=(0,)):
    processor = OutputProcessor(engine)
    processor.track(req, list(seq_ids))
    updates = []
    processor.run([req], on_update=lambda r, u: updates.append(u))
    return req.output().outputs, updates


def test_a_stop_string_across_tokens_is_cut_never_half_sent_and_aborts_the_sequence():
    engine = ScriptedEngine([[(0, t, None)] for t in (0, 1, 2, 3)])
    (out,), updates = run(engine, request(stop=["xyz", "lo w"]))
    assert (out.text, out.finish_reason, out.stop_reason) == ("hel", "stop", "lo w")
    assert out.token_ids == [0, 1, 2]  # the token that completed the stop string stays
    assert engine.aborted == [0] and engine.steps == [[(0, 3, None)]]  # ended by the processor
    # the last len("lo w") - 1 = 3 characters wait, so no part of the stop string is ever sent
    assert [u.text for u in updates] == ["", "he", "l"]
    assert [u.finish_reason for u in updates] == [None, None, "stop"] and updates[-1].stop_reason == "lo w"


def test_held_back_text_comes_out_as_the_text_grows_and_all_of_it_at_the_end():
    engine = ScriptedEngine([[(0, t, None)] for t in (0, 1, 6)] + [[(0, 3, "length")]])
    (out,), updates = run(engine, request(stop=["lo w"]))
    assert out.text == "hello!orld" and out.finish_reason == "length" and out.stop_reason is None
    # a running stream holds back its last len("lo w") - 1 = 3 characters; the end sends the rest
    assert [u.text for u in updates] == ["", "he", "l", "lo!orld"]


def test_a_character_split_over_tokens_waits_for_its_last_byte():
    engine = ScriptedEngine([[(0, 4, None)], [(0, 5, None)], [(0, 4, "length")]])
    (out,), updates = run(engine, request())
    assert [u.text for u in updates] == ["", "é", "\ufffd"]  # a cut-off character at the end shows as U+FFFD
    assert out.text == "é\ufffd"


@pytest.mark.parametrize(
    "last, reason, ignore_eos, want, cli",
    [
        ((EOS, "eos"), "stop", False, None, "eos"),  # the engine's EOS
        ((END, "stop"), "stop", False, None, "stop"),  # a generation_config turn end: EOS-like, not the EOS
        ((6, "stop"), "stop", False, 6, "stop"),  # a stop_token_ids entry
        ((EOS, "stop"), "stop", True, None, "stop"),  # ignore_eos with EOS listed as a stop token
        ((6, "length"), "length", False, None, "length"),
    ],
)
def test_finish_reasons_are_one_vocabulary(last, reason, ignore_eos, want, cli):
    engine = ScriptedEngine([[(0, 0, None)], [(0, *last)]])
    (out,), updates = run(engine, request(eos=(EOS, END), ignore_eos=ignore_eos))
    assert (out.finish_reason, out.stop_reason) == (reason, want)
    assert out.token_ids == [0, last[0]]
    ends_on_token = last[1] in ("eos", "stop")
    assert out.text == ("hel" if ends_on_token else "hel!")  # the ending token is not text
    assert updates[-1].finish_reason == reason and updates[-1].stop_reason == want
    assert cli_finish_reason(out, EOS, ignore_eos) == cli


def test_special_tokens_are_text_only_when_asked():
    steps = [[(0, 0, None)], [(0, USER, None)], [(0, 1, "length")]]
    (skipped,), _ = run(ScriptedEngine(steps), request())
    (kept,), _ = run(ScriptedEngine(steps), request(skip_special_tokens=False))
    (joined,), _ = run(
        ScriptedEngine(steps), request(skip_special_tokens=False, spaces_between_special_tokens=False)
    )
    # vLLM's spaces_between_special_tokens (default True): a shown special token is set apart
    assert skipped.text == "hello" and kept.text == "hel <|user|> lo" and joined.text == "hel<|user|>lo"


def test_spaces_between_special_tokens_only_where_one_is_shown():
    steps = [[(0, USER, None)], [(0, USER, None)], [(0, 0, None)], [(0, 1, "length")]]
    (two,), _ = run(ScriptedEngine(steps), request(skip_special_tokens=False))
    assert two.text == "<|user|> <|user|> hello"  # no space before the first piece, none inside text
    (skipped,), _ = run(ScriptedEngine(steps), request(spaces_between_special_tokens=True))
    assert skipped.text == "hello"  # hidden special tokens leave no space behind
    with pytest.raises(InputError, match="spaces_between_special_tokens"):
        SamplingParams(spaces_between_special_tokens=1)


def test_logprobs_stay_aligned_with_their_tokens():
    engine = ScriptedEngine([[(0, 0, None)], [(0, 1, None)], [(0, EOS, "eos")]], logprobs=True)
    (out,), updates = run(engine, request(logprobs=1))
    assert [lp.token_id for lp in out.logprobs] == out.token_ids == [0, 1, EOS]
    assert [u.logprobs[0].token_id for u in updates] == out.token_ids
    assert out.cumulative_logprob == pytest.approx(sum(lp.logprob for lp in out.logprobs))
    (plain,), _ = run(ScriptedEngine([[(0, 0, "length")]], logprobs=True), request())
    assert plain.logprobs is None and plain.cumulative_logprob is None


def test_a_request_finishes_with_its_last_completion_within_one_step():
    engine = ScriptedEngine(
        [[(0, 0, None), (1, 1, None), (9, 6, None)], [(1, 6, "length"), (0, 7, "length")]]
    )
    req = request(n=2)
    processor = OutputProcessor(engine)
    processor.track(req, [0, 1])
    seen = []
    for _ in range(2):
        seen += [(u.index, u.finish_reason, r.finished) for r, u in processor.process(engine.step())]
    # sequence 9 is not tracked: ignored; `finished` turns True at the last completion's update
    assert seen == [(0, None, False), (1, None, False), (1, "length", False), (0, "length", True)]
    assert not processor.live_requests()


def test_abort_ends_the_unfinished_completions_and_frees_their_sequences():
    engine = ScriptedEngine([[(0, 0, None), (1, 0, "length")], [(0, 1, None)], [(0, 2, None)]])
    req = request(n=2)
    processor = OutputProcessor(engine)
    processor.track(req, [0, 1])
    steps = processor.stream([req])
    next(steps), next(steps)  # both completions' first tokens; the second has finished
    steps.close()  # a caller that stops early
    assert engine.aborted == [0]  # only the unfinished one
    outs = req.output().outputs
    assert [o.finish_reason for o in outs] == ["abort", "length"] and outs[0].token_ids == [0]
    processor.abort(req)  # again: nothing left to abort
    assert engine.aborted == [0]


def test_a_sequence_aborted_from_outside_ends_abort_once_the_engine_is_idle():
    engine = ScriptedEngine([[(0, 0, None), (1, 0, None)], [(0, 1, None), (1, 1, "length")]])
    req = request(n=2)
    processor = OutputProcessor(engine)
    processor.track(req, [0, 1])
    processor.run([req], on_event=lambda e: e.request_id == 0 and engine.abort(0))
    outs = req.output().outputs
    assert [(o.finish_reason, o.token_ids) for o in outs] == [("abort", [0]), ("length", [0, 1])]


def test_an_exception_in_a_callback_aborts_the_request():
    engine = ScriptedEngine([[(0, 0, None)], [(0, 1, None)]])
    req = request()
    processor = OutputProcessor(engine)
    processor.track(req, [0])

    def boom(r, u):
        raise KeyError("boom")

    with pytest.raises(KeyError):
        processor.run([req], on_update=boom)
    assert engine.aborted == [0] and req.output().finish_reason == "abort"


def test_metrics_time_the_first_token_and_the_decode_rate():
    t = request().completions[0]
    t.t_submit = 10.0
    for i, now in enumerate((10.5, 11.0, 12.5)):
        t.add(i, "length" if i == 2 else None, now=now)
    m = t.output().metrics
    assert m.ttft_s == pytest.approx(0.5) and m.decode_tokens_per_s == pytest.approx(2 / 2.0)
    one = request().completions[0]
    one.t_submit = 1.0
    one.add(0, "length", now=3.0)
    assert (one.output().metrics.ttft_s, one.output().metrics.decode_tokens_per_s) == (2.0, 0.0)


def test_include_stop_str_in_output_keeps_the_stop_string_and_nothing_after_it():
    engine = ScriptedEngine([[(0, t, None)] for t in (0, 1, 2, 3)])
    (out,), updates = run(engine, request(stop=["lo w"], include_stop_str_in_output=True))
    assert (out.text, out.finish_reason, out.stop_reason) == ("hello w", "stop", "lo w")
    assert "".join(u.text for u in updates) == "hello w"  # streamed pieces add up to the text
    assert engine.aborted == [0]


def test_detokenize_false_returns_token_ids_and_empty_text():
    engine = ScriptedEngine([[(0, t, None)] for t in (0, 1)] + [[(0, 3, "length")]])
    (out,), updates = run(engine, request(detokenize=False))
    assert out.text == "" and out.token_ids == [0, 1, 3] and out.finish_reason == "length"
    assert all(u.text == "" for u in updates)


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ({"detokenize": False, "stop": ["x"]}, "detokenize=False"),
        ({"detokenize": 0}, "detokenize must be a bool"),
        ({"include_stop_str_in_output": "yes"}, "include_stop_str_in_output must be a bool"),
    ],
)
def test_bad_output_fields_are_refused(params, match):
    from sparsegen.errors import InputError

    with pytest.raises(InputError, match=match):
        SamplingParams(**params)
