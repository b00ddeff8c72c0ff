"""Nothing from outside a checkpoint folder is trusted, and nothing a browser can forge is taken.

- The server reads bodies sent as application/json only: text/plain, form-urlencoded and
  multipart bodies are what any web page may POST to a local server without a CORS preflight.
- It binds to loopback by default, and says so loudly when it does not (there is no API key).
- chat_template.jinja, tokenizer_config.json and generation_config.json are read through the
  same no-link-outside-the-folder loader as the weights and the tokenizer.
"""

from __future__ import annotations

import inspect
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import extras

from sparsegen.errors import InputError
from sparsegen.llm.chat import ChatTemplate, eos_token_ids

ROOT = Path(__file__).resolve().parents[2]
BODY = json.dumps({"model": "random-tiny", "prompt": "hi", "max_tokens": 1})


# -- content types ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def served():
    httpx = extras.require("httpx")
    extras.require("fastapi")
    from sparsegen import LLM
    from sparsegen.serve.server import ServerThread

    with ServerThread(LLM(random="tiny", max_num_seqs=2), max_queue=2) as srv:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            yield srv, c


FORGEABLE = [
    "text/plain",
    "text/plain;charset=UTF-8",
    "application/x-www-form-urlencoded",
    "multipart/form-data; boundary=x",
    None,
    "",
    "application/json-patch+json",
    "text/json",
    "application/jsonx",
]


@pytest.mark.parametrize("ctype", FORGEABLE)
@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_a_body_not_sent_as_json_is_a_415(served, route, ctype):
    srv, c = served
    headers = {} if ctype is None else {"content-type": ctype}
    r = c.post(route, content=BODY.encode(), headers=headers)
    assert r.status_code == 415, r.text
    err = r.json()["error"]
    assert err["param"] == "content-type" and err["code"] == "unsupported_media_type"
    assert srv.app.state.engine.inflight == 0


def test_what_a_web_page_sends_is_refused(served):
    _, c = served
    form = c.post("/v1/completions", data={"model": "random-tiny", "prompt": "hi"})
    multipart = c.post("/v1/completions", files={"body": ("b.json", BODY, "application/json")})
    assert form.status_code == 415 and multipart.status_code == 415


@pytest.mark.parametrize("ctype", ["application/json", "application/json; charset=utf-8", "Application/JSON"])
def test_json_is_served(served, ctype):
    _, c = served
    r = c.post("/v1/completions", content=BODY.encode(), headers={"content-type": ctype})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1, r.text


# -- the address it listens on ---------------------------------------------------------------------
def test_every_way_to_serve_defaults_to_loopback():
    extras.require("fastapi")
    from sparsegen.commands.serve import command
    from sparsegen.serve.server import ServerThread, serve

    (host,) = [p for p in command.params if p.name == "host"]
    assert host.default == "127.0.0.1"
    assert inspect.signature(serve).parameters["host"].default == "127.0.0.1"
    assert inspect.signature(ServerThread).parameters["host"].default == "127.0.0.1"


def test_loopback_is_told_from_other_addresses():
    extras.require("fastapi")
    from sparsegen.serve.server import bind, loopback

    for host, local in (("127.0.0.1", True), ("0.0.0.0", False)):
        sock = bind(host, 0)
        try:
            assert loopback(sock) is local
        finally:
            sock.close()


def _first_lines(proc: subprocess.Popen, until: str, timeout: float = 120) -> str:
    os.set_blocking(proc.stderr.fileno(), False)
    seen, deadline = b"", time.monotonic() + timeout
    while until.encode() not in seen and time.monotonic() < deadline and proc.poll() is None:
        seen += proc.stderr.read() or b""
        time.sleep(0.05)
    return seen.decode("utf-8", "replace")


@pytest.mark.parametrize("host,warned", [("0.0.0.0", True), ("127.0.0.1", False)])
def test_the_server_says_when_others_can_reach_it(tmp_path, host, warned):
    extras.require("fastapi")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SPARSEGEN_CACHE_DIR": str(tmp_path)}
    args = ["serve", "--random", "tiny", "--port", "0", "--no-warmup", "--host", host, "--max-num-seqs", "1"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "sparsegen", *args], stderr=subprocess.PIPE, env=env, cwd=ROOT
    )
    try:
        text = _first_lines(proc, "serving ")
        assert f"on http://{host}:" in text, text
        text += _first_lines(proc, "API key", timeout=2)
        assert ("reachable from other machines" in text) is warned, text
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


# -- files of a checkpoint folder ------------------------------------------------------------------
FILES = {
    "tokenizer_config.json": json.dumps({"chat_template": "{{ 'planted' }}"}),
    "chat_template.jinja": "{{ 'planted' }}",
    "generation_config.json": json.dumps({"eos_token_id": [1, 2]}),
}


def _read(folder: Path, name: str):
    if name == "generation_config.json":
        return eos_token_ids(folder, vocab_size=100)
    return ChatTemplate.from_folder(folder).render([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("name", list(FILES))
def test_a_link_leading_outside_the_checkpoint_is_refused(tmp_path, name):
    outside = tmp_path / "elsewhere" / name
    outside.parent.mkdir()
    outside.write_text(FILES[name])
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / name).symlink_to(outside)
    with pytest.raises(InputError, match="leads outside"):
        _read(ckpt, name)
    (ckpt / name).unlink()
    (ckpt / name).symlink_to(Path("..") / "elsewhere" / name)  # relative, the same target
    with pytest.raises(InputError, match="leads outside"):
        _read(ckpt, name)


@pytest.mark.parametrize("name", list(FILES))
def test_a_link_inside_the_checkpoint_and_hub_blobs_are_read(tmp_path, name):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "real").write_text(FILES[name])
    (ckpt / name).symlink_to("real")
    assert _read(ckpt, name) in ("planted", (1, 2))
    repo = tmp_path / "models--org--m"  # the HF hub cache: snapshot files link into ../../blobs
    (repo / "blobs").mkdir(parents=True)
    (repo / "blobs" / "abc123").write_text(FILES[name])
    snap = repo / "snapshots" / "rev"
    snap.mkdir(parents=True)
    (snap / name).symlink_to(Path("..") / ".." / "blobs" / "abc123")
    assert _read(snap, name) in ("planted", (1, 2))


@pytest.mark.parametrize("name", list(FILES))
def test_a_fifo_or_a_folder_is_not_read(tmp_path, name):
    os.mkfifo(tmp_path / name)  # would block a reader forever
    with pytest.raises(InputError, match="not a regular file"):
        _read(tmp_path, name)
    os.unlink(tmp_path / name)
    (tmp_path / name).mkdir()
    with pytest.raises(InputError, match="not a regular file"):
        _read(tmp_path, name)


def test_a_dangling_link_is_refused_not_skipped(tmp_path):
    (tmp_path / "chat_template.jinja").symlink_to(tmp_path / "gone")
    with pytest.raises(InputError, match="does not exist"):
        ChatTemplate.from_folder(tmp_path)
