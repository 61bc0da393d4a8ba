"""Stop requests: Ctrl-C (SIGINT) and a job scheduler's SIGTERM end a training run with a resumable checkpoint.

- **SIGINT** (Ctrl-C, a person at a terminal) stops at once: ``KeyboardInterrupt`` is raised where the program is,
  as Python always does. The request is also remembered, so an interrupt that Python loses (raised inside a
  destructor or a callback that swallows exceptions) still stops the run at the next step boundary.
- **SIGTERM** (what SLURM, Kubernetes and torchrun send before SIGKILL, usually 30 s later) is remembered, and
  the training loop stops at the end of the current optimizer step, writes a resumable checkpoint there and raises
  :class:`~dpllm.resume.Interrupted`; before or after the loop it stops at once, like Ctrl-C. The command exits
  143 (128 + SIGTERM), Ctrl-C 130.
- A signal this process was started **ignoring** (``nohup``, a background job of a shell without job control)
  stays ignored: that is the parent's decision, and Python itself follows it for SIGINT.

Under ``accelerate launch`` every process gets the signal at about the same time, but not at the same step;
the loop asks all processes at each step boundary (one all-reduce of three numbers) so that all stop at
the same step and write one checkpoint together.
"""

from __future__ import annotations

import signal
import threading
from typing import Optional

#: exit status of a command stopped by each signal (the shell's convention, 128 + the signal number)
EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}


class StopRequests:
    """Catches SIGINT and SIGTERM while installed; ``requested`` is the signal received, if any.

    >>> stops = StopRequests()
    >>> stops.requested is None
    True
    """

    def __init__(self) -> None:
        self.requested: Optional[int] = None
        self.defer_term = False  # inside the loop, SIGTERM waits for the step boundary
        self._previous: dict[int, object] = {}

    def install(self) -> "StopRequests":
        """Handle SIGINT and SIGTERM (main thread only; a signal inherited as ignored stays ignored)."""
        if threading.current_thread() is not threading.main_thread():
            return self
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous = signal.getsignal(sig)
            if previous is signal.SIG_IGN or previous is None:
                continue
            self._previous[sig] = previous
            signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        """Put the handlers back as they were."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        self.requested = signal.SIGTERM if signal.SIGTERM in (signum, self.requested) else signum
        if signum == signal.SIGTERM and self.defer_term:
            return
        raise KeyboardInterrupt

    def __enter__(self) -> "StopRequests":
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()


def signal_name(signum: Optional[int]) -> str:
    """``"SIGTERM"`` for 15, and so on; Ctrl-C's SIGINT when no signal was recorded."""
    return signal.Signals(signum or signal.SIGINT).name
