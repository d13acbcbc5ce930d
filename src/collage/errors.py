"""Errors shared by every layer of collage.

This module imports nothing of collage, so that any module (the harness, the benchmarks,
the command line) can raise these without depending on the layer that reports them.
"""

from __future__ import annotations

__all__ = ["UsageError"]


class UsageError(Exception):
    """A mistake in the user's input (a bad flag, an unreadable file, an impossible size):
    the command line prints it as one line, without a traceback, and exits with status 2."""
