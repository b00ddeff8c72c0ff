"""vLLM's offline code against `LLM`: prompt forms, `sampling_params=`, `chat(chat_template=)`,
and the hint for a hub id."""

from __future__ import annotations

import pytest

from sparsegen import LLM, SamplingParams
from sparsegen.errors import InputError

pytestmark = pytest.mark.usefixtures("single_thread")
GREEDY = SamplingParams(temperature=0.0, max_tokens=3)


@pytest.fixture(scope="module")
def llm():
    return LLM(random="tiny", max_num_seqs=8)


def ids_of(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_every_prompt_form_gives_the_same_tokens(llm):
    ids = llm.tokenizer.encode("Hello there")
    want = ids_of(llm.generate(["Hello there"], GREEDY, use_tqdm=False))
    for prompts in (
        "Hello there",
        {"prompt": "Hello there"},
        {"prompt_token_ids": ids},
        [{"prompt_token_ids": ids}],
        [ids],
    ):
        got = llm.generate(prompts, sampling_params=GREEDY, use_tqdm=False)
        assert ids_of(got) == want, prompts
    mixed = llm.generate(
        ["Hello there", {"prompt_token_ids": ids}, {"prompt": "Hello there"}],
        sampling_params=GREEDY,
        use_tqdm=False,
    )
    assert ids_of(mixed) == want * 3
    assert mixed[0].prompt == "Hello there" and mixed[1].prompt is None


@pytest.mark.parametrize(
    "prompts,msg",
    [
        ({"prompt": "a", "prompt_token_ids": [1]}, "prompts[0] must be"),
        ({}, "prompts[0] must be"),
        ({"text": "a"}, "prompts[0] must be"),
        ({"prompt": 5}, "prompts[0].prompt must be a str"),
        ({"prompt_token_ids": "abc"}, "prompt_token_ids must be a list"),
        ({"prompt_token_ids": [10**9]}, "prompts[0]"),
        ({"prompt_token_ids": []}, "prompts[0]"),
        ({"prompt": "a", "multi_modal_data": {"image": 1}}, "multi_modal_data"),
        ([], "prompts must be"),
        ([1, 2, 3], "flat list of ints"),
    ],
)
def test_bad_prompt_forms(llm, prompts, msg):
    with pytest.raises(InputError, match=msg.replace("[", r"\[").replace("]", r"\]")):
        llm.generate(prompts, sampling_params=GREEDY, use_tqdm=False)


def test_params_given_twice_is_an_error(llm):
    with pytest.raises(InputError, match="not both"):
        llm.generate("a", GREEDY, sampling_params=GREEDY, use_tqdm=False)
    with pytest.raises(InputError, match="not both"):
        llm.chat([{"role": "user", "content": "a"}], GREEDY, sampling_params=GREEDY, use_tqdm=False)


def test_chat_with_sampling_params_and_a_template(llm):
    convo = [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}]
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    out = llm.chat(convo, sampling_params=GREEDY, chat_template=template, use_tqdm=False)
    assert out[0].prompt == "<system>be brief<user>hi"
    assert len(out[0].outputs[0].token_ids) == 3
    two = llm.chat([convo, convo], sampling_params=GREEDY, chat_template=template, use_tqdm=False)
    assert ids_of(two) == ids_of(out) * 2
    default = llm.chat(convo, sampling_params=GREEDY, use_tqdm=False)
    assert default[0].prompt != out[0].prompt  # the checkpoint's template is left as it was


@pytest.mark.parametrize("template,msg", [(5, "chat_template must be a str"), ("{% for %}", "chat_template")])
def test_bad_chat_template(llm, template, msg):
    with pytest.raises(InputError, match=msg):
        llm.chat([{"role": "user", "content": "a"}], sampling_params=GREEDY, chat_template=template)


def test_a_hub_id_says_only_local_folders_load(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InputError, match="only local checkpoint folders load") as info:
        LLM("microsoft/Phi-3-small-8k-instruct")
    assert "huggingface-cli download microsoft/Phi-3-small-8k-instruct" in str(info.value)
    with pytest.raises(InputError, match="is not a folder") as info:
        LLM(str(tmp_path / "missing"))
    assert "only local" not in str(info.value)
