"""The torchrun command line the controller uses for several worker processes (launcher=local)."""

from __future__ import annotations

import socket
import sys


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_command(launcher: dict, program: list[str]) -> list[str]:
    """``python -m torch.distributed.run`` on this node; ``--standalone`` for one node."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={launcher['nproc_per_node']}"]
    if launcher["nnodes"] == 1:
        port = launcher["master_port"] or _free_port()
        cmd += ["--nnodes=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}"]
    else:
        raise NotImplementedError("multi-node runs go through hydra/launcher=submitit_slurm")
    return cmd + program
