"""Child-process set-up shared by the stack's subprocesses."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
from collections.abc import Callable
from typing import Any

_PR_SET_PDEATHSIG = 1
_LIBC: Any = None


def child_setup(*, die_with_parent: bool) -> Callable[[], None]:
    """``preexec_fn``: own process group in the caller's session (not ``setsid``: a new session
    gets its own scheduler autogroup and skews CPU shares); optionally SIGTERM on parent death."""
    global _LIBC
    parent = os.getpid()
    if die_with_parent and _LIBC is None:
        with contextlib.suppress(OSError):
            _LIBC = ctypes.CDLL(None, use_errno=True)
    libc = _LIBC if die_with_parent else None

    def setup() -> None:
        os.setpgrp()
        if libc is not None:
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
            if os.getppid() != parent:  # the parent died before prctl took effect
                os._exit(1)

    return setup
