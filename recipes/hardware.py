"""Hardware profiles: what the planner assumes about a GPU, its host link and its node.

A profile is a YAML file: the spec-sheet ones in ``conf/hardware/`` (``h100_sxm``, ``h200``, ``b200``,
``gb200``), or one ``python -m recipes calibrate`` measured on a GPU (``source: measured``). The
planner (``recipes.analyze.plan``) and the predictions before a run read the allocator's budget (the
device's memory less what CUDA and its libraries hold), the achieved matmul rate, the HBM and host-link
bandwidths from it, and every prediction names the profile it used.

Which profile: the one named (``cluster.gpu=NAME`` or a path to a profile YAML), else the spec profile
of the GPU on this machine, else the one a named recipe's GPU maps to (``recipe.gpu``), else ``h200``
(said so). The cluster (``cluster.*``: host memory and GPUs per node, nodes) is the one the job runs
on, never the machine running the planner: without ``cluster.host_memory_gib`` the profile's typical
node is assumed, and named.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import yaml

from recipes.config import typed
from recipes.errors import ConfigError
from recipes.files import CONF_DIR

PROFILE_DIR = CONF_DIR / "hardware"
#: A named recipe's GPU (``recipe.gpu``) -> its spec profile.
RECIPE_GPU = {"h100": "h100_sxm", "h200": "h200"}
DEFAULT_PROFILE = "h200"
#: Typical host memory (GiB) and GPUs of a node of each spec profile's GPU, when the cluster does not say:
#: DGX H100/H200 2 TB for 8 GPUs, DGX B200 4 TB for 8, a GB200 compute tray 2 x 480 GB LPDDR5X for 4.
TYPICAL_NODE = {"h100_sxm": (1907.0, 8), "h200": (1907.0, 8), "b200": (3725.0, 8), "gb200": (894.0, 4)}


@dataclasses.dataclass
class Profile:
    """One GPU as the planner sees it. Bandwidths in GB/s (10^9 bytes), compute in dense TFLOP/s."""

    name: str
    gpu: str  # the device name (torch.cuda.get_device_name()) it describes
    memory_gib: float  # the device's memory as PyTorch reports it
    cuda_reserved_gib: float  # what CUDA's context and its libraries hold outside PyTorch's allocator
    hbm_gb_s: float
    bf16_tflops: float  # dense bf16 matmul peak (spec), or the best measured
    host_link: str  # PCIe Gen5 x16, NVLink-C2C, ...
    host_link_gb_s: float  # pinned host<->device copies each way beside compute (spec: what pinned copies reach)
    source: str  # "spec sheet" or "measured on <device> <date>"
    match: list = dataclasses.field(default_factory=list)  # substrings of device names it covers
    host_link_alone_gb_s: float | None = None  # measured: the copies with nothing else running
    matmul_tflops: dict = dataclasses.field(default_factory=dict)  # measured: rows (tokens) -> bf16 TFLOP/s
    offload_ms_per_group: float | None = None  # measured: megatron's offload manager's host cost a group
    host_memory_gib: float | None = None  # measured: the node's host memory
    gpus_per_node: int | None = None  # measured: GPUs on the node

    @property
    def budget_gib(self) -> float:
        """What PyTorch's allocator may hold: the device's memory less what CUDA and its libraries keep."""
        return round(self.memory_gib - self.cuda_reserved_gib, 2)

    @property
    def measured(self) -> bool:
        return self.source.startswith("measured")

    def describe(self) -> str:
        """``h100_sxm (NVIDIA H100 80GB HBM3, spec sheet): 77.0 GiB for PyTorch's allocator (79.2 less 2.2
        that CUDA and its libraries hold), 989 TFLOP/s bf16, PCIe Gen5 x16 at 50 GB/s``."""
        return (f"{self.name} ({self.gpu}, {self.source}): {self.budget_gib:g} GiB for PyTorch's allocator "
                f"({self.memory_gib:g} less {self.cuda_reserved_gib:g} that CUDA and its libraries hold), "
                f"{self.bf16_tflops:g} TFLOP/s bf16, {self.host_link} at {self.host_link_gb_s:g} GB/s")

    def efficiency(self, rows: int) -> float:
        """The share of this GPU's best matmul rate a GEMM of ``rows`` tokens reaches: interpolated in the
        measured table (``matmul_tflops``), else ``rows / (rows + HALF_RATE_ROWS)`` over the same at
        ``FULL_RATE_ROWS`` (a spec sheet gives one peak; small GEMMs do not reach it)."""
        table = sorted((int(k), float(v)) for k, v in self.matmul_tflops.items())
        if len(table) >= 2:
            best = max(v for _, v in table)
            if rows <= table[0][0]:
                return table[0][1] / best
            for (r0, v0), (r1, v1) in zip(table, table[1:]):
                if rows <= r1:
                    return (v0 + (v1 - v0) * (rows - r0) / (r1 - r0)) / best
            return table[-1][1] / best
        shape = lambda n: n / (n + HALF_RATE_ROWS)  # noqa: E731
        return min(1.0, shape(rows) / shape(FULL_RATE_ROWS))


#: A spec profile's GEMM saturation: half the peak at this many rows, the full rate from FULL_RATE_ROWS.
HALF_RATE_ROWS = 1024
FULL_RATE_ROWS = 32768
REQUIRED = ("name", "gpu", "memory_gib", "cuda_reserved_gib", "hbm_gb_s", "bf16_tflops", "host_link",
            "host_link_gb_s", "source")


def spec_profiles() -> list[str]:
    """The spec-sheet profiles' names (``conf/hardware/*.yaml``)."""
    return sorted(p.stem for p in PROFILE_DIR.glob("*.yaml"))


def load_profile(name_or_path: str, option: str = "cluster.gpu") -> Profile:
    """A profile by name (``conf/hardware/<name>.yaml``) or path, validated: every field present, numbers
    positive, what CUDA holds below the memory. Refused with the fix otherwise."""
    path = Path(name_or_path)
    if not path.suffix:
        path = PROFILE_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        raise ConfigError(option, f"no hardware profile {name_or_path!r}",
                          f"use one of {', '.join(spec_profiles())}, or a file `python -m recipes calibrate "
                          "--out FILE` wrote")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(option, f"{path} is not YAML ({err})", "regenerate it with python -m recipes calibrate") from None
    missing = [k for k in REQUIRED if k not in data]
    known = {f.name for f in dataclasses.fields(Profile)}
    unknown = sorted(set(data) - known)
    if missing or unknown:
        raise ConfigError(option, f"{path} " + (f"lacks {', '.join(missing)}" if missing else
                                                f"has unknown fields {', '.join(unknown)}"),
                          f"give every one of {', '.join(REQUIRED)} (see conf/hardware/h200.yaml)")
    profile = Profile(**data)
    for k in ("memory_gib", "hbm_gb_s", "bf16_tflops", "host_link_gb_s"):
        if not isinstance(getattr(profile, k), (int, float)) or getattr(profile, k) <= 0:
            raise ConfigError(option, f"{path}: {k} must be a positive number, got {getattr(profile, k)!r}",
                              "fix the file or regenerate it with python -m recipes calibrate")
    if not 0 <= profile.cuda_reserved_gib < profile.memory_gib:
        raise ConfigError(option, f"{path}: cuda_reserved_gib {profile.cuda_reserved_gib} is not below memory_gib "
                          f"{profile.memory_gib}", "give what CUDA holds (total - free with nothing allocated)")
    return profile


def local_gpu_name() -> str | None:
    """The name of this machine's first GPU, or None without one (torch imported only here)."""
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def match_profile(device_name: str) -> str | None:
    """The spec profile whose ``match`` substrings a device name contains (GB200 before B200)."""
    found = [(max(len(m) for m in p.match if m.lower() in device_name.lower()), p.name)
             for p in map(load_profile, spec_profiles()) if any(m.lower() in device_name.lower() for m in p.match)]
    return max(found)[1] if found else None


def resolve_profile(cfg: dict) -> tuple[Profile, str]:
    """(the profile a prediction for ``cfg`` uses, why that one): ``cluster.gpu`` when given, else this
    machine's GPU's spec profile, else the named recipe's GPU's, else ``h200``."""
    cfg = typed(cfg)
    named = cfg.cluster.gpu
    if named:
        return load_profile(named), "named by cluster.gpu"
    local = local_gpu_name()
    if local and match_profile(local):
        return load_profile(match_profile(local)), f"the GPU on this machine, {local}"
    recipe = cfg.recipe.gpu if cfg.recipe else None
    if recipe in RECIPE_GPU:
        return load_profile(RECIPE_GPU[recipe]), f"the GPU recipe={cfg.recipe.name} trains on"
    why = (f"{local} has no spec profile" if local else "no GPU here and none named")
    return load_profile(DEFAULT_PROFILE), f"{why}: the default; name yours with cluster.gpu=NAME"


def cluster_of(cfg: dict, profile: Profile) -> dict:
    """The cluster the plan is for: GPUs per node and nodes (``cluster.*``, else the launcher's), host
    memory per node (``cluster.host_memory_gib``, else ``offload.host_memory_gib``, else the profile's
    measured node, else its typical node), each with where it came from. Never this machine's memory."""
    cfg = typed(cfg)
    cl, launch = cfg.cluster, cfg.launcher
    gpus, nodes = cl.gpus_per_node or launch.nproc_per_node, cl.nodes or launch.nnodes
    if cl.host_memory_gib is not None:
        host, where = cl.host_memory_gib, "cluster.host_memory_gib"
    elif cfg.offload.host_memory_gib is not None:
        host, where = cfg.offload.host_memory_gib, "offload.host_memory_gib"
    elif profile.host_memory_gib is not None:
        host, where = profile.host_memory_gib, f"the node profile {profile.name} measured"
    else:
        typical = TYPICAL_NODE.get(profile.name, (1907.0, 8))[0]
        host, where = typical, f"a typical {profile.name} node's; set cluster.host_memory_gib=N for yours"
    return {"gpu": profile.name, "gpus_per_node": gpus, "nodes": nodes, "host_memory_gib": float(host),
            "host_memory_from": where}


def check_cluster(cfg: dict, cluster: dict) -> None:
    """Refuse a cluster the layout does not divide: its GPUs (nodes x GPUs per node) against tensor x
    pipeline x context parallel, and expert parallel against what is left of a pipeline stage."""
    par = typed(cfg).parallel
    world = cluster["nodes"] * cluster["gpus_per_node"]
    model_parallel = par.tensor_model_parallel_size * par.pipeline_model_parallel_size * par.context_parallel_size
    ep = par.expert_model_parallel_size * (par.expert_tensor_parallel_size or 1)
    if world % model_parallel or (world // par.pipeline_model_parallel_size) % ep:
        raise ConfigError("cluster.gpus_per_node", f"{cluster['nodes']} node(s) x {cluster['gpus_per_node']} GPUs = "
                          f"{world} GPUs, which TP{par.tensor_model_parallel_size} x "
                          f"PP{par.pipeline_model_parallel_size} x CP{par.context_parallel_size} "
                          f"(EP{par.expert_model_parallel_size} in each stage) does not divide",
                          f"use a multiple of {model_parallel} GPUs (cluster.nodes, cluster.gpus_per_node) or "
                          "change parallel.*")


def check_budget(budget_gib: float, profile: Profile, option: str = "--budget-gib") -> None:
    """Refuse a budget above the profile's GPU's capacity (its memory; above ``budget_gib`` but within it,
    the allocator competes with CUDA's own memory, which a plan's cap shows)."""
    if not 0 < budget_gib < float("inf"):  # NaN fails this too
        raise ConfigError(option, f"{budget_gib:g} GiB is not a positive number of GiB",
                          f"give what PyTorch's allocator may hold per GPU, at most {profile.budget_gib:g} on the "
                          f"{profile.gpu} (e.g. {option} {profile.budget_gib:g})")
    if budget_gib > profile.memory_gib + 1e-9:
        raise ConfigError(option, f"{budget_gib:g} GiB is above the {profile.gpu}'s capacity ({profile.memory_gib:g} "
                          f"GiB, of which PyTorch's allocator can hold {profile.budget_gib:g}: CUDA and its libraries "
                          f"keep {profile.cuda_reserved_gib:g})",
                          f"give at most {profile.budget_gib:g}, or name the GPU you plan for: cluster.gpu="
                          f"{'|'.join(spec_profiles())} or a calibrated profile's path")
