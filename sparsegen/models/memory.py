"""Memory estimates made before anything is allocated: the weights of a model, and what a device
has free (GPU: `torch.cuda.mem_get_info`; CPU: MemAvailable, capped by the cgroup's limit).

Building the 7b model in float32 on a small CPU machine used to be killed by the kernel (exit
137, no message) half way through allocating; `check_fits` turns that into a `MemoryLimitError`
that gives the numbers.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import MemoryLimitError
from .config import Phi3SmallConfig

# Fraction of the free memory a build may plan to use: the process, torch and the allocator's
# rounding need the rest.
USABLE_FRACTION = 0.9


def parameter_count(config: Phi3SmallConfig) -> int:
    """Parameters of Phi3SmallForCausalLM for `config` (lm_head counted: random models untie it);
    a decoder family's config counts its own (`DecoderConfig.parameter_count`)."""
    if hasattr(config, "parameter_count"):
        return config.parameter_count()
    h, f, v = config.hidden_size, config.ff_intermediate_size, config.vocab_size
    qkv = (config.num_attention_heads + 2 * config.num_key_value_heads) * config.head_dim
    per_layer = (
        2 * 2 * h  # two LayerNorms, weight and bias
        + h * qkv + qkv  # query_key_value
        + h * h + h  # dense
        + h * 2 * f + 2 * f  # up_proj
        + f * h + h  # down_proj
    )  # fmt: skip
    return v * h + config.num_hidden_layers * per_layer + 2 * h + v * h  # embed, layers, final LN, lm_head


def weight_bytes(config: Phi3SmallConfig, dtype: torch.dtype) -> int:
    return parameter_count(config) * torch.empty((), dtype=dtype).element_size()


def prefill_activation_bytes(config: Phi3SmallConfig, dtype: torch.dtype, tokens: int) -> int:
    """About the most that one prefill step of `tokens` tokens holds at once besides the weights
    and the KV cache: per token, up_proj's output (2 x ff) and its GeGeLU (ff), QKV's output, and
    four hidden-size tensors (the residual stream, the normed input, attention's output and
    down_proj's). For the 7b model that is 128 KiB a token; bench_generate's peak GPU memory rose
    by 3.1 GiB from 8K- to 32K-token chunks (on the H200), about 132 KiB a token. A
    tensor-parallel rank holds less (its shard of the MLP and heads): this overstates it."""
    h, f = config.hidden_size, config.ff_intermediate_size
    qkv = (config.num_attention_heads + 2 * config.num_key_value_heads) * config.head_dim
    return tokens * (3 * f + qkv + 4 * h) * torch.empty((), dtype=dtype).element_size()


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # cgroup v2 writes "max" for no limit


def cpu_available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo, capped by the cgroup (v2 or v1) limit minus its usage;
    None when neither can be read (not Linux)."""
    found = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    for limit_file, usage_file in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        limit, usage = _read_int(Path(limit_file)), _read_int(Path(usage_file))
        if limit is not None and usage is not None and limit < 1 << 60:
            found.append(max(0, limit - usage))
    return min(found) if found else None


def available_bytes(device: torch.device | str) -> int | None:
    """Free memory on `device`, or None when it cannot be told (then nothing is checked)."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    if device.type == "cpu":
        return cpu_available_bytes()
    return None


DEFAULT_ADVICE = "use a smaller model, a narrower dtype or another device"


def check_fits(need: int, device: torch.device | str, what: str, advice: str = DEFAULT_ADVICE) -> None:
    """Raise MemoryLimitError if `need` bytes exceed the usable share of `device`'s free memory;
    the message names `what` and ends with `advice`."""
    free = available_bytes(device)
    if free is None:
        return
    usable = int(free * USABLE_FRACTION)
    if need > usable:
        raise MemoryLimitError(
            f"{what} would take about {need / 2**30:.1f} GiB, but {device} has {free / 2**30:.1f} GiB free "
            f"(at most {usable / 2**30:.1f} GiB usable); {advice}"
        )


def gpu_cache_bytes(free: int, total: int, held: int, headroom: int, utilization: float) -> int:
    """vLLM's `gpu_memory_utilization`: the bytes the KV cache may take when this engine may use
    `utilization` of the GPU's `total` memory for everything it holds, i.e. that share less what
    it holds already (`held`: the weights, as torch's allocator has reserved them) and less
    `headroom` (a prefill step's activations, logits, CUDA graphs). Raises MemoryLimitError when
    other processes leave less than that share free, or when nothing is left for a cache."""
    share = int(total * utilization)
    if share > free + held:  # the rest of the GPU is held by other processes
        raise MemoryLimitError(
            f"gpu_memory_utilization={utilization} asks for {share / 2**30:.1f} GiB of the GPU's "
            f"{total / 2**30:.1f} GiB, but only {(free + held) / 2**30:.1f} GiB are free or held by this engine "
            "(other processes hold the rest); lower gpu_memory_utilization or free the GPU"
        )
    room = share - held - headroom
    if room <= 0:
        raise MemoryLimitError(
            f"gpu_memory_utilization={utilization} leaves no room for a KV cache: {share / 2**30:.1f} GiB "
            f"less the weights' {held / 2**30:.1f} GiB and a step's {headroom / 2**30:.1f} GiB of headroom; "
            "raise gpu_memory_utilization, or use a smaller model or fewer prefill tokens a step"
        )
    return room


def check_model_fits(config: Phi3SmallConfig, dtype: torch.dtype, device: torch.device | str) -> None:
    n = parameter_count(config)
    check_fits(
        weight_bytes(config, dtype), device, f"the model's weights ({n / 1e9:.2f} B parameters in {dtype})"
    )
