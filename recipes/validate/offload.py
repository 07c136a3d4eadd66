"""Activation offload: megatron-core's rules, the silent no-ops, the machine, the host's memory."""

from __future__ import annotations

from recipes.config import typed
from recipes.errors import ConfigError, check
from recipes.files import GIB
from recipes.offload import layer_offload_problem, option_of, rule_problem
from recipes.recompute import labels_of


def host_memory_available() -> int | None:
    """Bytes of host memory available on this machine now (``MemAvailable``), or None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_offload(cfg, num_gpus: int, te_available: bool) -> None:
    """Activation offload: megatron-core's rules, the silent no-ops, the machine, the host's memory."""
    cfg = typed(cfg)
    off, rc, m = cfg.offload, cfg.recompute, cfg.model
    if not off:  # a result written before offload existed
        return
    modules = list(off.offload_modules or [])
    fine = off.fine_grained_activation_offloading
    check(fine or not modules, "offload.offload_modules",
           "modules are listed but fine-grained offload is off: they would be ignored",
           "use offload=<option> (conf/offload/), or set offload.fine_grained_activation_offloading=true")
    check(not fine or modules, "offload.offload_modules", "fine-grained offload is on with no modules (megatron-core "
           "asserts)", "use offload=none, or offload=<option> such as core_attn-attn_proj")
    check(off.min_offloaded_tensor_size >= 0, "offload.min_offloaded_tensor_size",
           f"{off.min_offloaded_tensor_size} is negative", "use 0 (offload every saved tensor) or more elements")
    check(0.0 <= off.activation_offload_fraction <= 1.0, "offload.activation_offload_fraction",
           f"{off.activation_offload_fraction} is not in [0, 1]", "use a fraction in [0, 1], e.g. 1.0")
    recompute_on = rc.recompute_granularity is not None
    problem = layer_offload_problem(off.cpu_offloading, te_available, recompute_on,
                                    cfg.parallel.pipeline_model_parallel_size, fine)
    if problem:
        raise ConfigError(*problem)
    if not modules:  # offload.emulate_on_cpu without offload changes nothing (a sweep over offload=none,...)
        return
    labels = None if rc.recompute_granularity == "full" else frozenset(labels_of(cfg))
    problem = rule_problem(modules, labels, m, cfg.parallel.pipeline_model_parallel_size)
    if problem:
        raise ConfigError(*problem)
    option = f"offload={option_of(cfg)}"
    check(m.compile == "none", "model.compile", f"{option} inside a compiled layer is not "
           "checked: megatron's offload manager commits and reloads its groups from Python inside the layer's "
           "forward, which torch.compile would trace", f"set model.compile=none with {option}, or offload=none")
    if num_gpus:
        check(not off.emulate_on_cpu, "offload.emulate_on_cpu", "emulated copy streams are for a CPU "
               "run's tests; this machine has a GPU, where the offload is real", "set offload.emulate_on_cpu=false")
    else:
        check(off.emulate_on_cpu, option, "a CPU-only run has no device memory to relieve: offloading "
               "would copy CPU memory to CPU memory", "run it on a GPU, or set offload.emulate_on_cpu=true to "
               "test the offload path on a CPU (copies to a second buffer through emulated streams)")
    if cfg.measure.ledger:
        check(cfg.train.train_iters >= 3, "train.train_iters", "with offload the first step plans it "
               "(megatron's warm-up) and the second records the ledger: 2 steps measure nothing",
               "set train.train_iters>=3, or measure.ledger=false")


#: The first remedies for offload copies above a node's host memory (the validator's, the planner's, estimate's).
FEWER_COPIES = "offload fewer modules (a smaller conf/offload option), use recompute instead"


def host_memory_problem(cfg: dict, planned_host_bytes: int | None,
                        job_memory_gib: float | None = None) -> tuple[str, str, str] | None:
    """(option, problem, fix) where the host memory one rank's offload is predicted to hold
    (``recipes.predict.estimate.planned_host_bytes``), times the ranks of a node, is above
    ``offload.host_memory_gib``, else ``job_memory_gib`` (a Slurm job's memory per node, checked
    before submitting), else this machine's available memory; else None. The validator refuses such a
    run before launch, and the planner such a plan."""
    cfg = typed(cfg)
    if not planned_host_bytes:
        return None
    launch, off = cfg.launcher, cfg.offload
    per_node = planned_host_bytes * launch.nproc_per_node
    given = off.host_memory_gib
    if given is not None:
        host, where = int(given * GIB), "offload.host_memory_gib"
    elif job_memory_gib is not None:
        host, where = int(job_memory_gib * GIB), f"the job's memory per node, hydra.launcher.mem_gb={job_memory_gib:g}"
    else:
        host, where = host_memory_available(), "this machine's available memory"
    if host is None or per_node <= host:
        return None
    more = ("or ask Slurm for more memory per node (hydra.launcher.mem_gb)" if job_memory_gib is not None and given is None
            else "free host memory, or set offload.host_memory_gib to the nodes' memory if they are not this machine")
    return (f"offload={option_of(cfg)}",
            f"the copies are predicted at {_size(per_node)} of host memory per node "
            f"({_size(planned_host_bytes)} per rank x {launch.nproc_per_node} "
            f"rank{'s' if launch.nproc_per_node > 1 else ''}), above {where} ({_size(host)})",
            f"{FEWER_COPIES}, {more}")


def _size(nbytes: float) -> str:
    return f"{nbytes / GIB:.1f} GiB" if nbytes >= GIB / 10 else f"{nbytes / 2**20:.1f} MiB"
