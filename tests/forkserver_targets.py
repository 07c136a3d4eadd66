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
