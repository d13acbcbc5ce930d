"""Ctrl-C held while a training step updates the weights and the optimizer.

Between ``optimizer.step()`` and the step's record in the history the weights, the
optimizer's state, the schedule and the history disagree: nothing there can be saved as a
checkpoint. An interruption that arrived in that window used to leave no checkpoint at all
(with ``--checkpoint-every 0`` the run was lost). :class:`HeldInterrupt` holds SIGINT over
that window and raises it once the step is recorded, where the runner saves the completed
step; a second Ctrl-C in the window raises at once (the old behaviour: no checkpoint), for
a user who does not want to wait.

Signal handlers run in the main thread only, so elsewhere (a training loop in a worker
thread) nothing is held; nor where SIGINT is ignored or left to the system.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType

__all__ = ["HeldInterrupt"]


class HeldInterrupt:
    """:meth:`hold` before the update, :meth:`release` once the step is recorded (raises
    the interruption that came in between, through the handler it replaced), and
    :meth:`restore` on the way out of the loop (the handler back, nothing raised)."""

    __slots__ = ("pending", "saved")

    def __init__(self) -> None:
        self.pending = False
        self.saved = None

    def hold(self) -> None:
        if self.saved is not None or threading.current_thread() is not threading.main_thread():
            return
        current = signal.getsignal(signal.SIGINT)
        if not callable(current):  # SIG_IGN, SIG_DFL, or set outside Python: left alone
            return
        self.pending = False
        self.saved = current
        signal.signal(signal.SIGINT, self._note)

    def _note(self, signum: int, frame: FrameType | None) -> None:
        if self.pending:  # a second Ctrl-C: at once
            self.restore()
            raise KeyboardInterrupt
        self.pending = True

    def release(self) -> None:
        handler, pending = self.saved, self.pending
        self.restore()
        if handler is not None and pending:
            handler(signal.SIGINT, None)  # Python's default raises KeyboardInterrupt

    def restore(self) -> None:
        if self.saved is not None:
            signal.signal(signal.SIGINT, self.saved)
        self.saved, self.pending = None, False
