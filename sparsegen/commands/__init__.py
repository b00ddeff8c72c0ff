"""One module per `sparsegen` CLI command; `sparsegen/cli.py` wires them together."""
