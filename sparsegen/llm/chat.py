"""Chat templates and stop tokens read from a checkpoint folder.

- a `chat_template.jinja` file (it wins, as in transformers), else `tokenizer_config.json`'s
  `chat_template` (a string, or a list of `{"name", "template"}` from which "default" is
  taken), else Phi-3-Small's
  published turn format: `<|endoftext|><|user|>\\n...<|end|>\\n<|assistant|>\\n`.
- Templates are rendered in jinja2's immutable sandbox, so a checkpoint's template cannot
  reach Python internals or change what it is given, within bounds on what it builds, how
  long it runs and how much it writes (`template_sandbox`); any failure is an InputError
  naming the template.
- `generation_config.json`'s `eos_token_id` (an int or a list) gives the tokens that end a turn;
  for Phi-3-Small-instruct it holds `<|end|>` beside `<|endoftext|>`.
- Each file is read as the weights and the tokenizer are (`folders.contained_file`): a link that
  leads outside the checkpoint folder, or anything that is not a regular file, is refused.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import jinja2

from .. import jsonio
from ..errors import InputError
from ..folders import contained_file
from ..utf8 import check_utf8
from .template_sandbox import BoundedSandbox, render_bounded

ROLES = ("system", "user", "assistant", "tool")
ROLE_ALIASES = {"developer": "system"}  # OpenAI's newer name for the system turn, as vLLM maps it

# Phi-3-Small's turn format, written out as a template: every message is `<|role|>\n` + its
# content + `<|end|>\n`, after one `<|endoftext|>` (the BOS); a generation prompt opens the
# assistant's turn.
PHI3SMALL_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{{ '<|' ~ m['role'] ~ '|>\\n' ~ m['content'] ~ '<|end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


MAX_TEMPLATE_BYTES = 4 << 20  # a chat_template.jinja file; real ones are a few KB


def _inside(folder: Path, name: str) -> Path | None:
    """`folder / name` when it exists (None when it does not): a regular file inside the folder,
    read through the same checks as the weights and the tokenizer (`folders.contained_file`), so
    a link that leads outside the checkpoint is an InputError, never followed."""
    path = folder / name
    if not path.exists() and not path.is_symlink():
        return None
    return contained_file(folder, name, f"checkpoint {folder} has", InputError)


def _read_json(path: Path) -> dict:
    data = jsonio.read_json_file(path, InputError)
    if not isinstance(data, dict):
        raise InputError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _token_text(value, path: Path, field: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise InputError(f"{path}: {field} must be a string or {{'content': string}}, got {value!r}")


class ChatTemplate:
    def __init__(
        self, source: str, bos_token: str = "<|endoftext|>", eos_token: str = "<|endoftext|>", origin="?"
    ):
        if not isinstance(source, str):
            raise InputError(f"{origin}: chat_template must be a string, got {type(source).__name__}")
        check_utf8(source, f"{origin}: chat_template", InputError)
        self.source, self.origin = source, origin
        self.bos_token, self.eos_token = bos_token, eos_token
        env = BoundedSandbox(
            trim_blocks=True, lstrip_blocks=True, autoescape=False, extensions=["jinja2.ext.loopcontrols"]
        )
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = _strftime_now
        env.filters["tojson"] = _tojson
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as exc:
            raise InputError(f"{origin}: chat_template does not compile: {exc}") from None
        except (RecursionError, MemoryError) as exc:  # nested too deeply for jinja's parser
            raise InputError(f"{origin}: chat_template does not compile: {type(exc).__name__}") from None

    @classmethod
    def from_folder(cls, folder: str | Path | None) -> ChatTemplate:
        """The folder's template, or Phi-3-Small's when it has none (or there is no folder)."""
        if folder is None:
            return cls(PHI3SMALL_CHAT_TEMPLATE, origin="Phi-3-Small's chat format")
        folder = Path(folder)
        config = _inside(folder, "tokenizer_config.json")
        data = _read_json(config) if config is not None else {}
        # A tokenizer.json checkpoint without a BOS (Qwen) renders `bos_token` as "", as in
        # transformers; a .tiktoken one (Phi-3-Small) falls back to its <|endoftext|>.
        hf = (folder / "tokenizer.json").exists()
        default = "" if hf else "<|endoftext|>"
        bos = _token_text(data.get("bos_token"), config, "bos_token") or default
        eos = _token_text(data.get("eos_token"), config, "eos_token") or default
        jinja_file = _inside(folder, "chat_template.jinja")
        if jinja_file is not None:  # as in transformers, the file wins over the config's field
            try:
                if jinja_file.stat().st_size > MAX_TEMPLATE_BYTES:
                    raise InputError(
                        f"{jinja_file} is over {MAX_TEMPLATE_BYTES} bytes; a chat template is far smaller"
                    )
                text = jinja_file.read_bytes().decode("utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise InputError(f"cannot read {jinja_file}: {exc}") from None
            return cls(text, bos, eos, origin=str(jinja_file))
        source = data.get("chat_template")
        if isinstance(source, list):
            named = {
                t.get("name"): t.get("template") for t in source if isinstance(t, dict) and "template" in t
            }
            source = named.get("default", next(iter(named.values()), None))
            if source is None:
                raise InputError(f"{config}: chat_template is a list without a usable template")
        if source is not None:
            return cls(source, bos, eos, origin=str(config))
        return cls(PHI3SMALL_CHAT_TEMPLATE, bos, eos, origin="Phi-3-Small's chat format")

    def render(self, messages: list[dict], add_generation_prompt: bool = True, tools=None, documents=None,
               **extra) -> str:  # fmt: skip
        """The template's text for `messages`, with the variables transformers'
        `apply_chat_template` passes (`tools`, `documents` and any `extra` keyword too)."""
        msgs = check_messages(messages)
        return render_bounded(
            self._template,
            self.origin,
            InputError,
            **extra,
            messages=msgs,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            documents=documents,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
        )


def _raise(message):
    raise jinja2.TemplateError(str(message))


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(str(fmt))


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """transformers' `tojson`: plain `json.dumps` (jinja's own escapes `<`, `>`, `&` and `'`)."""
    if indent is not None and not (isinstance(indent, int) and 0 <= indent <= 64):
        raise InputError(f"tojson takes an indent of 0..64, got {indent!r:.40}")
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def message_text(content, where: str) -> str:
    """A message's content: a string, or OpenAI's list of `{"type": "text", "text": ...}` parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not (
                isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
            ):
                raise InputError(f"{where}.content[{j}] must be {{'type': 'text', 'text': string}}")
            parts.append(part["text"])
        return "".join(parts)
    raise InputError(
        f"{where}.content must be a string or a list of text parts, got {type(content).__name__}"
    )


def check_messages(messages) -> list[dict]:
    """A non-empty list of {"role": system|developer|user|assistant|tool, "content": text}; returns
    plain copies with `developer` as `system`. A `tool` message carries its `tool_call_id`; an
    `assistant` message may carry `tool_calls` (a list of objects) and then no content; both reach
    the chat template as given."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InputError(
            f"messages must be a non-empty list of {{'role', 'content'}} dicts, got {messages!r:.80}"
        )
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise InputError(f"{where} must be a dict with 'role' and 'content', got {type(m).__name__}")
        role = ROLE_ALIASES.get(m.get("role"), m.get("role"))
        if role not in ROLES:
            roles = ", ".join(ROLES + tuple(ROLE_ALIASES))
            raise InputError(f"{where}.role must be one of {roles}, got {m.get('role')!r:.40}")
        extra = set(m) - {"role", "content", "name", "tool_call_id", "tool_calls"}
        if extra:
            raise InputError(f"{where} has unsupported keys {sorted(map(str, extra))}")
        name = m.get("name")
        if name is not None and not isinstance(name, str):
            raise InputError(f"{where}.name must be a string, got {type(name).__name__}")
        if name is not None:
            check_utf8(name, f"{where}.name", InputError)
        msg = {"role": role}
        _tool_fields(m, role, where, msg)
        raw = m.get("content")
        if raw is None and "tool_calls" in msg:
            raw = ""
        msg["content"] = check_utf8(message_text(raw, where), f"{where}.content", InputError)
        out.append(msg)
    return out


def _tool_fields(m: dict, role: str, where: str, msg: dict) -> None:
    """`tool_call_id` (tool messages, required there) and `tool_calls` (assistant messages) into msg."""
    call_id = m.get("tool_call_id")
    if role == "tool":
        if not isinstance(call_id, str) or not call_id:
            raise InputError(f"{where}.tool_call_id must be a non-empty string on a tool message")
        msg["tool_call_id"] = check_utf8(call_id, f"{where}.tool_call_id", InputError)
    elif call_id is not None:
        raise InputError(f"{where}.tool_call_id belongs to tool messages only")
    calls = m.get("tool_calls")
    if calls is None:
        return
    if role != "assistant":
        raise InputError(f"{where}.tool_calls belongs to assistant messages only")
    if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
        raise InputError(f"{where}.tool_calls must be a list of objects")
    msg["tool_calls"] = [dict(c) for c in calls]


def eos_token_ids(folder: str | Path | None, vocab_size: int) -> tuple[int, ...] | None:
    """`generation_config.json`'s eos_token_id as a tuple, or None when the folder has none."""
    if folder is None:
        return None
    path = _inside(Path(folder), "generation_config.json")
    if path is None:
        return None
    value = _read_json(path).get("eos_token_id")
    if value is None:
        return None
    ids = value if isinstance(value, list) else [value]
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            raise InputError(f"{path}: eos_token_id holds {t!r}, not a token id in 0..{vocab_size - 1}")
    return tuple(ids)


def config_eos_token_ids(folder: Path, vocab_size: int) -> tuple[int, ...]:
    """`config.json`'s eos_token_id (or its text_config's) as a tuple; () when it has none."""
    path = _inside(folder, "config.json")
    if path is None:
        return ()
    data = _read_json(path)
    value = data.get("eos_token_id")
    if value is None and isinstance(data.get("text_config"), dict):
        value = data["text_config"].get("eos_token_id")
    if value is None:
        return ()
    ids = value if isinstance(value, list) else [value]
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            raise InputError(f"{path}: eos_token_id holds {t!r:.40}, not a token id in 0..{vocab_size - 1}")
    return tuple(ids)
