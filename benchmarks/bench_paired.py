"""What a recompute or offload option adds to a step, measured against itself switched off in the same
process, next to the planner's price from that process's own timeline.

    python benchmarks/bench_paired.py --processes 3 model=moe size=h200 --options full,selective/moe
    python benchmarks/bench_paired.py --processes 1 model=standard_attn size=h200 --options full,selective/mlp
    python benchmarks/bench_paired.py --processes 1 model=standard_attn size=h200 \
      --options "offload=core_attn,recompute=selective/layernorm offload=attn_norm-mlp_norm"
    python benchmarks/bench_paired.py --together --processes 3 --rounds 16 model=moe size=h200 \
      --options selective/moe_act,selective/layernorm,selective/moe_act-layernorm

An option is a recompute option (``full``, ``selective/moe``), or overrides separated by spaces
(``offload=core_attn``, ``recompute=selective/moe_act offload=moe_act offload.activation_offload_fraction=0.75``).

A label sweep measures each option in its own processes, so an option's cost is the difference of two
sets of processes; where the host's speed moves between processes (an MoE step's wall time follows it:
docs/speed.md), that difference moves with it. Here each process builds the worker's ``Trainer`` with
the option and, after 2 warm-up steps each way, alternates steps with the option on and switched off
(``recipes.measure.labels.recompute_disabled``: the model as ``recompute=none`` builds it, same
weights, same allocator; and megatron's offload manager paused, ``recipes.build.offload.offload_paused``:
its points stay in the graph and move nothing), ``--rounds`` of each, in the order on/off, off/on, ... Before those it
records the module times and step timeline with the option off (``recipes.measure.moduletime``, what a
sweep's ``none`` point records) and prices the option on them as the planner does
(``recipes.analyze.plan.price_config``), then runs ``SETTLE_ROUNDS`` rounds untimed: the first rounds
after the passes cost more than the rest, a transient of switching back that a run does not pay
(``--by-round`` tables it; ``--settle N`` leaves such rounds out of processes saved before).
Both figures then belong to one process at one host pace.

Per process and option: the median off and on step (ms, each step timed from a drained stream to
its end), the added ms (the median of the rounds' on-minus-off differences; in brackets the middle half
of them), and the price (``timeline`` where the pass recorded a step timeline, on a GPU, else from the
module times): the replays' and the copies' together, the copies priced at the host link this process
measured (``recipes.measure.offload.host_link_bandwidth``, the slower direction). An offload option also
runs two more steps after its rounds: one timing where compute waits for each reload
(``recipes.measure.offload.CopyTimeline``: ``reload waits ms``, against the price's stall), and one
profiled, the copies' time with no kernel beside them (``exposed ms``; the profiler slows the host, and
with it the forward the copies hide under). It then times the offload manager method by method in a
step on and one off (``recipes.measure.offload.ManagerCalls``, beside the planner's synthetic groups
timed the same way), and for every option profiles the GPU alone in a step on and one off: what the
kernels added beside what the step added (where the step grew by more, the GPU waited for the host),
and the host's side in one more pair (``host_ops``: the operators' and CUDA calls' self host ms, the
ones that grew most, and the garbage collector's ms, which every paired step records too).

Options measured one after another meet the machine at different moments, and an MoE step's host
pace drifts over minutes: one option can come out cheaper than another that replays all it does.
``--together`` measures selective recompute options at one machine state: one model is built with
every label they name, and each round steps each option in turn (its labels on, the rest switched off,
``recipes.measure.labels.labels_disabled``) beside its own step switched off, the options' order turned
by one each round. Full recompute and offload are built into the model and are measured without it.
On a CPU it runs, for tests, at whatever size is given; times mean nothing there. Its saved processes
are read back, priced with today's code and tabled by ``benchmarks/paired_tables.py`` (``--table``,
``--summary``, ``--fit``).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import gzip
import json
import os
import statistics
import subprocess
import sys
import time
from collections import Counter
from functools import partial
from pathlib import Path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks import paired_steps  # noqa: E402
from benchmarks.bench_hostbound import defaults  # noqa: E402  (model=moe size=h200 unless named, profile=none)
from benchmarks.paired_steps import gpu_work, host_ops, manager_calls, switched_off, timed_step  # noqa: E402
from benchmarks.paired_tables import (  # noqa: E402
    ROW_HEADER,
    by_round,
    fit,
    paired_figures,
    pool,
    price,
    process_tables,
    row,
    summary,
    table,
)

#: Pairs of steps each option runs untimed after the module-time passes, before its timed rounds: the
#: first two rounds after the passes stood apart from the rest in every kind of saved process
#: (``--by-round``), a transient of switching back from the passes that a run does not pay.
SETTLE_ROUNDS = 2


def option_overrides(option: str) -> list[str]:
    """``full`` -> ``recompute=full``; ``offload=core_attn recompute=selective/layernorm`` -> its overrides."""
    return option.split() if "=" in option else [f"recompute={option}"]


class Paired:
    """One option's paired steps in a process: each step's ms, host ms, wait at the grad-norm read,
    collector ms and device allocations, with the option on and switched off (``off``: the block the
    off steps run under)."""

    def __init__(self, trainer, cuda: bool, off):
        self.trainer, self.cuda, self.off = trainer, cuda, off
        self.ms = {True: [], False: []}
        self.host, self.allocs = {True: [], False: []}, {True: [], False: []}
        self.wait, self.gc = {True: [], False: []}, {True: [], False: []}

    def step(self, on: bool) -> None:
        with contextlib.nullcontext() if on else self.off():
            self.ms[on].append(timed_step(self.trainer, self.cuda, self.host[on], self.allocs[on], self.wait[on],
                                           self.gc[on]))

    def pair(self, r: int, run_length: int = 1) -> None:
        """Round ``r``'s steps: ``run_length`` on then as many off, or off then on (odd rounds)."""
        for on in ((True, False) if r % 2 == 0 else (False, True)):
            for _ in range(run_length):
                self.step(on)

    def result(self, option: str, cfg: dict, module_times: list[dict], link_gb_s: float | None,
               run_length: int = 1) -> dict:
        """The option's figures from its steps, priced on the first of ``module_times`` (what a sweep's
        base point records: one pass after its steps) at ``link_gb_s``; its steps followed
        ``SETTLE_ROUNDS`` rounds untimed."""
        from recipes.measure.moduletime import note_host_wait

        on_ms, off_ms = self.ms[True], self.ms[False]
        marks = module_times[0].get("marks")
        if paired_steps.metering():  # each pass with its steps' wait at the grad-norm read, as a sweep's base point
            wait = statistics.median(self.wait[False])
            for timed in module_times:
                note_host_wait(timed, wait)
        return {"option": option, **paired_figures(on_ms, off_ms, self.host[True], self.host[False]),
                **price(cfg, module_times[0], link_gb_s), "link_gb_s": link_gb_s,
                "priced_on": "timeline" if isinstance(marks, dict) and "names" in marks else "module times",
                "host_pass_ms": marks.get("pass_ms") if isinstance(marks, dict) else None,
                "raw": {"cfg": cfg, "on_ms": on_ms, "off_ms": off_ms, "on_host_ms": self.host[True],
                        "off_host_ms": self.host[False], "on_wait_ms": self.wait[True], "off_wait_ms": self.wait[False],
                        "on_gc_ms": self.gc[True], "off_gc_ms": self.gc[False], "on_allocs": self.allocs[True],
                        "off_allocs": self.allocs[False], "run_length": run_length, "settle_rounds": SETTLE_ROUNDS,
                        "module_times": module_times}}


def _build(cfg: dict):
    """The worker's ``Trainer`` for ``cfg`` (``recipes.run.world.fresh_trainer``) and whether it runs on a GPU."""
    from recipes.build.compat import cuda_available
    from recipes.run.world import fresh_trainer

    return fresh_trainer(cfg), cuda_available()


def _warm_and_pass(trainer, cuda: bool, passes: int) -> tuple:
    """Two steps each way before anything is timed, then ``passes`` module-time passes with the option
    switched off (``recipes.measure.moduletime``): (the switched-off block, the passes)."""
    from recipes.measure.moduletime import time_modules

    off = partial(switched_off, trainer)
    for _ in range(2):
        timed_step(trainer, cuda)
        with off():
            timed_step(trainer, cuda)
    with off():
        return off, [time_modules(trainer) for _ in range(passes)]


def measure_option(overrides: list[str], option: str, rounds: int, passes: int = 1, run_length: int = 1,
                   trace: str | None = None) -> dict:
    """One option in this process: the paired steps and its price on this process's timeline.
    ``run_length``: steps in a row each way (1: on/off, off/on, ...; 4: 4 on, 4 off, 4 off, 4 on, ...);
    ``trace``: where an offload option's profiled step's trace is kept (gzipped)."""
    from recipes.config import compose_config
    from recipes.measure.moduletime import time_modules
    from recipes.measure.offload import CopyTimeline, copy_overlap, host_link_bandwidth

    cfg = compose_config([*overrides, *option_overrides(option)])
    trainer, cuda = _build(cfg)
    try:
        off, before = _warm_and_pass(trainer, cuda, passes)
        for r in range(SETTLE_ROUNDS):  # untimed: back from the passes, switched off, to both ways
            Paired(trainer, cuda, off).pair(r, run_length)
        steps = Paired(trainer, cuda, off)
        for r in range(max(1, rounds // run_length)):
            steps.pair(SETTLE_ROUNDS + r, run_length)
        with off():
            after = [time_modules(trainer) for _ in range(passes - 1)]
        clock, calls = {}, None
        if trainer.offloading:  # one more step, unprofiled: the copies and where compute stood still for reloads
            with CopyTimeline() as timeline:
                timed_step(trainer, cuda)
            clock = timeline.summary()
            calls = manager_calls(trainer, cuda)
        ops = host_ops(trainer, cuda)
        gpu = gpu_work(trainer) if cuda else None
        exposed = None
        keep = Path(trace) if trace and trainer.offloading else None
        if trainer.offloading and (overlap := copy_overlap(trainer.step, keep)) is not None:
            exposed = overlap[0]["exposed_s"] * 1e3
        link = host_link_bandwidth() if trainer.offloading else None
        link_gb_s = min(link["d2h_gb_s"], link["h2d_gb_s"]) if link else None
        out = steps.result(option, cfg, before + after, link_gb_s, run_length)
        out.update(exposed_ms=exposed, host_ops=ops, **({"gpu_work": gpu} if gpu else {}),
                   **({"manager_calls": calls} if calls else {}))
        if clock:
            w = clock["reload_wait_s"]
            out.update(reload_waits=clock["reload_waits"], copies=clock.get("copies"),
                       strided_out=clock.get("strided_out"), reload_wait_ms=None if w is None else w * 1e3)
            out["raw"]["copy_timeline"] = clock.get("copy_timeline")
        return out
    finally:
        trainer.close()


def together_labels(options: list[str]) -> list[frozenset]:
    """Each option's selective labels, for ``--together``; refused, naming the fix, where an option
    is not a set of selective labels (full recompute and offload are built into the model, not
    switched per step)."""
    from recipes.recompute import selective_labels

    labels = [selective_labels(o) if "=" not in o else None for o in options]
    wrong = [o for o, ls in zip(options, labels) if not ls]
    if wrong:
        raise SystemExit(f"--together: {', '.join(wrong)} is not a selective recompute option "
                         "(selective/<label>[-<label>...]); measure it without --together")
    return labels


def measure_together(overrides: list[str], options: list[str], rounds: int, passes: int = 1) -> list[dict]:
    """Selective recompute options on one model built with all their labels: each round steps every
    option in turn (only its labels on: ``recipes.measure.labels.labels_disabled`` for the rest), each
    with its own step switched off beside it, on/off or off/on, the options' order turned by one each
    round. Every option is then measured at one machine state, against the same model, weights and
    allocator, and priced on the same pass. A result per option, as ``measure_option``'s."""
    from recipes.config import compose_config
    from recipes.measure.labels import labels_disabled
    from recipes.measure.moduletime import time_modules

    labels = together_labels(options)
    built = sorted(set().union(*labels))
    cfg = compose_config([*overrides, "recompute=control", f"recompute.recompute_modules=[{','.join(built)}]"])
    trainer, cuda = _build(cfg)

    def only(ls):  # this option's labels on, the others built in switched off
        return partial(labels_disabled, trainer.chunks, [x for x in built if x not in ls])

    try:
        off, before = _warm_and_pass(trainer, cuda, passes)
        for r in range(SETTLE_ROUNDS):  # untimed: back from the passes, switched off, to every option
            for i in range(len(options)):
                with only(labels[(i + r) % len(options)])():
                    Paired(trainer, cuda, off).pair(r + i)
        steps = [Paired(trainer, cuda, off) for _ in options]
        # each option's checkpoint regions, run and replayed, per label: its on steps' (the off ones run none)
        regions = [{"forward": Counter(), "recompute": Counter()} for _ in options]
        for r in range(SETTLE_ROUNDS, SETTLE_ROUNDS + rounds):
            for i in range(len(options)):
                k = (i + r) % len(options)
                trainer.counter.reset()
                with only(labels[k])():
                    steps[k].pair(r + i)
                regions[k]["forward"].update(trainer.counter.forward)
                regions[k]["recompute"].update(trainer.counter.recompute)
        with off():
            after = [time_modules(trainer) for _ in range(passes - 1)]
        out = []
        for option, ls, paired, counted in zip(options, labels, steps, regions):
            with only(ls)():
                ops, gpu = host_ops(trainer, cuda), gpu_work(trainer) if cuda else None
            r = paired.result(option, compose_config([*overrides, *option_overrides(option)]),
                              [json.loads(json.dumps(m)) for m in before + after], None)
            r.update(exposed_ms=None, host_ops=ops, **({"gpu_work": gpu} if gpu else {}))
            r["raw"]["together"] = {"options": options, "built": built,
                                    "checkpoints": {k: dict(c) for k, c in counted.items()}}
            out.append(r)
        return out
    finally:
        trainer.close()


def measure(overrides: list[str], options: list[str], rounds: int, passes: int, run_length: int = 1,
            traces: str | None = None, together: bool = False) -> list[dict]:
    from recipes.config import compose_config
    from recipes.run.world import init_one_rank

    init_one_rank(compose_config(overrides))
    paired_steps.install_meters()
    import torch

    if together:
        return measure_together(overrides, options, rounds, passes)
    results = []
    for i, option in enumerate(options):
        trace = os.path.join(traces, f"trace-option-{i}.json.gz") if traces else None
        results.append(measure_option(overrides, option, rounds, passes, run_length, trace))
        gc.collect()  # the option's model and optimizer, before the next one's are built
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return results



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     epilog="Everything else is a Hydra override, as train.py takes them.")
    parser.add_argument("--processes", type=int, default=3, help="fresh processes, one after another (default 3)")
    parser.add_argument("--options", default="full", help="options, comma-separated: recompute options, or overrides separated by spaces "
                        "(\"offload=core_attn\"; default full)")
    parser.add_argument("--rounds", type=int, default=8, help="on/off pairs of steps per option (default 8)")
    parser.add_argument("--passes", type=int, default=1,
                        help="module-time passes before the steps (and one fewer after); the price reads the first")
    parser.add_argument("--run-length", type=int, default=1,
                        help="steps in a row each way (default 1: on/off, off/on, ...)")
    parser.add_argument("--together", action="store_true",
                        help="selective recompute options measured on one model built with all their labels, "
                        "interleaved round by round (each process's options at one machine state)")
    parser.add_argument("--keep-traces", action="store_true",
                        help="with --save: keep each offload option's profiled step's trace beside its process")
    parser.add_argument("--save", help="write each process's steps, config and module times to SAVE/process-N.json.gz")
    parser.add_argument("--table", nargs="+", metavar="DIR", help="no run: price the processes saved in DIRs with "
                        "this code and print their rows and the summary over them all")
    parser.add_argument("--summary", nargs="+", metavar="DIR", help="no run: as --table, the summary over them all "
                        "alone, with each option's error interval over its processes and the count against 20%%")
    parser.add_argument("--settle", type=int, default=0, metavar="N",
                        help="with --table, --summary or --fit: each option's figures from its rounds after the first N "
                        "after its module-time passes (its untimed rounds count)")
    parser.add_argument("--by-round", nargs="+", metavar="DIR", help="no run: each round's on-minus-off ms less its "
                        "option's median, by round, over the processes saved in DIRs")
    parser.add_argument("--fit", nargs="+", metavar="DIR", help="no run: fit estimate.offload_ms_per_group and "
                        "_per_gib to the offload options saved in DIRs (those without recompute, of a step that is "
                        "not host-bound) and print every saved option's summary priced at them")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child: measure, print JSON
    parser.add_argument("--traces", help=argparse.SUPPRESS)  # a child: where its offload options' traces go
    args, overrides = parser.parse_known_args()
    if args.table or args.summary:
        table(args.table or args.summary, summary_only=bool(args.summary), settle=args.settle)
        return
    if args.fit:
        print("\n".join(fit(args.fit, args.settle)))
        return
    if args.by_round:
        print("\n".join(by_round(args.by_round)))
        return
    overrides, options = defaults(overrides), args.options.split(",")
    if args.together:
        together_labels(options)  # refused here, before any process starts
        if args.run_length != 1:
            raise SystemExit("--together pairs each option's steps one on, one off: drop --run-length")
    if args.one:
        print("RESULT " + json.dumps(measure(overrides, options, args.rounds, args.passes, args.run_length,
                                             args.traces, args.together)), flush=True)
        return
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (times mean nothing)"
    print(f"{' '.join(overrides)}; {args.processes} processes, {args.rounds} rounds"
          f"{', the options together on one model' if args.together else ''}; {device}; "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n\n{ROW_HEADER}")
    rows: dict[tuple[str, str], list[dict]] = {}
    numbered = []
    for n in range(args.processes):
        traces = [f"--traces={os.path.join(args.save, f'process-{n}')}"] if args.save and args.keep_traces else []
        if traces:
            os.makedirs(traces[0].split("=", 1)[1], exist_ok=True)
        done = subprocess.run([sys.executable, __file__, "--one", f"--options={args.options}", f"--rounds={args.rounds}",
                               f"--passes={args.passes}", f"--run-length={args.run_length}", *traces,
                               *(["--together"] if args.together else []), *overrides],
                              cwd=REPO, capture_output=True, text=True)
        line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            print(f"| {n} | failed (exit {done.returncode}): {done.stderr.strip().splitlines()[-1:]} | | | | | | | | |")
            continue
        results = json.loads(line[len("RESULT "):])
        if args.save:
            os.makedirs(args.save, exist_ok=True)
            with gzip.open(os.path.join(args.save, f"process-{n}.json.gz"), "wt") as f:
                json.dump(results, f)
        for r in results:
            pool(rows, r)
            numbered.append((n, r))
            print(row(n, r), flush=True)
    print()
    for line in process_tables(numbered):
        print(line)
    print("\n".join(summary(rows)))


if __name__ == "__main__":
    main()
