"""Tiny Hugging Face tokenizer folders built offline: a BPE trained with `tokenizers` on a few
lines, saved by transformers' `PreTrainedTokenizerFast.save_pretrained` with a chat template."""

from __future__ import annotations

import json
from pathlib import Path

CORPUS = [
    "hello world, the quick brown fox jumps over the lazy dog",
    "héllo wörld ✓ 日本語のテキスト emoji 🙂🙃 and ñ",
    "user: what is two plus two? assistant: four.",
    "def f(x):\n    return x * 2\n",
] * 4

SPECIALS = ["<s>", "</s>", "<|user|>", "<|assistant|>", "<|end|>"]

# A Llama-2-style template: BOS, [INST] turns, EOS after each answer; raise_exception on a bad role.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('bad role') }}{% endif %}"
    "{{ '<|' + m['role'] + '|>\\n' + m['content'] | trim + '<|end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


def _train(kind: str):
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    if kind == "byte_level":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:  # SentencePiece-style: ▁ for spaces and byte fallback
        tok = Tokenizer(models.BPE(byte_fallback=True, unk_token=None))
        tok.normalizer = normalizers.Replace(" ", "▁")
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
        tok.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
        )
        alphabet = []
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, initial_alphabet=alphabet,
                                  show_progress=False)  # fmt: skip
    tok.train_from_iterator(CORPUS, trainer)
    if kind != "byte_level":  # SentencePiece puts <0x00>..<0xFF> in the model's own vocabulary
        model = json.loads(tok.to_str())["model"]
        trained = sorted(model["vocab"].items(), key=lambda kv: kv[1])
        pieces = [p for p, _ in trained[: len(SPECIALS)]] + [f"<0x{b:02X}>" for b in range(256)]
        pieces += [p for p, _ in trained[len(SPECIALS) :] if p not in pieces]
        merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
        rebuilt = Tokenizer(models.BPE({p: i for i, p in enumerate(pieces)}, merges, byte_fallback=True))
        rebuilt.normalizer, rebuilt.pre_tokenizer, rebuilt.decoder = (
            tok.normalizer,
            tok.pre_tokenizer,
            tok.decoder,
        )
        rebuilt.add_special_tokens(SPECIALS)
        tok = rebuilt
    return tok


def write_hf_tokenizer(folder: Path, kind: str = "byte_level", chat_template: str | None = CHAT_TEMPLATE,
                       bos: bool = False) -> Path:  # fmt: skip
    """`folder` with tokenizer.json and tokenizer_config.json (`<s>` BOS, `</s>` EOS)."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    tok = _train(kind)
    if bos:
        bos_id = tok.token_to_id("<s>")
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos_id)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.add_tokens(["<think>"])  # an added token that is not special (shown by skip_special_tokens)
    if chat_template is not None:
        fast.chat_template = chat_template
    folder.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(folder))
    return folder
