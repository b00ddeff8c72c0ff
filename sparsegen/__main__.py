"""`python -m sparsegen` runs the `sparsegen` command line."""

from .cli import main

main()
