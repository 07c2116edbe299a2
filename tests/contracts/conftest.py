"""Contract tests: every real name the roles rely on, checked against the real packages (README.md).

Debian's archive is always read live. Ubuntu's is read live when it answers, else the recorded fixtures
stand in; the terminal summary says which, per archive.
"""

from __future__ import annotations

import contractlib
import pytest
from contractlib import READINGS as _HOW


@pytest.fixture(scope="session")
def facts() -> list[contractlib.Fact]:
    return contractlib.load_facts()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _HOW:
        return
    parts = []
    if _HOW["downloaded"]:
        parts.append(f"{_HOW['downloaded']} from Debian's archive (downloaded)")
    if _HOW["live"]:
        parts.append(f"{_HOW['live']} from Ubuntu's archive (live)")
    if _HOW["fixture"]:
        parts.append(f"{_HOW['fixture']} from recorded Ubuntu fixtures (the Ubuntu archive did not answer)")
    terminalreporter.write_line("contracts: facts read " + "; ".join(parts))
