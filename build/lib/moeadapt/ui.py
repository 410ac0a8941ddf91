"""One console for everything the CLI prints: wide tables and unwrapped log lines when output is not a terminal."""

from __future__ import annotations

import sys

from rich.console import Console


def make_console() -> Console:
    return Console(soft_wrap=True, width=None if sys.stdout.isatty() else 160)
