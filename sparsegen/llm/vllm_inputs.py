"""vLLM's prompt forms for `LLM.generate`, and its `sampling_params=` keyword.

A prompt is a str, a list of token ids, `{"prompt": str}` or `{"prompt_token_ids": [int, ...]}`;
`prompts` is one of those or a list of them. (`[1, 2, 3]` alone is ambiguous, and refused.)
"""

from __future__ import annotations

from pathlib import Path

from ..errors import InputError

PROMPT_KEYS = ("prompt", "prompt_token_ids")


def _one(p, where: str):
    """A str or a list of ids from one prompt in any of the forms above."""
    if isinstance(p, dict):
        keys = set(p)
        if len(keys & set(PROMPT_KEYS)) != 1 or keys - set(PROMPT_KEYS) - {"multi_modal_data"}:
            raise InputError(
                f"{where} must be {{'prompt': str}} or {{'prompt_token_ids': [int, ...]}}, got keys {sorted(map(str, keys))}"
            )
        if p.get("multi_modal_data") is not None:
            raise InputError(f"{where}.multi_modal_data is not supported: this model reads text only")
        if "prompt" in p:
            if not isinstance(p["prompt"], str):
                raise InputError(f"{where}.prompt must be a str, got {type(p['prompt']).__name__}")
            return p["prompt"]
        ids = p["prompt_token_ids"]
        if not isinstance(ids, (list, tuple)):
            raise InputError(f"{where}.prompt_token_ids must be a list of ints, got {type(ids).__name__}")
        return list(ids)
    return p


def normalize_prompts(prompts) -> list:
    """`prompts` as a non-empty list of str / list-of-ids."""
    if isinstance(prompts, (str, dict)):
        prompts = [prompts]
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise InputError(
            "prompts must be a str, a {'prompt'} or {'prompt_token_ids'} dict, or a non-empty list of them "
            "(or of token-id lists)"
        )
    if all(isinstance(p, int) and not isinstance(p, bool) for p in prompts):
        raise InputError("prompts is a flat list of ints: pass token ids as a list of lists, [[1, 2, 3]]")
    return [_one(p, f"prompts[{i}]") for i, p in enumerate(prompts)]


def pick_params(params, sampling_params):
    """The positional `params` or vLLM's `sampling_params=`; both given is an error."""
    if params is not None and sampling_params is not None:
        raise InputError("give the sampling parameters once: params or sampling_params, not both")
    return sampling_params if sampling_params is not None else params


def missing_folder(model) -> InputError:
    """The error for a model path that is not a folder, with the hint that only local folders load."""
    text = str(model)
    if not Path(text).exists() and not Path(text).is_absolute() and text.count("/") == 1:
        return InputError(
            f"model={text!r} is not a folder here, and only local checkpoint folders load (no hub "
            f"downloads): fetch it first, e.g. `huggingface-cli download {text} --local-dir DIR`, "
            "and pass DIR"
        )
    return InputError(f"model={text!r} is not a folder")
