"""Assertions shared by the CLI tests: how a one-line error must look."""

from __future__ import annotations


def one_error_line(capsys) -> str:
    """The single stderr line of a failed command, checked to be one `tritune: error:` line."""
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("tritune: error: ")
    return lines[0]
