"""megatron's ``share_storage`` C++ extension (``CheckpointWithoutOutput``): which labels need it on this
machine, and whether it can be loaded or built here."""

from __future__ import annotations

import functools
import importlib.metadata
import os
import re
import sys

from recipes.config import typed
from recipes.recompute import labels_of, replays_without_output

#: The first torch whose ``UntypedStorage`` has ``_swap_data_ptr_`` (pytorch PR 177449, March 2026)
SWAP_SINCE = (2, 12)


@functools.cache
def torch_swaps_storages() -> bool:
    """Whether this torch can swap two storages' memory (``UntypedStorage._swap_data_ptr_``; torch 2.11
    cannot), which ``recipes.build.upstream`` needs to hand recomputed CPU outputs over without
    megatron's C++ extension. Read from torch's version where torch is not loaded yet: a controller
    checks it before its workers start and imports no torch (seconds)."""
    torch = sys.modules.get("torch")
    if torch is not None:
        return hasattr(torch.UntypedStorage, "_swap_data_ptr_")
    try:
        version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return False
    major, minor = re.match(r"(\d+)\.(\d+)", version).groups()
    return (int(major), int(minor)) >= SWAP_SINCE


def share_storage_built() -> bool | None:
    """Whether megatron's ``share_storage`` extension is built in this machine's extensions directory
    (torch's own choice: ``TORCH_EXTENSIONS_DIR``, else ``~/.cache/torch_extensions/<py>_<cuda>``), or
    None where this torch does not say."""
    from torch.utils import cpp_extension

    try:
        return os.path.exists(os.path.join(cpp_extension._get_build_directory("share_storage_ext", False),
                                           "share_storage_ext.so"))
    except Exception:
        return None


def share_storage_labels(cfg, num_gpus: int) -> list[str]:
    """The labels of ``cfg`` that replay through megatron's ``CheckpointWithoutOutput`` and so need its
    ``share_storage`` extension on this machine ([] on a CPU, where ``recipes.build.upstream`` hands
    the memory over in Python wherever torch can swap storages)."""
    cfg = typed(cfg)
    rc = cfg.recompute
    if rc.recompute_granularity != "selective":
        return []
    labels = [label for label in labels_of(cfg) if replays_without_output(label, rc)]
    return [] if labels and not num_gpus and torch_swaps_storages() else labels


def share_storage_build_problem() -> str | None:
    """Why megatron-core 0.19.2's ``share_storage`` extension can neither be loaded nor built on this
    machine, or None. ``CheckpointWithoutOutput._recompute`` (tensor_parallel/random.py,
    ``_get_share_storage``) compiles it with ``torch.utils.cpp_extension.load_inline`` at the first
    recompute: ninja always (it checks the build), a C++ compiler when the library is not yet built
    in ``TORCH_EXTENSIONS_DIR`` (a fresh H200 machine spent 13-24 s on it, docs/speed.md). When megatron
    stops building it, tests/test_upstream.py's ``test_checkpoint_without_output_still_builds_a_cpp_extension``
    fails: delete this check with the workaround."""
    import shutil

    from torch.utils import cpp_extension

    if not cpp_extension.is_ninja_available():
        return "ninja is not on PATH (torch runs it to build and to load the extension)"
    built = share_storage_built()
    if built is None:  # a torch without the helper: leave it to the run
        return None
    compiler = os.environ.get("CXX", "c++")
    if not built and shutil.which(compiler) is None:
        return f"there is no C++ compiler ({compiler}) and the extension is not built yet"
    return None
