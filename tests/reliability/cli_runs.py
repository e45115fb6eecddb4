"""Running ``dkfac`` in-process for the red-team tests: exit code and stderr of one call."""

from __future__ import annotations

import pytest

from dkfac.app.cli import main
from tests.cli_args import TINY

# TINY, two steps: the smallest real training run.
SHORT = [*TINY, "--epochs", "1", "--steps", "2"]


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """``dkfac argv`` in this process: ``(exit code, stderr)`` whether it returns or exits."""
    try:
        code = main(argv)
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 1
    return int(code or 0), capsys.readouterr().err


def last_line(err: str) -> str:
    """The last non-empty line of stderr (argparse prints the usage before it)."""
    lines = [line for line in err.splitlines() if line.strip()]
    return lines[-1] if lines else ""
