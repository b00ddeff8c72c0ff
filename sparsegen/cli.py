"""The `sparsegen` command line. Each command lives in `sparsegen/commands/<name>.py`.

Commands are imported on first use, so `sparsegen patterns` does not pay for Triton or NVRTC.
sparsegen's own errors (a bad spec, a bad input, an unavailable backend) become a one-line
message and exit status 2, never a traceback.
"""

from __future__ import annotations

import importlib

import click

from .errors import SparsegenError

COMMANDS = {
    "patterns": "List the preset patterns.",
    "show": "Show per-head density and a picture of a pattern's block mask.",
    "compile": "Compile (or fetch from the cache) every distinct kernel of a pattern.",
    "cache": "Inspect or clear the kernel cache.",
    "fuzz": "Fuzz the generated kernels against the reference.",
    "generate": "Generate text with Phi-3-Small through sparsegen's kernels.",
    "bench": "Benchmark kernels against dense SDPA, FlexAttention and the ceilings.",
    "serve": "Serve the OpenAI API over HTTP (needs the [serve] extra).",
}


class _LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in COMMANDS:
            return None
        return importlib.import_module(f"sparsegen.commands.{name}").command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        # Short help comes from COMMANDS, so `--help` imports nothing heavy.
        with formatter.section("Commands"):
            formatter.write_dl(list(COMMANDS.items()))

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except SparsegenError as exc:
            raise click.UsageError(str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from None


@click.group(cls=_LazyGroup)
@click.version_option(package_name="sparsegen")
def cli() -> None:
    """sparsegen: block-sparse attention kernels, JIT-compiled from per-head sparsity specs."""


def main() -> None:
    cli()


if __name__ == "__main__":
    main()
