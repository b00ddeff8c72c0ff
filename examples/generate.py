"""Generate text with Phi-3-Small through sparsegen's block-sparse attention, streaming tokens.

    python examples/generate.py                          # random `tiny` weights on the CPU
    python examples/generate.py --model /path/to/Phi-3-small-8k-instruct --prompt "Hi"

A local checkpoint folder needs config.json, *.safetensors and cl100k_base.tiktoken; nothing
is downloaded. On a GPU the compiled kernels run (bf16); on a CPU, the reference attention.
"""

from __future__ import annotations

import argparse
import sys

import torch

from sparsegen.engine import LLMEngine, SamplingParams
from sparsegen.models import load_checkpoint, random_model
from sparsegen.models.config import TINY_SPECIAL_TOKENS, TINY_VOCAB_SIZE
from sparsegen.tokenizer import ByteTokenizer, load_tokenizer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", help="local HF checkpoint folder (default: random tiny weights)")
    ap.add_argument(
        "--prompt", default="<|user|>\nWhy are sparse attention kernels fast?<|end|>\n<|assistant|>\n"
    )
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if args.model:
        tokenizer = load_tokenizer(args.model)
        model = load_checkpoint(args.model, device=device, dtype=dtype,
                                dummy_token_indices=tokenizer.dummy_token_indices)  # fmt: skip
    else:
        tokenizer = ByteTokenizer(TINY_SPECIAL_TOKENS, TINY_VOCAB_SIZE)
        model = random_model("tiny", device=device, dtype=dtype)

    engine = LLMEngine(model, tokenizer=tokenizer)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.7, top_p=0.9, seed=0)
    text = tokenizer.stream_decoder()  # token id -> the text it completes
    for event in engine.stream([tokenizer.encode(args.prompt)], params):
        if event.finish_reason not in ("eos", "stop"):
            sys.stdout.write(text(event.token_id))
            sys.stdout.flush()
    print()


if __name__ == "__main__":
    main()
