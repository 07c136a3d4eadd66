"""The one rule for "does it fit": a predicted peak against a per-GPU budget, allocator slack included.

The estimator predicts ``max_memory_allocated``; what must fit is what PyTorch's caching allocator
*reserves*, which runs above it. Over the 59 fused-Adam H200 points in docs/h200
reserved exceeded allocated by 2.3% (median), 7.3% (90th percentile), 8.2% (max). On the H200,
``full/block`` over 5 of 32 layers at ``size=h200_long`` was predicted at 136.02 GiB for a 139 GiB
budget and ran out of memory asking for 4 GiB at 131.96 GiB allocated and 133.45 reserved: a peak
that fits only without the slack is "tight", never "fits". The estimator, the advisor and the report
all judge predictions with ``verdict``.

MoE under expert parallel fragments more: each step's routed-token buffers differ in size per rank.
On two H200s (docs/evidence/h200x2.md) reserved over allocated reached 1.166 (``ep2`` none, rank 0)
and 1.159 (``size=h200_long`` moe_act); ``slack_for(cfg)`` gives such configs ``EP_MOE_SLACK``.

Activation offload fragments too: its host copies free device blocks one layer at a time while
others are allocated around them. Over the offload sweeps' points on one H200 (docs/evidence/offload-h200.md)
reserved over allocated reached 1.207 for dense options that offload core attention's
tensors (``qkv_linear-core_attn-attn_proj``; 1.19 ``core_attn``), 1.0851 for the other dense options
(``attn_norm-mlp_norm`` under ``selective/layernorm``, whose predicted peak with ``ALLOCATOR_SLACK``
still covers its reserved one) and 1.109 for MoE (``expert_fc1-moe_act``) at the h200 size, 1.152 and
1.196 at h200_long (plans that filled the device: their allocators freed and retried every step, so
at least that: 21%); points run under a memory
cap are left out (the allocator frees its cache to stay under the cap, so their reserved peak measures
the cap).
At the h200 size ``offload=core_attn`` held 19.62 GiB reserved for 17.32 allocated, more than no
offload's 18.90: offloading core attention freed allocated bytes but not reserved ones.
``slack_for`` gives offloading configs ``OFFLOAD_SLACK`` (the dense values for families without MoE
layers, which were not measured).

Under offload the allocator is also set up so the rule holds: a plan that offloads runs with
``measure.expandable_segments=true`` (``allocator_overrides``; the planner's confirm commands carry
it). Without it, fragmentation beat every slack measured: on one H100 an MLA plan at 54.74 GiB
allocated held 69.91 reserved (16.1 GiB of it free in pieces) and stopped under a 70 GiB cap, while
with expandable segments it ran under the cap; the H200 dense ``core_attn`` point that ran out of
memory under its 18.92 GiB cap ran under it with them (17.32 allocated: 9.2% room). ``OFFLOAD_SLACK``,
measured without expandable segments, stays the rule's slack for offload: it covers both.

The budget is what PyTorch's allocator may hold: the GPU's capacity less what CUDA and its libraries
keep outside it (``recipes.hardware``: each GPU profile's ``cuda_reserved_gib``).
"""

from __future__ import annotations

from recipes.config import typed
from recipes.offload import modules_of
from recipes.recompute import MLP_KIND

#: What the allocator reserves above a predicted (allocated) peak, as a fraction of it.
ALLOCATOR_SLACK = 0.085
#: The same for MoE with expert parallel > 1 (measured up to 16.6% on two H200s).
EP_MOE_SLACK = 0.17
#: With fine-grained activation offload: dense offloading core attention's tensors (measured up to 20.7%
#: on one H200), MoE (10.9% at the h200 size; at h200_long two plans reserved 15.2% and 19.6% over their
#: predicted peaks with the device full and their allocator retrying, so at least that); other dense
#: options take ALLOCATOR_SLACK.
OFFLOAD_SLACK = {"core_attn": 0.21, "moe": 0.21}
FITS, TIGHT, OVER = "fits", "tight", "over"


def slack_for(cfg: dict | None) -> float:
    """The allocator slack a config's predicted peak needs: ``EP_MOE_SLACK`` for MoE with expert
    parallel > 1, ``OFFLOAD_SLACK`` with activation offload (the larger where both apply), else
    ``ALLOCATOR_SLACK`` (also without a config)."""
    if not cfg:
        return ALLOCATOR_SLACK
    cfg = typed(cfg)
    kind = MLP_KIND.get(cfg.model.family)
    slack = EP_MOE_SLACK if kind == "moe" and cfg.parallel.expert_model_parallel_size > 1 else ALLOCATOR_SLACK
    modules = modules_of(cfg)
    which = "moe" if modules and kind == "moe" else "core_attn" if "core_attn" in modules else None
    return max(slack, OFFLOAD_SLACK[which]) if which else slack


def allocator_overrides(offloads: bool) -> str:
    """The allocator setup a plan's command carries for ``verdict`` to hold: expandable segments under
    activation offload (its copies free device blocks one layer at a time; without them the free memory
    fragments past any measured slack), nothing otherwise."""
    return "measure.expandable_segments=true" if offloads else ""


def with_slack(predicted_peak_gib: float, slack: float = ALLOCATOR_SLACK) -> float:
    """The memory a predicted allocated peak needs reserved: the peak plus the allocator's slack."""
    return predicted_peak_gib * (1 + slack)


def fits(predicted_peak_gib: float, budget_gib: float, slack: float = ALLOCATOR_SLACK) -> bool:
    """A predicted allocated peak fits when it does with the allocator's slack on top."""
    return with_slack(predicted_peak_gib, slack) <= budget_gib


def verdict(predicted_peak_gib: float, budget_gib: float, slack: float = ALLOCATOR_SLACK) -> str:
    """``fits`` (with slack), ``tight`` (only without it: it may run out of memory), or ``over``."""
    if fits(predicted_peak_gib, budget_gib, slack):
        return FITS
    return TIGHT if predicted_peak_gib <= budget_gib else OVER
