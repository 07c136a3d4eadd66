"""The parallel layout against the launcher's world, the batch and the model; the cores a rank is pinned to."""

from __future__ import annotations

from recipes.config import typed
from recipes.errors import ConfigError, check
from recipes.recompute import ATTENTION_KIND, MLP_KIND, chunk_layers


def validate_cores(cfg, usable: int) -> None:
    """``launcher.cpu_cores_per_rank`` against the ``usable`` cores of this process (its affinity mask),
    before a local launch (not in ``validate``: a prediction or a report for another machine must not
    depend on this one)."""
    cfg = typed(cfg)
    launch = cfg.launcher
    per_rank, nproc = launch.cpu_cores_per_rank, launch.nproc_per_node
    if per_rank and launch.name == "local":
        check(per_rank * nproc <= usable, "launcher.cpu_cores_per_rank",
               f"{nproc} process(es) x {per_rank} cores need {per_rank * nproc} cores, and this process may "
               f"use {usable}", f"set launcher.cpu_cores_per_rank<={max(1, usable // nproc)}, or null (unpinned)")


def check_parallel(cfg, num_gpus: int) -> None:
    """The layout against the launcher's world size, the batch and the model (before any launch)."""
    cfg = typed(cfg)
    par, m, launch, train = cfg.parallel, cfg.model, cfg.launcher, cfg.train
    tp, pp, cp, ep = (par[k] for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                                       "context_parallel_size", "expert_model_parallel_size"))
    vpp = par.virtual_pipeline_model_parallel_size
    nproc, nnodes = launch.nproc_per_node, launch.nnodes
    world = nproc * nnodes
    check(launch.name in ("local", "slurm"), "launcher", f"unknown launcher {launch.name!r}",
           "use launcher=local (torchrun on this machine) or launcher=slurm (Slurm via submitit)")
    check(nproc >= 1 and nnodes >= 1, "launcher.nproc_per_node",
           f"{nproc} process(es) on {nnodes} node(s)", "use at least one process on one node")
    check(launch.name == "slurm" or nnodes == 1, "launcher.nnodes",
           f"launcher=local starts torchrun on this machine only, not on {nnodes} nodes",
           f"use launcher=slurm launcher.nnodes={nnodes} (torchrun on every node of a Slurm job)")
    for key, size in (("tensor_model_parallel_size", tp), ("pipeline_model_parallel_size", pp),
                      ("context_parallel_size", cp), ("expert_model_parallel_size", ep)):
        check(size >= 1, f"parallel.{key}", f"{size} is not a size", f"set parallel.{key}>=1")
    if num_gpus:
        check(nproc <= num_gpus, "launcher.nproc_per_node",
               f"{nproc} processes but this machine has {num_gpus} GPU(s)",
               f"set launcher.nproc_per_node<={num_gpus} or add nodes (launcher=slurm launcher.nnodes=N)")
    else:
        check(m.moe_token_dispatcher_type != "alltoall" or MLP_KIND[m.family] != "moe",
               "model.moe_token_dispatcher_type", "the alltoall dispatcher needs CUDA streams",
               "use model.moe_token_dispatcher_type=allgather on a CPU")
    model_parallel = tp * pp * cp
    check(world % model_parallel == 0, "launcher.nproc_per_node",
           f"tp*pp*cp = {tp}*{pp}*{cp} = {model_parallel} processes per model replica, but the "
           f"world is {nproc} x {nnodes} node(s) = {world}",
           f"set launcher.nproc_per_node to a multiple of {model_parallel} (the parallel=<layout> "
           "files set the smallest), or shrink the layout")
    dp = world // model_parallel
    heads = m.num_attention_heads
    check(heads % tp == 0, "parallel.tensor_model_parallel_size",
           f"{heads} heads are not divisible by TP={tp}", "pick a TP size dividing the head count")
    groups = m.num_query_groups or heads
    check(ATTENTION_KIND[m.family] == "mla" or groups % tp == 0, "parallel.tensor_model_parallel_size",
           f"{groups} query groups are not divisible by TP={tp}", "pick TP dividing num_query_groups")
    if ATTENTION_KIND[m.family] == "gdn":
        kh, vh = m.linear_num_key_heads, m.linear_num_value_heads
        check(kh % tp == 0 and vh % tp == 0, "parallel.tensor_model_parallel_size",
               f"GDN heads ({kh} key, {vh} value) are not divisible by TP={tp}",
               "pick a TP size dividing model.linear_num_key_heads")
    check(not par.sequence_parallel or tp > 1, "parallel.sequence_parallel",
           "sequence parallel needs tensor parallel > 1", "use parallel=tp2, or "
           "parallel.sequence_parallel=false")
    check(vpp is None or vpp >= 2, "parallel.virtual_pipeline_model_parallel_size",
           f"{vpp} virtual stage(s) per rank is no interleaving", "use null, or 2 or more")
    check(vpp is None or pp > 1, "parallel.virtual_pipeline_model_parallel_size",
           "virtual stages need pipeline parallel > 1", "use parallel=pp2_vpp2, or vpp=null")
    chunk_layers(m, par)  # the depth splits into the stages (evenly, or first/last given), or ConfigError
    mbs = train.micro_batch_size
    gbs = train.global_batch_size or mbs * dp
    check(gbs % (mbs * dp) == 0, "train.global_batch_size",
           f"{gbs} samples do not split into micro-batches of {mbs} on {dp} data-parallel rank(s)",
           f"use a multiple of micro_batch_size x data-parallel size = {mbs * dp}")
    num_microbatches = gbs // (mbs * dp)
    if vpp:  # megatron's interleaved schedule raises otherwise
        check(num_microbatches % pp == 0, "train.global_batch_size",
               f"interleaved pipelining needs the micro-batches per step ({num_microbatches}) to be "
               f"a multiple of PP={pp}",
               f"set train.global_batch_size={mbs * dp * pp * max(1, num_microbatches // pp)}")
    if pp > 1 and not num_gpus:
        check(m.untie_embeddings_and_output_weights, "model.untie_embeddings_and_output_weights",
               "tied embeddings under pipeline parallel need CUDA (megatron copies the last "
               "stage's output weight with .cuda())", "set model.untie_embeddings_and_output_weights=true")
    seq = train.seq_length
    if par.sequence_parallel:
        check(seq % tp == 0, "train.seq_length", f"{seq} is not divisible by TP={tp} "
               "(sequence parallel splits the sequence)", f"use a multiple of {tp}")
    if cp > 1:
        check(cfg.attention.backend == "te", "parallel.context_parallel_size",
               "context parallel needs Transformer Engine attention (attention=te); the local "
               "spec's core attention has no ring exchange",
               "use attention=te where Transformer Engine is installed, or context_parallel_size=1")
        check(seq % (2 * cp) == 0, "train.seq_length", f"{seq} is not divisible by 2*CP={2 * cp}",
               f"use a multiple of {2 * cp}")
        raise ConfigError("parallel.context_parallel_size", "the worker does not yet split each "
                          "sequence over the context-parallel ranks (Megatron-LM's "
                          "get_batch_on_this_cp_rank), so every rank would attend over all of it",
                          "use context_parallel_size=1 (docs/recipes.md says what is missing)")
    if MLP_KIND[m.family] == "moe":
        check(m.num_moe_experts % ep == 0, "parallel.expert_model_parallel_size",
               f"{m.num_moe_experts} experts do not split over EP={ep}", "pick EP dividing the experts")
        etp = par.expert_tensor_parallel_size or tp
        check(world % (etp * ep * pp) == 0, "parallel.expert_model_parallel_size",
               f"expert layout etp*ep*pp = {etp * ep * pp} does not divide the world size {world}",
               "shrink EP/ETP or add processes")
        check(tp == 1 or par.sequence_parallel, "parallel.sequence_parallel",
               "megatron's MoE layer refuses tensor parallel without sequence parallel in training",
               "use parallel=tp2 (sequence parallel on), or parallel.sequence_parallel=true")
        check(etp == 1 or m.experts != "grouped", "parallel.expert_tensor_parallel_size",
               f"model.experts=grouped keeps each expert whole on a rank, but expert TP is {etp} "
               "(it defaults to the TP size)",
               "set parallel.expert_tensor_parallel_size=1 (parallel=tp2 does), or model.experts=sequential")
        if m.moe_token_dispatcher_type == "local":
            check(ep == 1, "model.moe_token_dispatcher_type",
                   f"the local dispatcher keeps every token on its rank, but expert parallel {ep} puts "
                   "experts on other ranks", "use model.moe_token_dispatcher_type=allgather "
                   "(parallel=ep2 sets it)")
            check(etp == 1, "model.moe_token_dispatcher_type",
                   f"the local dispatcher keeps every token on its rank, but expert-tensor parallel {etp} "
                   "splits each expert over ranks (it defaults to the TP size)",
                   "set parallel.expert_tensor_parallel_size=1, or model.moe_token_dispatcher_type=allgather")
    else:
        check(ep == 1, "parallel.expert_model_parallel_size", "expert parallel needs an MoE family",
               "use model=moe (or mla_moe, gdn_moe), or parallel.expert_model_parallel_size=1")
