"""Lone surrogates, which is how Python spells a non-UTF-8 byte of argv and how JSON can escape
half a UTF-16 pair: in a prompt, a chat message, a stop string, a chat template or a CLI
argument each is a typed error naming the field (HTTP 400, exit 2), never a UnicodeEncodeError."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner
from helpers import extras
from helpers.checkpoint import write_bpe_file

from sparsegen.cli import COMMANDS, cli
from sparsegen.errors import InputError, TokenizerError
from sparsegen.llm.chat import ChatTemplate, check_messages
from sparsegen.models.config import TINY_SPECIAL_TOKENS, TINY_VOCAB_SIZE
from sparsegen.request.sampling_params import SamplingParams
from sparsegen.tokenizer import ByteTokenizer, load_tokenizer
from sparsegen.utf8 import check_utf8, lone_surrogate

ROOT = Path(__file__).resolve().parents[2]
LONE = ["\udcff", "a\ud800b", "ok\udfff", "\ud83d"]  # a byte of argv, a high half, a low half
PAIR = "\U0001f600"  # a whole character outside the BMP: text


@pytest.mark.parametrize("text", LONE)
def test_check_utf8_names_the_field_and_the_position(text):
    assert lone_surrogate(text) is not None
    with pytest.raises(InputError, match=r"prompt\.x holds .* at character \d"):
        check_utf8(text, "prompt.x", InputError)
    assert check_utf8(PAIR + "é", "prompt.x", InputError) == PAIR + "é"


@pytest.mark.parametrize("text", LONE)
def test_stop_strings(text):
    with pytest.raises(InputError, match=r"SamplingParams\.stop\[1\]"):
        SamplingParams(stop=["fine", text])
    assert SamplingParams(stop=[PAIR]).stop == (PAIR,)


@pytest.mark.parametrize("text", LONE)
def test_tokenizers(text, tmp_path, monkeypatch):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "tiktoken-cache"))
    byte_tok = ByteTokenizer(TINY_SPECIAL_TOKENS, TINY_VOCAB_SIZE)
    toks = [byte_tok]
    try:
        toks.append(load_tokenizer(write_bpe_file(tmp_path / "tiny.tiktoken")))
    except ImportError:  # tiktoken is the [model] extra
        pass
    for tok in toks:
        with pytest.raises(TokenizerError, match="lone surrogate"):
            tok.encode(text)
        assert tok.decode(tok.encode(PAIR)) == PAIR


@pytest.mark.parametrize("text", LONE)
def test_chat_messages(text):
    with pytest.raises(InputError, match=r"messages\[1\]\.content"):
        check_messages([{"role": "system", "content": "s"}, {"role": "user", "content": text}])
    with pytest.raises(InputError, match=r"messages\[0\]\.content"):
        check_messages([{"role": "user", "content": [{"type": "text", "text": text}]}])
    with pytest.raises(InputError, match=r"messages\[0\]\.name"):
        check_messages([{"role": "user", "content": "x", "name": text}])
    with pytest.raises(InputError, match=r"messages\[0\]\.name"):
        check_messages([{"role": "user", "content": "x", "name": 5}])


def test_chat_template_holding_a_surrogate_names_it(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ 'x\udcff' }}"}))
    with pytest.raises(InputError, match="chat_template holds"):
        ChatTemplate.from_folder(tmp_path)


@pytest.fixture(scope="module")
def llm():
    from sparsegen import LLM

    return LLM(random="tiny", max_num_seqs=2)


@pytest.mark.parametrize("text", LONE)
def test_llm_api(llm, text):
    with pytest.raises(InputError, match=r"prompts\[1\] holds"):
        llm.generate(["fine", text], use_tqdm=False)
    with pytest.raises(InputError, match=r"messages\[0\]\.content holds"):
        llm.chat([{"role": "user", "content": text}], use_tqdm=False)
    assert not llm.engine.has_unfinished
    out = llm.generate([PAIR], SamplingParams(max_tokens=1), use_tqdm=False)
    assert out[0].prompt == PAIR and len(out[0].token_ids) == 1


# -- the server -------------------------------------------------------------------------------
def _raw(body: str) -> bytes:
    """A JSON body whose \\uXXXX escapes are written as they are (no Python str holds them)."""
    return body.encode("ascii")


SURROGATE_BODIES = [
    ('{"model": "random-tiny", "prompt": "a\\udcffb", "max_tokens": 1}', "prompt"),
    ('{"model": "random-tiny", "prompt": ["ok", "\\ud800"], "max_tokens": 1}', "prompt[1]"),
    ('{"model": "random-tiny", "prompt": "hi", "stop": "\\udfff", "max_tokens": 1}', "stop"),
    ('{"model": "random-tiny", "prompt": "hi", "stop": ["a", "\\ud83d"], "max_tokens": 1}', "stop[1]"),
    ('{"model": "random-tiny", "prompt": "hi", "user": "\\udcff", "max_tokens": 1}', "user"),
    ('{"model": "random-\\udcff", "prompt": "hi"}', "model"),
    ('{"model": "random-tiny", "prompt": "hi", "\\udcff": 1}', "body"),
]
CHAT_BODIES = [
    ('{"model": "random-tiny", "messages": [{"role": "user", "content": "\\ud800"}]}', "messages[0].content"),
    ('{"model": "random-tiny", "messages": [{"role": "user", "content": "x"}, '
     '{"role": "user", "content": [{"type": "text", "text": "\\udcff"}]}]}', "messages[1].content[0].text"),
    ('{"model": "random-tiny", "messages": [{"role": "user", "content": "x", "name": "\\ud800"}]}',
     "messages[0].name"),
]  # fmt: skip


@pytest.fixture(scope="module")
def http(llm):
    httpx = extras.require("httpx")
    extras.require("fastapi")
    from sparsegen.serve.server import ServerThread

    with ServerThread(llm, max_queue=4) as srv, httpx.Client(base_url=srv.url, timeout=60) as c:
        yield c


@pytest.mark.parametrize(
    "route,body,param",
    [("/v1/completions", b, p) for b, p in SURROGATE_BODIES]
    + [("/v1/chat/completions", b, p) for b, p in CHAT_BODIES],
)
def test_server_names_the_field_holding_a_surrogate(http, route, body, param):
    r = http.post(route, content=_raw(body), headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and "surrogate" in err["message"], err
    assert http.get("/health").status_code == 200


def test_server_takes_a_whole_surrogate_pair(http):
    body = '{"model": "random-tiny", "prompt": "\\ud83d\\ude00", "max_tokens": 1, "stop": "\\ud83d\\ude00"}'
    r = http.post("/v1/completions", content=_raw(body), headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text


# -- the CLI ----------------------------------------------------------------------------------
def _text_options() -> list[tuple[list[str], str]]:
    """(command path, option) for every plain-text option of every command."""
    from sparsegen.commands.param_types import UTF8_TEXT

    ctx = click.Context(cli)
    found = []

    def walk(cmd, path):
        for sub_name, sub in getattr(cmd, "commands", {}).items():
            walk(sub, [*path, sub_name])
        for p in cmd.params:
            if p.type is UTF8_TEXT:
                found.append((path, p.opts[0]))

    for name in COMMANDS:
        walk(cli.get_command(ctx, name), [name])
    return found


TEXT_OPTIONS = _text_options()


def test_the_text_options_are_found():
    opts = {(tuple(c), o) for c, o in TEXT_OPTIONS}
    assert {(("generate",), "--prompt"), (("generate",), "--stop"), (("serve",), "--host")} <= opts


@pytest.mark.parametrize("path,option", TEXT_OPTIONS, ids=[f"{' '.join(c)} {o}" for c, o in TEXT_OPTIONS])
def test_every_text_option_refuses_a_surrogate_with_exit_2(path, option):
    res = CliRunner().invoke(cli, [*path, option, "ok\udcff"])
    assert res.exit_code == 2, res.output
    assert option in res.stderr and "surrogate" in res.stderr, res.stderr
    assert res.stderr.count("\n") == 1 and "Traceback" not in res.stderr


def test_a_non_utf8_argv_byte_is_exit_2_in_a_real_process(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SPARSEGEN_CACHE_DIR": str(tmp_path)}
    args = [sys.executable, "-m", "sparsegen", "generate", "--random", "tiny", "--no-warmup", "--prompt"]
    res = subprocess.run([*args, b"caf\xe9"], capture_output=True, env=env, timeout=120, cwd=ROOT)
    assert res.returncode == 2, res.stderr
    err = res.stderr.decode("utf-8", "replace")
    assert err.count("\n") == 1 and "--prompt" in err and "surrogate" in err, err
