"""`sparsegen bench`: kernels vs dense SDPA, FlexAttention and the ceilings, in one run (GPU)."""

from __future__ import annotations

import json

import click
import torch

from ...errors import ImplUnavailableError
from ...log import get_logger
from ...presets import get_pattern
from ...spec import ModelSpec
from .. import progress
from .cases import LAYERS, select_cases

NAN = float("nan")
RESULT_FORMAT = "sparsegen.bench/2"  # prefill rows carry "peers", "of_ceiling", "best_peer", "x_best_peer"
log = get_logger(__name__)

# The summary tables: (header, value from one result row); "x_*" are speed-ups of sparsegen.
SUMMARY_COLUMNS = {
    "prefill": [
        ("prefill", lambda r: r["pattern"]),
        ("seq", lambda r: r["seq_len"]),
        ("variant", lambda r: r.get("variant", "")),
        ("sg_ms", lambda r: r["sparsegen_ms"]),
        ("api_ms", lambda r: r["sparsegen_api_ms"]),
        ("api_max_ms", lambda r: r.get("sparsegen_api_max_seqlen_ms", NAN)),
        ("sdpa_ms", lambda r: r["sdpa_dense_ms"]),
        ("flex_ms", lambda r: r.get("peers", {}).get("flex", r.get("flex_ms", NAN))),
        ("flex_flash_ms", lambda r: r.get("peers", {}).get("flex_flash", NAN)),
        ("fa4_ms", lambda r: r.get("peers", {}).get("fa4", NAN)),
        ("floor_ms", lambda r: r["floor_ms"]),
        ("x_sdpa", lambda r: r["sdpa_dense_ms"] / r["sparsegen_ms"]),
        ("x_flex", lambda r: r.get("flex_ms", NAN) / r["sparsegen_ms"]),
        ("best_peer", lambda r: r.get("best_peer") or "-"),
        ("x_best_peer", lambda r: r.get("x_best_peer", NAN)),
        ("of_floor", lambda r: r["sparsegen_ms"] / r["floor_ms"]),
        ("of_ceiling", lambda r: r["floor_ms"] / r["sparsegen_ms"]),
        ("fa4_of_ceiling", lambda r: r.get("of_ceiling", {}).get("fa4") or NAN),
        ("api_of_ceiling", lambda r: r["floor_ms"] / r.get("sparsegen_api_max_seqlen_ms", NAN)),
    ],
    "decode": [
        ("decode", lambda r: r["pattern"]),
        ("BxS", lambda r: f"{r['batch']}x{r['seq_len']}"),
        ("sg_us", lambda r: r["sparsegen_us"]),
        ("sdpa_us", lambda r: r["sdpa_dense_us"]),
        ("flex_us", lambda r: r.get("flex_us", NAN)),
        ("floor_us", lambda r: r["floor_us"]),
        ("x_sdpa", lambda r: r["sdpa_dense_us"] / r["sparsegen_us"]),
        ("x_flex", lambda r: r.get("flex_us", NAN) / r["sparsegen_us"]),
        ("of_floor", lambda r: r["sparsegen_us"] / r["floor_us"]),
        ("TB/s", lambda r: r["achieved_tb_s"]),
    ],
}
DECODE_CASES = [("phi3small", 64, 8192), ("phi3small", 8, 32768), ("phi3small", 1, 131072)]


def _sparse_layer(model: ModelSpec):
    return model.layers[model.first_sparse_layer()]


@click.command(name="bench")
@click.option("--kind", type=click.Choice(["prefill", "decode", "all"]), default="all", show_default=True)
@click.option("--max-seq-len", type=int, default=131072, show_default=True, help="Skip longer cases.")
@click.option("--long", "long_cases", is_flag=True, help="Also run the 128K prefill cases (slow).")
@click.option(
    "--case",
    "case_names",
    multiple=True,
    type=click.Choice(list(LAYERS)),
    help="Run only these prefill cases (repeatable; default: all).",
)
@click.option("--no-flex", is_flag=True, help="Skip FlexAttention (its compile takes a while per shape).")
@click.option(
    "--flex-max-seq-len",
    type=int,
    default=32768,
    show_default=True,
    help="Run FlexAttention only up to this length (each new shape recompiles it).",
)
@click.option("--out", type=click.Path(dir_okay=False, writable=True), default=None, help="Write JSON here.")
def command(kind: str, max_seq_len: int, long_cases: bool, case_names: tuple[str, ...], no_flex: bool,
            flex_max_seq_len: int, out: str | None) -> None:  # fmt: skip
    """Time sparsegen's kernels against their peers: prefill against SDPA, FlexAttention (Triton
    and FLASH backends) and FlashAttention-4 on dense, window, Phi-3-Small, gpt-oss and Gemma-2
    layers; decode against dense SDPA and FlexAttention on Phi-3-Small shapes.

    Ratios come from one process on one GPU; the ceilings (copy bandwidth, bf16 matmul) are
    measured first, in the same run. FA4 and the FLASH backend need the `bench` extra
    (`flash_attn.cute`); without it their columns read "n/a (flash_attn.cute not installed)".
    """
    if not torch.cuda.is_available():
        raise ImplUnavailableError("sparsegen bench needs a CUDA GPU; torch sees none")
    from ..table import format_table
    from . import decode, prefill
    from .common import measure_ceilings

    def flex(seq: int) -> bool:
        return not no_flex and seq <= flex_max_seq_len

    prefill_cases = select_cases(long=long_cases, max_seq_len=max_seq_len, names=case_names)
    prefill_cases = prefill_cases if kind in ("prefill", "all") else []
    decode_cases = [(p, b, s) for p, b, s in DECODE_CASES if kind in ("decode", "all") and s <= max_seq_len]
    ceilings = measure_ceilings()
    gpu = torch.cuda.get_device_name()
    log.info(f"{gpu}: copy {ceilings.copy_tb_s:.2f} TB/s, bf16 matmul {ceilings.matmul_tflop_s:.0f} TFLOP/s")
    bar = progress.bar(len(prefill_cases) + len(decode_cases), "bench", unit="case")
    result = {
        "format": RESULT_FORMAT,
        "gpu": gpu,
        "torch": torch.__version__,
        "ceilings": ceilings.to_dict(),
        "prefill": [],
        "decode": [],
    }
    with bar:
        for case in prefill_cases:
            bar.note(f"prefill {case.name} {case.seq_len}")
            row = prefill.bench_case(case.layer(), case.seq_len, ceilings, flex=flex(case.seq_len))
            row["pattern"] = row["case"] = case.name
            result["prefill"].append(row)
            bar.echo(json.dumps(row))
            bar.update(1)
        for pattern, batch, seq in decode_cases:
            bar.note(f"decode {pattern} {batch}x{seq}")
            row = decode.bench_case(
                _sparse_layer(get_pattern(pattern)), batch, seq, ceilings, flex=not no_flex
            )
            row["pattern"] = pattern
            result["decode"].append(row)
            bar.echo(json.dumps(row))
            bar.update(1)
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
    click.echo("== summary")
    for kind, columns in SUMMARY_COLUMNS.items():
        if result[kind]:
            rows = [[get(r) for _, get in columns] for r in result[kind]]
            click.echo(format_table([name for name, _ in columns], rows))
