"""``python -m prefetch.cli``."""

from prefetch.cli import main

main()
