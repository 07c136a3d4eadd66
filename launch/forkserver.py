"""A fork server: one process imports the workers' heavy modules once, then forks a fresh worker per run.

A sweep point's worker spends most of its start importing torch and megatron-core (on the H200 8.5-14 s
of megatron-core imports in an 18-25 s point, docs/evidence/h200.md). For single-process points the
controller asks a server instead, started once per sweep, that has imported them (``preload``): it
forks a child per point, which runs the worker's entry function (``target``, ``module:function``).

Each child is still a fresh process for what is measured. The server never initializes CUDA (it checks
after its imports, and refuses to serve otherwise), so every child creates its own CUDA context and
allocator; an OOM or a crash ends the child, never the server. The server also refuses to fork once it
runs threads that ``import torch`` did not start (a fork copies only the calling thread).

The rules of ``launch.process`` hold: the server runs in its own session and dies with the controller
(PDEATHSIG); each child runs in its own session and dies with the server, so kill -9 of the controller
takes the server and the worker along; the controller ends a child's process group as any worker's
(``end_group``) and forwards signals to it.

Protocol (a SEQPACKET socket pair, one JSON message per packet): the server sends ``{"ready": pid}``
(or ``{"error": text}``); each request ``{"target", "args", "env", "cwd"}`` carries the write end of the
child's output pipe as a passed file descriptor; the server answers ``{"pid": child}``, then
``{"exit": code}`` (``-N``: killed by signal N, as ``subprocess``) when the child ends.

    python -m launch.forkserver FD   # started by ForkServer, never by hand
"""

from __future__ import annotations

import importlib
import io
import json
import os
import socket
import subprocess
import sys
import tempfile
import traceback
from collections import Counter
from pathlib import Path

#: Environment variables that differ from point to point without changing what the imports did.
PER_POINT = ("MASTER_PORT",)
_MAX_MESSAGE = 1 << 20


def _send(sock: socket.socket, message: dict, fds: list[int] = ()) -> None:
    socket.send_fds(sock, [json.dumps(message).encode()], list(fds))


def _recv(sock: socket.socket) -> tuple[dict | None, list[int]]:
    data, fds, _, _ = socket.recv_fds(sock, _MAX_MESSAGE, 4)
    return (json.loads(data) if data else None), fds


class ForkedProcess:
    """A child of the fork server, with the part of ``subprocess.Popen`` the controller uses: ``pid``,
    ``stdout`` (text, line-buffered), ``wait``, ``poll``, ``returncode``, ``send_signal``."""

    def __init__(self, server: ForkServer, pid: int, stdout):
        self.server, self.pid, self.stdout, self.returncode = server, pid, stdout, None

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.server.sock.settimeout(timeout)
            try:
                message, _ = _recv(self.server.sock)
            except (TimeoutError, BlockingIOError):  # timeout 0 makes the socket non-blocking
                raise subprocess.TimeoutExpired(f"forked worker {self.pid}", timeout) from None
            finally:
                self.server.sock.settimeout(None)
            # the server gone (killed): its children die with it (PDEATHSIG), as by SIGKILL
            self.returncode = message["exit"] if message else -9
        return self.returncode

    def poll(self) -> int | None:
        try:
            return self.wait(timeout=0)
        except subprocess.TimeoutExpired:
            return None

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass


class ForkServer:
    """The controller's handle on a server that imported ``preload`` under ``env`` in ``cwd``.

    ``spawn`` starts one child at a time (a sweep runs its points one after another). Raises
    ``RuntimeError`` with the server's reason when it cannot serve (an import failed, CUDA was
    initialized, a thread was started)."""

    def __init__(self, preload: list[str], env: dict[str, str], cwd: str, timeout: float = 600.0):
        from launch.process import start_group

        self.env_key = env_key(env)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        server_env = dict(env, PYTORCH_NVML_BASED_CUDA_CHECK="1")  # is_available() without initializing CUDA
        self.log = tempfile.TemporaryFile()  # the server's own output (import warnings), read on failure
        self.proc = start_group([sys.executable, "-m", "launch.forkserver", str(theirs.fileno())],
                                env=server_env, cwd=cwd, pass_fds=[theirs.fileno()],
                                stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT)
        theirs.close()
        self.sock = ours
        _send(ours, {"preload": preload})
        ours.settimeout(timeout)
        try:
            message, _ = _recv(ours)
        except TimeoutError:
            message = {"error": f"not ready after {timeout:.0f} s"}
        ours.settimeout(None)
        if not message or "ready" not in message:
            self.close()
            self.log.seek(0)
            last = self.log.read().decode(errors="replace").strip().splitlines()[-1:]
            raise RuntimeError((message or {}).get("error") or (last[0] if last else "the server exited"))

    def spawn(self, target: str, args: list[str], env: dict[str, str], cwd: str) -> ForkedProcess:
        """Fork a child that runs ``target(*args)`` with ``env`` in ``cwd``, its output on a new pipe."""
        read_fd, write_fd = os.pipe()
        try:
            _send(self.sock, {"target": target, "args": args, "env": env, "cwd": cwd}, [write_fd])
        finally:
            os.close(write_fd)
        message, _ = _recv(self.sock)
        if not message or "pid" not in message:
            os.close(read_fd)
            raise RuntimeError((message or {}).get("error") or "the fork server exited")
        return ForkedProcess(self, message["pid"], os.fdopen(read_fd, "r", buffering=1, errors="replace"))

    def close(self) -> None:
        """End the server (it exits when its socket closes; anything left is killed)."""
        self.sock.close()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def env_key(env: dict[str, str]) -> tuple:
    """What a server's imports may have read of its environment: all of it but ``PER_POINT``."""
    return tuple(sorted((k, v) for k, v in env.items() if k not in PER_POINT))


# --- the server process -------------------------------------------------------------------------

def _threads() -> Counter:
    """This process's OS threads by name (Linux: /proc/self/task/*/comm; elsewhere one, unnamed)."""
    names: Counter = Counter()
    if not os.path.isdir("/proc/self/task"):
        return Counter({"": 1})
    for tid in os.listdir("/proc/self/task"):
        try:
            names[Path(f"/proc/self/task/{tid}/comm").read_text().strip()] += 1
        except OSError:  # ended meanwhile
            pass
    return names


def _preload(names: list[str]) -> Counter:
    """Import (and, for ``module:function``, call) each name; returns the OS threads ``import torch``
    and ``torch.cuda.is_available()`` left running: numpy's BLAS pool (idle, and a fork copies none
    of it) and, on a machine with a GPU, NVML's (megatron-core asks ``is_available`` at import, in
    dist_checkpointing/strategies/torch.py; with PYTORCH_NVML_BASED_CUDA_CHECK=1 that asks NVML, not
    the CUDA driver, and a forked child still creates its own CUDA context: tests/test_forkserver.py).
    Where NVML does not answer, ``is_available`` falls back to the driver; the server does not ask
    then, so a driver thread the imports start is refused."""
    import torch

    if torch.cuda._device_count_nvml() >= 0:  # NVML answers; else is_available would initialize CUDA
        torch.cuda.is_available()
    baseline = _threads()
    for name in names:
        module, _, function = name.partition(":")
        loaded = importlib.import_module(module)
        if function:
            getattr(loaded, function)()
    return baseline


def _unsafe(baseline: Counter) -> str | None:
    """Why this process must not fork a worker now (CUDA initialized, threads started), or None."""
    import threading

    import torch

    if torch.cuda.is_initialized():
        return "CUDA is initialized in the fork server: a forked child could not use it"
    now = _threads()
    if threading.active_count() > 1 or now.total() > baseline.total():
        new = ", ".join(f"{name or '?'} x{n}" for name, n in sorted((now - baseline).items()))
        return (f"the fork server runs threads ({now.total()}, {baseline.total()} after import torch; "
                f"new: {new or 'Python threads'})")
    return None


def _child(request: dict, out_fd: int, server: int) -> None:
    """In the forked child: own session, die with the server, output to the pipe, the point's
    environment and directory, then the target. Never returns."""
    code = 1
    try:
        from launch.process import die_with_parent

        os.setsid()
        die_with_parent(server)
        os.dup2(out_fd, 1)
        os.dup2(out_fd, 2)
        os.close(out_fd)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        unbuffered = bool(request["env"].get("PYTHONUNBUFFERED"))
        sys.stdin = open(0, closefd=False)
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=unbuffered)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True,
                                      errors="backslashreplace")
        module, _, function = request["target"].partition(":")
        sys.argv = [module, *request["args"]]
        getattr(importlib.import_module(module), function)(*request["args"])
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def serve(fd: int) -> None:
    """The server's loop: preload, say ready, then fork one child per request and report its exit."""
    import warnings

    sock = socket.socket(fileno=fd)
    message, _ = _recv(sock)
    try:
        baseline = _preload(message["preload"])
        reason = _unsafe(baseline)
    except BaseException as exc:
        reason = f"preloading failed: {type(exc).__name__}: {exc}"
    if reason:
        _send(sock, {"error": reason})
        return
    _send(sock, {"ready": os.getpid()})
    # Python warns that fork() in a process with threads may deadlock: the one extra thread is the idle
    # BLAS pool `import torch` starts (checked above), which torch's DataLoader workers fork with too.
    warnings.filterwarnings("ignore", message=".*use of fork\\(\\) may lead to deadlocks", category=DeprecationWarning)
    server = os.getpid()
    while True:
        request, fds = _recv(sock)
        if request is None:  # the controller closed its end: done
            return
        reason = _unsafe(baseline)
        if reason:  # checked before every fork, not only after the imports
            for f in fds:
                os.close(f)
            _send(sock, {"error": reason})
            continue
        sys.stdout.flush()  # else a child would write the server's buffered output into its pipe
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            sock.close()
            _child(request, fds[0], server)
        for f in fds:
            os.close(f)
        _send(sock, {"pid": pid})
        _, status = os.waitpid(pid, 0)
        _send(sock, {"exit": os.waitstatus_to_exitcode(status)})


if __name__ == "__main__":  # started by ForkServer through launch.process.start_group (dies with it)
    serve(int(sys.argv[1]))
    # nothing of the server's outlives its socket: skip the interpreter's teardown of torch and megatron
    # (the controller waits for this exit at the end of every sweep; 0.5 s on a two-core CPU machine)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
