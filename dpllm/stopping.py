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

**A signal that reaches only the launcher.** With several processes (``--multi_gpu``, FSDP) accelerate runs
torchrun's agent, which passes SIGINT and SIGTERM on to every worker. With one process it starts the worker
with a plain ``subprocess.Popen`` and passes nothing on: a SIGTERM kills the launcher outright, a SIGINT ends
it with a traceback, and the worker, left behind, would train to the end. So a worker started that way asks
Linux (``prctl(PR_SET_PDEATHSIG)``) for a SIGTERM when its launcher ends, however it ends (SIGKILL included),
and stops as for a scheduler's SIGTERM: at the end of the step, with a resumable checkpoint and one line. The
recipe asks first thing, before torch is imported (:func:`follow_launcher`). One case stays out of reach: the
launcher as pid 1 of a container (``docker stop``, Kubernetes) is sent SIGTERM, and the kernel drops a signal
that pid 1 has no handler for; the worker warns at start (run one process as ``python SCRIPT`` there).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Optional

log = logging.getLogger(__name__)

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
        self._stopping = False  # a KeyboardInterrupt was raised: a later SIGTERM is only recorded
        self._follows_launcher = False

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
        if signal.SIGTERM in self._previous and follow_launcher():
            self._follows_launcher = True
            if os.getppid() == 1:  # pid 1 of a container: the kernel drops every signal it has no handler for
                log.warning("accelerate launch runs as pid 1 with one process: it ignores SIGTERM (docker stop, "
                            "Kubernetes), so none reaches this run and no checkpoint is written when the container "
                            "is stopped; start one process as `python SCRIPT ...` (exec form) instead, or launch "
                            "with --multi_gpu (torchrun passes SIGTERM on)")
        return self

    def uninstall(self) -> None:
        """Put the handlers back as they were."""
        if self._follows_launcher:  # past this point the launcher's end must not kill a process that is leaving
            _parent_death_signal(0)
            self._follows_launcher = False
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        self.requested = signal.SIGTERM if signal.SIGTERM in (signum, self.requested) else signum
        if signum == signal.SIGTERM and (self.defer_term or self._stopping):
            # a SIGTERM while a Ctrl-C is already unwinding (the launcher ending right after it, say) would
            # replace the interruption, which knows where the run stopped, by a bare one
            return
        self._stopping = True
        raise KeyboardInterrupt

    def __enter__(self) -> "StopRequests":
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()


def follow_launcher() -> bool:
    """Under accelerate's single-process launcher, ask Linux for a SIGTERM to this process when the launcher ends.

    Nothing elsewhere: torchrun's agent (``--multi_gpu``, FSDP; it sets ``TORCHELASTIC_RUN_ID``) passes signals
    on itself, and a process whose parent is not accelerate (``python SCRIPT`` from a shell that exports
    accelerate's variables) has no launcher to follow. Call it as early as possible: a launcher that ends before
    it leaves its worker training alone. Until the handlers of :class:`StopRequests` are installed the SIGTERM
    ends the process at once (nothing of a run is written yet).

    Returns:
        True when this process now follows its launcher.
    """
    if "ACCELERATE_MIXED_PRECISION" not in os.environ or "TORCHELASTIC_RUN_ID" in os.environ:
        return False  # every accelerate launcher sets the first; only torchrun's agent the second
    return _parent_is_accelerate_launch() and _parent_death_signal(signal.SIGTERM)


def die_with_parent(sig: int = signal.SIGTERM) -> bool:
    """Ask the kernel to send this process ``sig`` (SIGTERM) when its parent dies (Linux ``PR_SET_PDEATHSIG``).

    A worker started by ``accelerate launch`` otherwise outlives a launcher killed with SIGKILL and keeps
    writing into the run directory (:func:`dpllm.distributed.make_accelerator` calls it in every launched
    process). Returns False where the call is unavailable (not Linux). Needs no torch: a process can ask before
    its imports.
    """
    if not _parent_death_signal(sig):
        return False
    if os.getppid() == 1:  # the parent died before the request: nobody will send the signal
        os.kill(os.getpid(), sig or signal.SIGTERM)
    return True


def _parent_death_signal(signum: int) -> bool:
    """Ask Linux to send ``signum`` (0: nothing) when the parent process ends; False where that is not possible."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(1, signum, 0, 0, 0) == 0  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return False


def _parent_is_accelerate_launch() -> bool:
    """Whether the parent process is accelerate's launcher (`accelerate launch`, `python -m accelerate...`)."""
    try:
        argv = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return any(b"accelerate" in a for a in argv)


def program_of(script: str) -> str:
    """How ``script`` was started, as a person retypes it: ``python SCRIPT``, or under ``accelerate launch``
    the launcher's own options (read from the parent process on Linux; else a placeholder for them).

    Read it at start: a worker whose single-process launcher was signalled outlives it (:func:`follow_launcher`).
    """
    import shlex

    if "WORLD_SIZE" not in os.environ and "ACCELERATE_MIXED_PRECISION" not in os.environ:
        return f"python {shlex.quote(script)}"
    try:
        parent = [a.decode() for a in Path(f"/proc/{os.getppid()}/cmdline").read_bytes().split(b"\0") if a]
        start = parent.index("launch")
        return shlex.join(["accelerate", *parent[start: parent.index(script, start) + 1]])
    except (OSError, ValueError, UnicodeDecodeError):
        return f"accelerate launch [your launch options] {shlex.quote(script)}"


def signal_name(signum: Optional[int]) -> str:
    """``"SIGTERM"`` for 15, and so on; Ctrl-C's SIGINT when no signal was recorded."""
    return signal.Signals(signum or signal.SIGINT).name


def release_process_group() -> None:
    """Destroy the default process group, if any (a command's last step; every process has passed the last barrier).

    A process that never imported ``torch.distributed`` has no group: nothing is imported to find that out."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def finish_process(code: int) -> int:
    """End a command: release the process group; a launched worker then exits at once with ``code``.

    A worker started by ``accelerate launch`` / ``torchrun`` can abort in interpreter teardown after its work is
    done: "terminate called without an active exception", SIGABRT, with no Python frame left, even after
    ``destroy_process_group`` (gloo's C++ threads are torn down with the interpreter). The launcher then reports
    a run whose checkpoint and report were already written as failed. Measured on 2 CPU cores with 3 concurrent
    2-process runs of tests/fsdp_worker.py: 1 abort in 27 runs before, none in 75 after (issue 21's note).
    So a launched worker flushes its streams and logs and leaves with ``os._exit`` (no teardown to abort in);
    any other process returns ``code`` for ``sys.exit``. Light (no torch import), as :func:`follow_launcher`: the
    recipe calls it whether or not training code was loaded.
    """
    release_process_group()
    if "LOCAL_RANK" not in os.environ:
        return code
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    logging.shutdown()
    os._exit(code)
