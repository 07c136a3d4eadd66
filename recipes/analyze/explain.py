"""The advice in a few sentences a person reads, citing the measured numbers (``advise`` makes the advice)."""

from __future__ import annotations

from recipes.analyze.candidates import FRAG_FRACTION, FRAG_MIN_GIB
from recipes.analyze.plan import explain_plan, overrides_of
from recipes.analyze.report import NOISY_STEPS
from recipes.files import GIB, MIB
from recipes.recompute import NO_RECOMPUTE
from recipes.results import first_sentence


def _name(c: dict, choice: dict) -> str:
    """The recompute label, or the whole point name where model or attention differ from the choice."""
    same = all(c.get(k) == choice.get(k) for k in ("model", "attention"))
    return c["recompute"] if same else c["point"]


def _mem(value_gib: float, gpu: bool) -> str:
    return f"{value_gib:.2f} GiB" if gpu else f"{value_gib * GIB / MIB:.2f} MiB"


def _delta(c: dict, gpu: bool) -> str:
    """``saves 2.10 GiB peak allocated (-12.0%), at +3.1% step time, against <control point>``."""
    if not c.get("control"):
        return "has no matched control to compare with (none ran, or it did not fit)"
    if gpu and c.get("d_peak_gib") is not None:
        verb = "saves" if c["d_peak_gib"] <= 0 else "adds"
        mem = f"{verb} {abs(c['d_peak_gib']):.2f} GiB peak allocated ({c['d_peak_pct']:+.1f}%)"
    elif c.get("d_ledger_pct") is not None:
        verb = "saves" if c["d_ledger_pct"] <= 0 else "adds"
        mem = f"{verb} {abs(c['d_ledger_pct']):.1f}% of the activation ledger"
    else:
        mem = "has no memory delta"
    time = f"{c['d_time_pct']:+.1f}% step time" if c.get("d_time_pct") is not None else "unmeasured step time"
    return f"{mem}, at {time}, against {c['control']}"


def explain(advice: dict, sweep_dir: str = "") -> str:
    """A few sentences a person reads, citing the measured numbers."""
    gpu, budget = advice["device"] == "gpu", advice["budget_gib"]
    lines = [f"Advice for {sweep_dir} (budget {_mem(budget, gpu)}; judged on {advice['basis']})."]
    if not gpu:
        lines.append("CPU results: there are no allocator peaks, so points are compared on the activation ledger "
                     "(bytes saved for backward in one micro-batch) and the budget applies to the ledger alone. "
                     "Weights, gradients and optimizer state are not in it: run the sweep on a GPU to check the fit.")
    frag = advice["fragmentation"]
    if frag:
        worst = max(frag, key=lambda f: f["fragmentation_gib"])
        lines.append(f"1. Fragmentation: {len(frag)} rank(s) reserve well above what they allocate; worst "
                     f"`{worst['point']}` rank {worst['rank']}: reserved {worst['reserved_gib']:.2f} GiB, allocated "
                     f"{worst['allocated_gib']:.2f} GiB ({worst['fragmentation_gib']:.2f} GiB, "
                     f"{worst['fraction_of_reserved']:.0%} of reserved, is cached but unused). Re-run with "
                     "measure.expandable_segments=true (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True) before "
                     "paying for recompute: the allocated peak is the real pressure.")
    elif not gpu:
        lines.append("1. Fragmentation: not measurable without an allocator; the GPU sweep's report shows it.")
    else:
        lines.append(f"1. Fragmentation: none; reserved is within {FRAG_FRACTION:.0%} (or {FRAG_MIN_GIB} GiB) of "
                     "allocated on every rank, so the pressure is real allocation.")
    c = advice["choice"]
    if c:
        held = f" reserved ({c['peak_allocated_gib']:.2f} GiB allocated)" if gpu else " ledger"
        mem = _mem(c["memory_gib"], gpu) + held
        offload = c.get("offload", "none")
        if c["recompute"] in NO_RECOMPUTE and offload != "none":
            head = (f"2. Choice: activation offload (offload={offload}, recompute={c['recompute']}): `{c['point']}` "
                    f"at {mem}, within the budget")
            why = f"it {_delta(c, gpu)}."
        elif c["recompute"] in NO_RECOMPUTE:
            head = f"2. Choice: no recompute (recompute={c['recompute']}): `{c['point']}` fits at {mem}"
            why = "nothing needs replaying, so any recompute label would only add step time."
        elif offload != "none":
            head = f"2. Choice: recompute={c['recompute']} with offload={offload} (`{c['point']}`) at {mem}, within the budget"
            why = f"it {_delta(c, gpu)}."
        else:
            head = f"2. Choice: recompute={c['recompute']} (`{c['point']}`) at {mem}, within the budget"
            why = f"it {_delta(c, gpu)}."
        text = f"{head}; {why} Step time {c['step_ms']:.1f} ms."
        faster = advice["faster_not_fitting"]
        if faster:
            text += " Faster but over the budget: " + ", ".join(
                f"{_name(f, c)} ({_mem(f['memory_gib'], gpu)}, {f['step_ms']:.1f} ms)" for f in faster) + "."
        floor = advice.get("noise_floor_pct")
        ff = advice.get("faster_full")
        if ff and ff["resolved"]:
            text += (f" Chosen over {_name(ff['over'], c)}, which fits too ({_mem(ff['over']['memory_gib'], gpu)}, "
                     f"{ff['over']['step_ms']:.1f} ms): the guide tries selective labels before full recompute, "
                     f"but here {c['recompute']} measured {ff['lead_pct']:.1f}% faster for no more memory, "
                     f"beyond this sweep's noise floor ({floor:.1f}%).")
        for f in advice["full_fitting"] if c["recompute"] not in NO_RECOMPUTE else []:
            if ff and not ff["resolved"] and f["point"] == ff["full"]["point"]:
                text += (f" {_name(f, c)} also fits ({_mem(f['memory_gib'], gpu)}) and measured "
                         f"{ff['lead_pct']:.1f}% faster ({f['step_ms']:.1f} ms), which "
                         + (f"is within this sweep's noise floor ({floor:.1f}%)" if floor is not None else
                            "this sweep cannot tell from noise (no none/control pair or repeats)")
                         + ": repeat both (measure.repeat=0,1,2) before preferring it.")
            else:
                text += (f" {_name(f, c)} also fits ({_mem(f['memory_gib'], gpu)}) but {_delta(f, gpu)}: "
                         "full recompute stays the last resort.")
        for f in advice.get("superfluous") or []:
            text += (f" {_name(f, c)} measured faster ({f['step_ms']:.1f} ms) but recomputes everything "
                     f"{f['narrower']} does and more, for no less memory: its lead is noise between processes"
                     + (f" (the same computation measured up to {floor:.1f}% apart in separate processes "
                        "here)" if floor else "")
                     + ".")
        if floor is not None and c["recompute"] not in NO_RECOMPUTE and c.get("d_time_pct") is not None \
                and abs(c["d_time_pct"]) <= floor:
            text += f" Its step-time cost ({c['d_time_pct']:+.1f}%) is within this sweep's noise floor ({floor:.1f}%)"
            if c.get("d_gpu_pct") is not None:  # measure.gpu_time resolves what the wall time cannot
                text += (f"; the GPU's busy time, which the host's speed does not move, puts it at "
                         f"{c['d_gpu_pct']:+.1f}% (measure.gpu_time).")
            else:
                text += ": repeat the points to resolve it (measure.repeat=0,1,2)."
        if (c.get("step_noise") or 0) > NOISY_STEPS:
            text += (f" Caution: its median step is {c['step_noise']:.0%} slower than its fastest, so the time "
                     "comparison is contention, not recompute; re-run on an idle machine (rerun=true) "
                     "before trusting it.")
        lines.append(text)
    else:
        lines.append(_nothing_fits(advice, gpu))
    a = advice["attention"]
    if a:
        cost = f"; step time {a['d_time_pct']:+.1f}%" if a.get("d_time_pct") is not None else ""
        label = (f"the best selective label under {a['from']} "
                 f"({a['best_label']} saves {_mem(a['label_saving_gib'], gpu)}"
                 + (f", {a['label_d_time_pct']:+.1f}% step time)" if a.get("label_d_time_pct") is not None else ")")
                 if a["best_label"] else "any recompute label measured")
        lines.append(f"3. Attention: attention={a['to']} saves {_mem(a['saving_gib'], gpu)} against "
                     f"attention={a['from']} (both with recompute={a['control']}{cost}), more than {label}. "
                     "Change the backend before recomputing.")
    for c in advice["not_fitting"]:
        if c["status"] == "oom":
            lines.append(f"- `{c['point']}`: ran out of memory (counts as not fitting): {first_sentence(c.get('error'))}")
    for c in advice["not_measured"]:
        why = (c.get("error") or "").splitlines() or ["no rank recorded an error (a rank wrote no result)"]
        lines.append(f"- `{c['point']}`: {c['status']}, not a candidate: {why[0]}")
    for c in advice["predicted"]:
        mem = _mem(c.get("memory_gib") or 0, gpu) + (" with allocator slack" if gpu else "")
        fits = (c.get("memory_gib") or 0) <= advice["budget_gib"]
        lines.append(f"- `{c['point']}`" + (f" over {c['recompute_num_layers']} layers" if c.get("recompute_num_layers")
                                            else "")
                     + f": predicted, not measured ({mem}); "
                     + (f"predicted to fit: worth a run ({overrides_of(c)})." if fits else "predicted over the budget."))
    p = advice.get("plan")
    if p:
        lines += ["Predicted for the combinations this sweep did not run: " + line[0].lower() + line[1:]
                  if i == 0 else line for i, line in enumerate(
                      explain_plan(p, p.get("base", ""), frozenset(tuple(m) for m in p.get("measured", []))))]
    drives = advice.get("drives")
    if drives:
        first = f"try recompute={drives['label']} first" if drives["label"] else "recompute is not the lever"
        lines.append(f"What drives the peak (`{drives['point']}`): {drives['top'].strip()}. The guide: {first}; "
                     f"{drives['why']}")
    pairs = advice.get("predicted_vs_measured") or []
    if pairs:
        lines.append("Predicted (recipes.predict.estimate) next to measured, worst rank:")
        for row in pairs:
            ledger = (f"ledger {row['predicted_ledger_bytes'] / MIB:.1f} predicted / "
                      f"{(row['measured_ledger_bytes'] or 0) / MIB:.1f} measured MiB")
            peak = (f"; peak {row['predicted_peak_gib']:.2f} / {row['measured_peak_gib']:.2f} GiB"
                    if row.get("measured_peak_gib") is not None else "")
            if row.get("bound_peak_gib") is not None:
                peak += (f" (routed rows {row['routing']}; before a run the worst EP rank is bounded at "
                         f"{row['bound_peak_gib']:.2f} GiB)")
            lines.append(f"  {row['point']}: {ledger}{peak}")
    return "\n".join(lines)


def _nothing_fits(advice: dict, gpu: bool) -> str:
    near = advice["closest"]
    if near is None:
        return "2. Nothing was measured successfully: no point ran to completion (see the statuses below)."
    over = near["memory_gib"] - advice["budget_gib"]
    tries = []
    if not advice["full_measured"]:
        tries.append("recompute=full (the broadest memory effect, the largest replay cost)")
    defrag = advice["fits_if_defragmented"]
    if defrag:
        tries.append("measure.expandable_segments=true first: " + ", ".join(
            f"{c['recompute']} allocates {c['peak_allocated_gib']:.2f} GiB" for c in defrag)
            + ", within the budget, so it may fit once the allocator stops fragmenting")
    elif advice["fragmentation"]:
        tries.append("measure.expandable_segments=true (reserved is above allocated)")
    experts = "; expert parallel" if near.get("model") == "moe" else ""
    tries += ["more parallelism to split activations across GPUs (parallel.tensor_model_parallel_size=2 with "
              f"parallel.sequence_parallel=true; pipeline or context parallel{experts})",
              "a smaller train.micro_batch_size or train.seq_length",
              "activation offload (offload=<option>, conf/offload; `python -m recipes advise --predict` prices it "
              "against recompute)"]
    return (f"2. Nothing fits {_mem(advice['budget_gib'], gpu)}. Closest: recompute={near['recompute']} "
            f"(`{near['point']}`) at {_mem(near['memory_gib'], gpu)}, {_mem(over, gpu)} over. Next: "
            + "; ".join(tries) + ".")
