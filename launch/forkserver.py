"""A fork server: one process imports the workers' heavy modules once, then forks a fresh worker per run.

A sweep point's worker spends most of its start importing torch and megatron-core (on the H200 8.5-14 s
of megatron-core imports in an 18-25 s point, docs/evidence/h200.md; on a 2-core CPU 13 of a two-rank
run's 16 s a rank). The controller asks a server instead, started once per sweep, that has imported
them (``preload``): it forks a child per point, which runs the worker's entry function (``target``,
``module:function``). A point of several processes on one machine forks a *rank group*: one child that
does what torchrun does for one node (``_rank_group``): it forks the ranks with torchrun's environment,
hosts their rendezvous store, passes them the preemption signals and stops the rest when one fails.

Each child is still a fresh process for what is measured. The server never initializes CUDA (it checks
after its imports, and refuses to serve otherwise), so every child creates its own CUDA context and
allocator; an OOM or a crash ends the child, never the server. The server also refuses to fork once it
runs threads that ``import torch`` did not start (a fork copies only the calling thread).

The rules of ``launch.process`` hold: the server runs in its own session and dies with the controller
(PDEATHSIG); each child runs in its own session and dies with the server, so kill -9 of the controller
takes the server and the worker along; the controller ends a child's process group as any worker's
(``end_group``) and forwards signals to it.

A *shared* server (``python -m launch.forkserver --listen PATH``, named to controllers by the
``RECIPES_FORK_SERVER`` environment variable) serves every controller that connects with the environment
it imported under: the test suite starts one per pytest worker, so its hundred train.py runs import
megatron-core once. Each connection gets its own handler (a fork of the server); a controller that dies
closes its connection, and the handler then kills the worker it forked (the worker dies with the
handler, not the controller).

Protocol (a SEQPACKET socket, one JSON message per packet): the server sends ``{"ready": pid}`` (or
``{"error": text}``) once it has imported ``{"preload": [...]}`` (a shared server: once it has compared
the controller's ``{"env": {...}}`` with its own); each request ``{"target", "args", "env", "cwd",
"nproc"}`` carries the write end of the child's output pipe as a passed file descriptor; the server
answers ``{"pid": child}``, then ``{"exit": code}`` (``-N``: killed by signal N, as ``subprocess``)
when the child ends.

    python -m launch.forkserver FD             # started by ForkServer, never by hand
    python -m launch.forkserver --listen PATH  # a shared server (tests/conftest.py starts one)
"""

from __future__ import annotations

import importlib
import io
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path

#: Environment variables that differ from point to point without changing what the imports did: a rank's
#: place in its world (read when the process group starts), the hardware queues CUDA reads as it starts,
#: compile caches (read at each compile: torch/_inductor/runtime/cache_dir_utils.py) and the pointer
#: inductor leaves for its own process's compiled code, pytest's name of the test that runs; and by
#: prefix, W&B's settings (read by wandb.init), this project's own (read as a run goes), Transformer
#: Engine's backend switches (megatron sets them as it builds), cuBLAS's and NCCL's
#: (``train.deterministic``'s: read as those libraries start, in the child), and submitit's job variables
#: (read by ``submitit.JobEnvironment`` as the job runs).
PER_POINT = ("MASTER_PORT", "MASTER_ADDR", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
             "CUDA_DEVICE_MAX_CONNECTIONS", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR",
             "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR", "PYTEST_CURRENT_TEST")
PER_POINT_PREFIXES = ("WANDB_", "RECIPES_", "NVTE_", "CUBLAS_", "NCCL_", "SUBMITIT_")
#: Names the socket of a shared server (``--listen``) that controllers fork their workers from.
SHARED_SERVER_ENV = "RECIPES_FORK_SERVER"
#: A rank group stops its other ranks when one fails: SIGTERM, then SIGKILL after this long (torchrun's 30 s)
STOP_GRACE_S = 30.0
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
    """The controller's handle on a server that imported ``preload`` under ``env`` in ``cwd`` (started
    for this controller), or on a shared one (``connect``).

    ``spawn`` starts one child at a time (a sweep runs its points one after another). Raises
    ``RuntimeError`` with the server's reason when it cannot serve (an import failed, CUDA was
    initialized, a thread was started, a shared server imported under another environment)."""

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
        self.pid = self._ready(timeout)

    @classmethod
    def connect(cls, path: str, env: dict[str, str], timeout: float = 30.0) -> ForkServer:
        """A handle on the shared server listening at ``path``, if it imported under ``env``."""
        self = cls.__new__(cls)
        self.env_key, self.proc, self.log = env_key(env), None, None
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock.settimeout(timeout)
        try:
            self.sock.connect(path)
        except OSError as err:
            self.sock.close()
            raise RuntimeError(f"no fork server at {path} ({err.strerror or err})") from None
        self.sock.settimeout(None)
        _send(self.sock, {"env": env})
        self.pid = self._ready(timeout)
        return self

    def _ready(self, timeout: float) -> int:
        self.sock.settimeout(timeout)
        try:
            message, _ = _recv(self.sock)
        except TimeoutError:
            message = {"error": f"not ready after {timeout:.0f} s"}
        self.sock.settimeout(None)
        if not message or "ready" not in message:
            last = []
            if self.log is not None:
                self.log.seek(0)
                last = self.log.read().decode(errors="replace").strip().splitlines()[-1:]
            self.close()
            raise RuntimeError((message or {}).get("error") or (last[0] if last else "the server exited"))
        return message["ready"]

    def spawn(self, target: str, args: list[str], env: dict[str, str], cwd: str, nproc: int = 1) -> ForkedProcess:
        """Fork a child that runs ``target(*args)`` with ``env`` in ``cwd``, its output on a new pipe;
        with ``nproc`` above 1, a rank group of that many (``_rank_group``)."""
        read_fd, write_fd = os.pipe()
        try:
            _send(self.sock, {"target": target, "args": args, "env": env, "cwd": cwd, "nproc": nproc}, [write_fd])
        finally:
            os.close(write_fd)
        message, _ = _recv(self.sock)
        if not message or "pid" not in message:
            os.close(read_fd)
            raise RuntimeError((message or {}).get("error") or "the fork server exited")
        return ForkedProcess(self, message["pid"], os.fdopen(read_fd, "r", buffering=1, errors="replace"))

    def close(self) -> None:
        """End the server, or this controller's connection to a shared one (its handler exits)."""
        self.sock.close()
        if self.proc is None:
            return
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def env_key(env: dict[str, str]) -> tuple:
    """What a server's imports may have read of its environment: all of it but ``PER_POINT`` (names
    and prefixes)."""
    return tuple(sorted((k, v) for k, v in env.items() if k not in PER_POINT and not k.startswith(PER_POINT_PREFIXES)))


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
    environment and directory, then the target (or, for ``nproc`` above 1, a rank group). Never returns."""
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
        code = _rank_group(request) if int(request.get("nproc") or 1) > 1 else _run_target(request)
    finally:
        _flush()
        os._exit(code)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass


def _run_target(request: dict) -> int:
    """``target(*args)`` in this process: its exit code (a traceback printed for an exception)."""
    try:
        module, _, function = request["target"].partition(":")
        sys.argv = [module, *request["args"]]
        getattr(importlib.import_module(module), function)(*request["args"])
        return 0
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
        return 1


def _rank_group(request: dict) -> int:
    """What torchrun does for one node, in a forked child: fork ``nproc`` ranks with torchrun's
    environment (RANK, LOCAL_RANK, WORLD_SIZE, ...), host their rendezvous store as torchrun's agent does
    (``TORCHELASTIC_USE_AGENT_STORE``: every rank a client), pass ``RANK_SIGNALS`` on to them, and
    when one fails stop the others (SIGTERM, SIGKILL after ``STOP_GRACE_S``). Returns 0, or the first
    failed rank's exit code (128 + N for signal N)."""
    from launch.process import RANK_SIGNALS, die_with_parent

    nproc, leader = int(request["nproc"]), os.getpid()
    ranks: dict[int, int] = {}  # pid: rank
    port_pipes: list[int] = []
    _flush()
    for rank in range(nproc):
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:  # a rank: waits for the store's port, then runs the target
            code = 1
            try:
                os.close(write_fd)
                for fd in port_pipes:
                    os.close(fd)
                die_with_parent(leader)
                port = os.read(read_fd, 16).decode()
                os.close(read_fd)
                if port:  # else the leader could not start the store: it says why
                    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", ROLE_RANK=str(rank),
                                      WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc), ROLE_WORLD_SIZE=str(nproc),
                                      MASTER_ADDR="127.0.0.1", MASTER_PORT=port, TORCHELASTIC_USE_AGENT_STORE="True")
                    code = _run_target(request)
            finally:
                _flush()
                os._exit(code)
        os.close(read_fd)
        port_pipes.append(write_fd)
        ranks[pid] = rank
    live = dict(ranks)

    def forward(signum, _frame):
        for pid in live:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

    for sig in RANK_SIGNALS:
        signal.signal(sig, forward)
    try:  # after the forks: the store's thread is this process's own
        from torch.distributed import TCPStore

        store = TCPStore("127.0.0.1", 0, nproc, is_master=True, wait_for_workers=False)
        port = str(store.port).encode()
    except Exception as err:  # the ranks read an empty port and exit
        print(f"[ranks] the rendezvous store did not start: {type(err).__name__}: {err}", file=sys.stderr)
        port = b""
    for fd in port_pipes:
        if port:
            os.write(fd, port)
        os.close(fd)
    failed, deadline = None, None
    while live:
        pid, status = os.waitpid(-1, os.WNOHANG if deadline else 0)
        if pid == 0:  # stopping the rest: SIGKILL what outlives the grace
            if time.time() > deadline:
                forward(signal.SIGKILL, None)
                deadline = None
            else:
                time.sleep(0.1)
            continue
        if pid not in live:
            continue
        rank, code = live.pop(pid), os.waitstatus_to_exitcode(status)
        if code and failed is None:
            failed = code if code > 0 else 128 - code
            if live:
                how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
                print(f"[ranks] rank {rank} (pid {pid}) ended with {how}: stopping the other {len(live)}",
                      file=sys.stderr, flush=True)
                forward(signal.SIGTERM, None)
                deadline = time.time() + STOP_GRACE_S
    return 0 if failed is None else failed if port else 1


def _wait_child(pid: int, sock: socket.socket) -> int | None:
    """The wait status of ``pid``; None if the controller closed the connection first (the child, and
    its group, are killed: a shared server's children die with their controller's connection)."""
    try:
        pidfd = os.pidfd_open(pid)
    except (AttributeError, OSError):  # no pidfd (not Linux >= 5.3): wait for the child alone
        return os.waitpid(pid, 0)[1]
    try:
        while True:
            ready, _, _ = select.select([sock, pidfd], [], [])
            if pidfd in ready:
                return os.waitpid(pid, 0)[1]
            if not sock.recv(_MAX_MESSAGE, socket.MSG_PEEK):  # EOF: the controller is gone
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                os.waitpid(pid, 0)
                return None
            time.sleep(0.05)  # a message that is not an end: the next request waits for this exit
    finally:
        os.close(pidfd)


def _serve_connection(sock: socket.socket, baseline: Counter) -> None:
    """Fork one child per request of this connection and report its exit, until the connection closes."""
    import warnings

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
        _flush()  # else a child would write the server's buffered output into its pipe
        pid = os.fork()
        if pid == 0:
            sock.close()
            _child(request, fds[0], server)
        for f in fds:
            os.close(f)
        _send(sock, {"pid": pid})
        status = _wait_child(pid, sock)
        if status is None:
            return
        _send(sock, {"exit": os.waitstatus_to_exitcode(status)})


def serve(fd: int) -> None:
    """A controller's own server: preload, say ready, then serve its one connection."""
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
    _serve_connection(sock, baseline)


def listen(path: str, preload: list[str]) -> None:
    """A shared server: preload, listen at ``path`` (printing ``ready PID``), and give each connection a
    handler (a fork of this process) that serves it if the controller's environment is the one this
    server imported under (``env_key``), else says which variables differ."""
    from launch.process import die_with_parent

    own = env_key(dict(os.environ))
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"  # is_available() without initializing CUDA
    baseline = _preload(preload)
    reason = _unsafe(baseline)
    if reason:
        sys.exit(f"[fork-server] cannot serve: {reason}")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(64)
    server = os.getpid()
    print(f"ready {server}", flush=True)
    while True:
        conn, _ = listener.accept()
        while True:  # reap the handlers that ended
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    break
            except ChildProcessError:
                break
        _flush()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                listener.close()
                die_with_parent(server)
                message, _ = _recv(conn)
                theirs = env_key((message or {}).get("env") or {})
                if theirs != own:
                    differ = sorted({k for k, _ in set(theirs) ^ set(own)})
                    print(f"[fork-server] not serving a controller whose environment differs in {', '.join(differ)}",
                          file=sys.stderr, flush=True)
                    _send(conn, {"error": f"imported under another environment ({', '.join(differ[:6])} differ)"})
                else:
                    _send(conn, {"ready": os.getpid()})
                    _serve_connection(conn, baseline)
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                _flush()
                os._exit(code)
        conn.close()


if __name__ == "__main__":
    if sys.argv[1] == "--listen":  # python -m launch.forkserver --listen PATH [MODULE ...]
        listen(sys.argv[2], sys.argv[3:])
    else:  # started by ForkServer through launch.process.start_group (dies with it)
        serve(int(sys.argv[1]))
    # nothing of the server's outlives its socket: skip the interpreter's teardown of torch and megatron
    # (the controller waits for this exit at the end of every sweep; 0.5 s on a two-core CPU machine)
    _flush()
    os._exit(0)
