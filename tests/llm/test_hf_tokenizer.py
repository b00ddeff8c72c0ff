"""tokenizer.json, chat templates and EOS ids from a checkpoint, against transformers itself on
tiny tokenizers trained offline (byte-level BPE and SentencePiece-style with byte fallback)."""

from __future__ import annotations

import json
import shutil

import pytest
from helpers import extras
from helpers.hf_tokenizers import CHAT_TEMPLATE, write_hf_tokenizer

from sparsegen.errors import InputError, TokenizerError
from sparsegen.llm.checkpoint_text import load_checkpoint_text, load_folder_tokenizer
from sparsegen.llm.hf_tokenizer import byte_level_table

extras.require("tokenizers")
transformers = extras.require("transformers")  # the oracle, and what saves the tiny tokenizers

KINDS = ("byte_level", "spm")
TEXTS = [
    "hello world",
    "héllo wörld ✓ 日本語 🙂🙃 ñ",
    "  leading and trailing spaces  ",
    "tabs\tand\nnewlines\n\n",
    "<|user|>special tokens inside</s> text<s>",
    "<think>an added token</think>",
    "unseen: ζψω 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ا",
    "",
]
CONVERSATIONS = [
    [{"role": "user", "content": "hi there"}],
    [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "what is 2+2? ✓"},
        {"role": "assistant", "content": "four 🙂"},
        {"role": "user", "content": "and 3+3?"},
    ],
]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf-tok")
    return {k: write_hf_tokenizer(root / k, k, bos=True) for k in KINDS}


@pytest.mark.parametrize("kind", KINDS)
def test_encode_and_decode_match_transformers(folders, kind):
    hf = transformers.AutoTokenizer.from_pretrained(str(folders[kind]))
    tok = load_folder_tokenizer(folders[kind])
    for text in TEXTS:
        assert tok.encode(text, add_special_tokens=True) == hf(text)["input_ids"], text
        ids = hf(text, add_special_tokens=False)["input_ids"]
        assert tok.encode(text) == ids, text
        assert tok.decode(ids) == hf.decode(ids), text


@pytest.mark.parametrize("kind", KINDS)
def test_vocab_is_bytes_that_spell_the_text(folders, kind):
    tok = load_folder_tokenizer(folders[kind])
    vocab = tok.vocab()
    assert all(isinstance(b, bytes) for b in vocab) and len(vocab) == tok.vocab_size
    sorted(vocab)  # bytes throughout: a vocabulary that sorts
    prefix = b" " if kind == "spm" else b""  # Metaspace's prepend_scheme="first"
    for text in [*TEXTS[:2], TEXTS[-2]]:
        ids = tok.encode(text)
        assert b"".join(vocab[i] for i in ids) == prefix + text.encode(), text
    if kind == "spm":  # byte fallback: <0xF0> is the byte 0xF0
        assert vocab[tok._tok.token_to_id("<0xF0>")] == b"\xf0"
    assert vocab[tok.special_tokens["</s>"]] == b"</s>"


@pytest.mark.parametrize("kind", KINDS)
def test_special_tokens_are_the_added_tokens_marked_special(folders, kind):
    hf = transformers.AutoTokenizer.from_pretrained(str(folders[kind]))
    tok = load_folder_tokenizer(folders[kind])
    assert set(tok.special_tokens) == {"<s>", "</s>", "<|user|>", "<|assistant|>", "<|end|>"}
    think = hf.convert_tokens_to_ids("<think>")
    assert tok.encode("<think>") == [think] and tok.vocab()[think] == b"<think>"
    assert tok.eos_token_id == hf.eos_token_id


@pytest.mark.parametrize("kind", KINDS)
def test_the_engine_streams_split_characters_whole(folders, kind):
    from sparsegen.engine.outputs import Detokenizer
    from sparsegen.request.sampling_params import SamplingParams

    tok = load_folder_tokenizer(folders[kind])
    text = "日本語 🙂 <think>ζψω</think>"
    ids = tok.encode(text)
    for skip in (True, False):
        tracker = Detokenizer(tok, frozenset({tok.eos_token_id})).completion(
            0, SamplingParams(max_tokens=100, skip_special_tokens=skip)
        )
        shown = [tracker.add(i, None).text for i in ids]
        assert all("\ufffd" not in s for s in shown)
        assert "".join(shown).lstrip() == text  # <think> is not special: shown either way


def test_byte_level_table_is_a_bijection():
    table = byte_level_table()
    assert sorted(table.values()) == list(range(256)) and len(table) == 256
    assert table["Ġ"] == ord(" ") and table["!"] == ord("!")


@pytest.mark.parametrize("kind", KINDS)
def test_stream_decoder_holds_split_characters_until_whole(folders, kind):
    tok = load_folder_tokenizer(folders[kind])
    text = "日本語 🙂🙃 ζψω"
    ids = tok.encode(text)
    assert len(ids) > len(text.split()) + 2  # characters do span several tokens
    step = tok.stream_decoder()
    pieces = [step(i) for i in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces).lstrip() == text
    assert any(p == "" for p in pieces)  # a partial character waited for its last byte


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("gen", [True, False])
def test_chat_template_matches_apply_chat_template(folders, kind, gen):
    hf = transformers.AutoTokenizer.from_pretrained(str(folders[kind]))
    text = load_checkpoint_text(folders[kind], 1000)
    for messages in CONVERSATIONS:
        want = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=gen)["input_ids"]
        got = text.tokenizer.encode(text.chat_template.render(messages, add_generation_prompt=gen))
        assert got == want


def _config(folder):
    return json.loads((folder / "tokenizer_config.json").read_text())


def test_template_in_the_config_field_and_the_named_list(folders, tmp_path):
    folder = tmp_path / "field"
    shutil.copytree(folders["byte_level"], folder)
    (folder / "chat_template.jinja").unlink()
    cfg = _config(folder)
    other = "{{ 'OTHER' }}"
    cfg["chat_template"] = [
        {"name": "tool_use", "template": other},
        {"name": "default", "template": CHAT_TEMPLATE},
    ]
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    text = load_checkpoint_text(folder, 1000)
    want = hf.apply_chat_template(CONVERSATIONS[1], tokenize=True, add_generation_prompt=True)["input_ids"]
    assert text.tokenizer.encode(text.chat_template.render(CONVERSATIONS[1])) == want
    # a chat_template.jinja file wins over the config's field, as in transformers
    (folder / "chat_template.jinja").write_text("{{ bos_token }}JINJA{{ messages[0]['content'] }}")
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    rendered = load_checkpoint_text(folder, 1000).chat_template.render(CONVERSATIONS[0])
    assert rendered == "<s>JINJAhi there" == hf.apply_chat_template(CONVERSATIONS[0], tokenize=False)


def test_template_variables_transformers_passes(tmp_path, folders):
    folder = tmp_path / "vars"
    shutil.copytree(folders["byte_level"], folder)
    (folder / "chat_template.jinja").write_text(
        "{{ strftime_now('%Y') | length }}|{{ tools | tojson }}|{{ eos_token }}"
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content }}{% endfor %}"
    )
    template = load_checkpoint_text(folder, 1000).chat_template
    tools = [{"type": "function", "function": {"name": "f<x>", "description": "ü"}}]
    out = template.render(CONVERSATIONS[1], tools=tools)
    assert out == '4|[{"type": "function", "function": {"name": "f<x>", "description": "ü"}}]|</s>be brief'
    (folder / "chat_template.jinja").write_text("{{ raise_exception('no system role') }}")
    with pytest.raises(InputError, match="no system role"):
        load_checkpoint_text(folder, 1000).chat_template.render(CONVERSATIONS[0])
    (folder / "chat_template.jinja").write_text("{{ tools | tojson(indent=100000000) }}")
    with pytest.raises(InputError, match="indent"):
        load_checkpoint_text(folder, 1000).chat_template.render(CONVERSATIONS[0], tools=[1])


def test_eos_ids_from_generation_config_else_config_else_tokenizer(tmp_path, folders):
    folder = tmp_path / "eos"
    shutil.copytree(folders["byte_level"], folder)
    tok = load_folder_tokenizer(folder)
    end = tok.special_tokens["<|end|>"]
    assert load_checkpoint_text(folder, 1000).eos_token_ids == (tok.special_tokens["</s>"],)
    (folder / "config.json").write_text(json.dumps({"eos_token_id": [7, 1]}))
    assert load_checkpoint_text(folder, 1000).eos_token_ids == (7, 1)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [end, 1]}))
    assert load_checkpoint_text(folder, 1000).eos_token_ids == (end, 1)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 3}))
    assert load_checkpoint_text(folder, 1000).eos_token_ids == (3,)
    (folder / "generation_config.json").unlink()
    for bad in (1000, -1, True, "1", [2, 5000]):
        (folder / "config.json").write_text(json.dumps({"eos_token_id": bad}))
        with pytest.raises(InputError, match="eos_token_id"):
            load_checkpoint_text(folder, 1000)


def test_a_tokenizer_without_bos_renders_it_empty_as_transformers_does(tmp_path, folders):
    folder = tmp_path / "nobos"
    shutil.copytree(folders["byte_level"], folder)
    cfg = _config(folder)
    cfg["bos_token"] = None
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    (folder / "chat_template.jinja").write_text(
        "[{{ bos_token }}]{{ messages[0]['content'] }}{{ eos_token }}"
    )
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    want = hf.apply_chat_template(CONVERSATIONS[0], tokenize=False)
    assert (
        load_checkpoint_text(folder, 1000).chat_template.render(CONVERSATIONS[0]) == want == "[]hi there</s>"
    )


def test_a_folder_without_tokenizer_gives_none(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    text = load_checkpoint_text(tmp_path, 100)
    assert text.tokenizer is None and text.eos_token_ids == ()


def test_adversarial_tokenizer_files(tmp_path, folders):
    outside = tmp_path / "outside"
    shutil.copytree(folders["byte_level"], outside)
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "tokenizer.json").symlink_to(outside / "tokenizer.json")
    with pytest.raises(TokenizerError, match="leads outside"):
        load_folder_tokenizer(linked)
    broken = tmp_path / "broken"
    broken.mkdir()
    for content, match in (("{not json", "JSON|json"), ('{"model": 3}', "no 'model'"),
                           ('{"model": {"type": "Nope"}}', "tokenizers library")):  # fmt: skip
        (broken / "tokenizer.json").write_text(content)
        with pytest.raises(TokenizerError, match=match):
            load_folder_tokenizer(broken)
    badeos = tmp_path / "badeos"
    shutil.copytree(folders["byte_level"], badeos)
    cfg = _config(badeos)
    cfg["eos_token"] = "<|not-a-token|>"
    (badeos / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(TokenizerError, match="not in the vocabulary"):
        load_folder_tokenizer(badeos)
    cfg["eos_token"] = 5
    (badeos / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(TokenizerError, match="eos_token must be"):
        load_folder_tokenizer(badeos)
    tok = load_folder_tokenizer(folders["byte_level"])
    for bad in (b"bytes", None, 3):
        with pytest.raises(TokenizerError, match="encode takes a str"):
            tok.encode(bad)
    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        tok.decode([tok.vocab_size])
    with pytest.raises(TokenizerError):
        tok.encode("lone surrogate \ud800")
