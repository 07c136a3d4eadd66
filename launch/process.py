"""Worker processes that die with their controller.

The controller starts each run's workers in a new session (their own process group) and asks the
kernel to SIGKILL its direct child when the controller dies, however it dies (SIGKILL included:
no cleanup code runs then). Each worker rank asks the same of its own parent (torchrun), so the
whole group goes: a killed sweep leaves no worker holding a GPU's memory while the user re-runs.
On the controller's own exit paths (an exception, Ctrl-C) it kills the group itself (``end_group``).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys

#: The signals that ask a run to save a checkpoint and stop: SIGTERM (``kill``, a preemption) and the
#: warning a scheduler sends before the time limit: SIGUSR2 is what submitit's sbatch asks Slurm for
#: (``--signal=USR2@<hydra.launcher.signal_delay_s>``, submitit's default), SIGUSR1 what a hand-written
#: ``sbatch --signal=USR1@120`` often asks for. The controller forwards them, torchrun passes them on,
#: each worker saves on them (``recipes.run.worker.StopSignal``).
PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
#: What the launcher of a run's ranks passes on to them: the signals that end a process and the
#: preemption ones (torchrun's ``--signals-to-handle``, a fork server's rank group).
RANK_SIGNALS = tuple(dict.fromkeys((signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, *PREEMPT_SIGNALS)))
_PR_SET_PDEATHSIG = 1  # linux/prctl.h
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def die_with_parent(parent: int | None = None) -> None:
    """Have the kernel SIGKILL this process when its parent dies (Linux; elsewhere a no-op).

    ``parent``: the pid that must still be the parent after the call (the parent may have died
    before it); by default the parent at the time of the call. Safe in a ``preexec_fn``."""
    if _LIBC is None:
        return
    expected = os.getppid() if parent is None else parent
    _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != expected:  # the parent died before the request: nobody would signal us
        os._exit(1)


def start_group(command: list[str], **kwargs) -> subprocess.Popen:
    """``command`` in a new session (its own process group) that dies with this process."""
    me = os.getpid()
    return subprocess.Popen(command, start_new_session=True, preexec_fn=lambda: die_with_parent(me), **kwargs)


def end_group(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    """SIGTERM the process group of ``proc`` (torchrun passes it to the ranks), SIGKILL what is left
    after ``grace_s``; waits for ``proc``."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait)
            if sig == signal.SIGTERM:  # the leader is gone; its group may not be
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            break
        except subprocess.TimeoutExpired:
            continue
