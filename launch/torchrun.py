"""The torchrun command line the controller uses for several worker processes.

One node (``launcher=local``): a c10d rendezvous on 127.0.0.1, on ``launcher.master_port`` or, for 0,
torchrun's standalone rendezvous, whose store takes a free port when it binds. Several nodes
(``launcher=slurm``, see ``launch.slurm``): every node runs this same command with its own
``--node-rank`` and the first node's address, torchrun's static rendezvous, so global ranks are laid
out node by node (rank = node_rank * nproc_per_node + local_rank), as megatron's groups expect.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from launch.process import RANK_SIGNALS


@dataclass(frozen=True)
class Rendezvous:
    """Where the nodes of one run meet: node count, this node's rank, the first node's address."""

    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int


#: torchrun's variables for a world of one rank. Port 0: the one process's store binds a free port
#: itself (nothing else has to find it); a port picked beforehand could be taken by another process
#: before the store binds it (a test's subprocess lost that race on a 2-core CI machine).
ONE_RANK_ENV = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0"}


def set_one_rank_env() -> None:
    """``ONE_RANK_ENV`` in this process's environment, over what it inherited: an inherited
    MASTER_PORT may be a parent's live rendezvous (a test session, a torchrun)."""
    os.environ.update(ONE_RANK_ENV)


def torchrun_command(launcher: dict, program: list[str], rendezvous: Rendezvous | None = None) -> list[str]:
    """``python -m torch.distributed.run ... <program>`` for this node.

    ``program`` is what each worker runs (``["-m", "recipes.run.worker", RUN_DIR]``). Without a
    ``rendezvous`` the run must fit on this node (``launcher.nnodes == 1``).
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={launcher['nproc_per_node']}"]
    if rendezvous is None:
        if launcher["nnodes"] != 1:
            raise ValueError(f"launcher.nnodes={launcher['nnodes']} needs a rendezvous across nodes: "
                             "use launcher=slurm (launch.slurm.slurm_rendezvous)")
        if launcher["master_port"]:
            cmd += ["--nnodes=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{launcher['master_port']}"]
        else:  # torchrun's store binds port 0 itself: a port picked here could be taken before it binds
            cmd += ["--nnodes=1", "--standalone"]
    else:
        cmd += [f"--nnodes={rendezvous.nnodes}", f"--node-rank={rendezvous.node_rank}",
                f"--master-addr={rendezvous.master_addr}", f"--master-port={rendezvous.master_port}"]
    # the preemption signals (Slurm's warning before the time limit) reach the workers too, which save and stop
    return cmd + [f"--signals-to-handle={','.join(s.name for s in RANK_SIGNALS)}"] + program
