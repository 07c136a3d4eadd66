"""Targets and preloads for tests/test_forkserver.py, imported by a fork server started from the tests."""

from __future__ import annotations

import os
import sys
import threading
import time


def hello(text: str, code: str) -> None:
    print(f"{text} from {os.getpid()} in {os.getcwd()} with {os.environ.get('POINT')}", flush=True)
    print("to stderr", file=sys.stderr, flush=True)
    os._exit(int(code))


def sleep_with_a_child(seconds: str) -> None:
    """A worker that starts a process of its own (as torchrun's ranks or a data loader would)."""
    import subprocess

    child = subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({seconds})"])
    print(f"child {child.pid}", flush=True)
    time.sleep(float(seconds))


def start_a_thread() -> None:
    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()


def initialize_cuda() -> None:
    """What an import that initialized CUDA would leave (there is no GPU here to initialize)."""
    import torch

    torch.cuda.is_initialized = lambda: True


def use_cuda() -> None:
    """A worker that creates its own CUDA context and reads a result back."""
    import torch

    print(f"cuda {float(torch.ones(4, device='cuda').sum())}", flush=True)


def mark_teardown() -> None:
    """A preload whose interpreter teardown would leave a file (``TEARDOWN_MARK``): the server skips it."""
    import atexit

    path = os.environ["TEARDOWN_MARK"]
    atexit.register(lambda: open(path, "w").close())


def all_reduce(code_rank: str) -> None:
    """A rank of a rank group: joins the gloo world through the group's store (torchrun's environment),
    sums its rank over the world, prints it; rank ``code_rank`` then exits with code 7."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    total = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(total)
    line = f"rank {os.environ['RANK']}/{os.environ['WORLD_SIZE']} local {os.environ['LOCAL_RANK']} sum {total.item():g}\n"
    os.write(1, line.encode())  # one write: the ranks share the pipe
    dist.destroy_process_group()
    os._exit(7 if os.environ["RANK"] == code_rank else 0)


def wait_for_a_signal(failing_rank: str) -> None:
    """A rank that says it is ready and waits; ``failing_rank`` exits with 5 after 0.5 s instead. On
    SIGTERM (from the group) a rank prints it and exits 0."""
    import signal

    def stop(signum, _frame):
        os.write(1, f"rank {os.environ['RANK']} got {signal.Signals(signum).name}\n".encode())
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    os.write(1, f"rank {os.environ['RANK']} ready {os.getpid()}\n".encode())
    if os.environ["RANK"] == failing_rank:
        time.sleep(0.5)
        os._exit(5)
    time.sleep(60)
