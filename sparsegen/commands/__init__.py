"""One module (or package, for a command with parts) per `sparsegen` CLI command, and the small
pieces they share (options, exit statuses, tables, progress bars); `sparsegen/cli.py` wires
the commands together."""
