"""The `sparsegen` command line. Each command lives in `sparsegen/commands/<name>.py` (or, with
its parts, `sparsegen/commands/<name>/`).

Commands are imported on first use, and `import sparsegen` loads torch only when a name that
needs it is touched, so `sparsegen --help` and `--version` answer without importing torch.

Exit status (DESIGN §3): 0 success; 2 a usage error (a bad option, or a sparsegen error
caused by the input: a bad spec, argument, checkpoint, tokenizer or environment variable);
1 a runtime failure (a missing extra, SPARSEGEN_DISABLE_JIT with a cold cache, an unsafe
cache, a kernel that fails to compile, no GPU where one is needed, out of memory). Both print
exactly one line on stderr, `Error: ...`, never a traceback. Data goes to stdout; messages go
through `logging.getLogger("sparsegen")` to stderr.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys

import click

from . import __version__
from .commands.exits import RuntimeFailure, first_line, is_usage_error
from .errors import SparsegenError

COMMANDS = {
    "patterns": "List the preset patterns.",
    "show": "Show per-head density and a picture of a pattern's block mask.",
    "compile": "Compile (or fetch from the cache) every distinct kernel of a pattern.",
    "cache": "Inspect, verify (re-hash) or clear the kernel cache.",
    "fuzz": "Fuzz the generated kernels against the reference.",
    "generate": "Generate text with Phi-3-Small through sparsegen's kernels.",
    "serve": "Serve the OpenAI API over HTTP (needs the [serve] extra).",
    "bench": "Benchmark kernels against dense SDPA, FlexAttention and the ceilings.",
    "env": "Report versions, the GPU, the cache and every SPARSEGEN_* variable (for bug reports).",
}


def _out_of_memory(exc: BaseException) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(exc, getattr(torch, "OutOfMemoryError", ()))


class _LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return [name for name in COMMANDS if self._available(name)]

    @staticmethod
    def _available(name: str) -> bool:
        return importlib.util.find_spec(f"sparsegen.commands.{name}") is not None

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in COMMANDS or not self._available(name):
            return None
        from .commands.param_types import checked_options  # UTF-8 text, finite floats

        return checked_options(importlib.import_module(f"sparsegen.commands.{name}").command)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        # Short help comes from COMMANDS, so `--help` imports nothing heavy.
        with formatter.section("Commands"):
            formatter.write_dl([(n, COMMANDS[n]) for n in self.list_commands(ctx)])

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except click.exceptions.Exit as exc:  # ctx.exit(n) in a command: main() below would drop n
            sys.exit(exc.exit_code)
        except SparsegenError as exc:
            if is_usage_error(exc):
                raise click.UsageError(first_line(exc)) from None
            raise RuntimeFailure(first_line(exc)) from None
        except MemoryError as exc:
            raise RuntimeFailure(f"out of memory: {first_line(exc)}") from None
        except RuntimeError as exc:
            if _out_of_memory(exc):
                raise RuntimeFailure(f"out of memory: {first_line(exc)}") from None
            raise

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        """click's main, but every error is one line on stderr (click prints usage errors over
        four lines: usage, hint, blank line, error)."""
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.UsageError as exc:
            hint = ""
            if exc.ctx is not None and not exc.ctx.resilient_parsing:
                hint = f" (see '{exc.ctx.command_path} --help')"
            click.echo(f"Error: {first_line(click.ClickException(exc.format_message()))}{hint}", err=True)
            sys.exit(exc.exit_code)
        except click.ClickException as exc:
            click.echo(f"Error: {first_line(click.ClickException(exc.format_message()))}", err=True)
            sys.exit(exc.exit_code)
        except click.Abort:
            click.echo("Aborted!", err=True)
            sys.exit(1)
        except OSError as exc:  # e.g. a closed stdout pipe (`sparsegen ... | head`)
            if getattr(exc, "errno", None) == 32:
                sys.exit(1)
            raise
        sys.exit(0)


@click.group(cls=_LazyGroup)
@click.version_option(__version__, prog_name="sparsegen")
def cli() -> None:
    """sparsegen: block-sparse attention kernels, JIT-compiled from per-head sparsity specs."""
    from .log import install_cli_handler

    install_cli_handler()  # an unreadable SPARSEGEN_QUIET / SPARSEGEN_LOG_LEVEL: EnvError, exit 2


def main() -> None:
    cli()


if __name__ == "__main__":
    main()
