"""`python -m exlq` is the `exlq` command."""

from exlq.cli import main

main()
