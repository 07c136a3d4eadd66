"""Each transformer layer's modules timed in one forward and backward: what a replay of them costs.

A recompute label replays some modules' forward in backward. What that costs a step is what their
forward took, on this GPU with this host: a GEMM's replay runs at the GEMM's rate, not the step's
average, and a host-bound module (the MoE layer's router and token permutation, MLA's RoPE) costs its
host time, which FLOPs do not see. ``time_modules`` measures it: one more forward and backward of
every micro-batch after the timed window (off the step count, no update), with forward hooks on each
layer and its modules (``TIMED``). On a GPU a module's time is the stream's, from a CUDA event its
pre-hook records to one its hook records, so it includes the GPU waiting for the host inside it; on
a CPU (tests) the wall clock. Calls inside backward are a recompute's replays, kept apart.

The result (``result.json`` ranks[*].module_times): per module name (relative to its layer, "" the
layer itself), the forward ms of one micro-batch in each of the rank's layers (``layers``: megatron's
1-based layer numbers), and the same for replays. ``recipes.predict.cost.measured_replay_s``
prices the recompute labels from a no-recompute point's forward times.

Where the step is host-bound (MoE, MLA), a replay costs neither its stream time nor its GPU time but
what the host's lead at that point in backward leaves of it. On a GPU, more passes give ``marks``,
each timed module's forward start (``pre``) and end (``end``) and its backward start (``bwd``, a
gradient hook on its output): a host pass notes only the host's clock at each (no CUDA event: the
host's pace as the step has it, but for the hooks' calls; a light pass with one mark gives what the
hooks cost), and a GPU pass records CUDA events at each around a ``torch.cuda._sleep`` long enough
that the host has issued the next interval's work before the GPU starts it, so the events time the
GPU's own work between marks, no waiting for the host. A forward-only pass under ``torch.no_grad``
notes the host's clock at the forwards' marks again: a checkpoint runs its region's first forward so
(no autograd graph; megatron's MoE router skips its aux loss), and in a host-bound step what that
saves the host is step time. ``recipes.predict.replay`` replays that timeline with a recompute's
forwards inserted where its backward runs them and its regions' first forwards at their no-grad cost.
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch

from recipes.measure.collections import collector_off
from recipes.measure.regions import function_host_ms, offload_host_ms, region_forward_host_ms, region_host_ms

#: The modules timed, by name relative to their layer ("" the layer; a name a layer lacks is skipped).
TIMED = ("", "input_layernorm", "pre_mlp_layernorm", "self_attention", "self_attention.core_attention",
         "self_attention.linear_qkv", "self_attention.linear_proj", "self_attention.linear_q_proj",
         "self_attention.linear_q_down_proj", "self_attention.linear_q_up_proj",
         "self_attention.linear_kv_down_proj", "self_attention.linear_kv_up_proj",
         "self_attention.q_layernorm", "self_attention.kv_layernorm", "mlp", "mlp.linear_fc1",
         "mlp.linear_fc2", "mlp.router", "mlp.experts", "mlp.shared_experts")
_SKIP = ("IdentityOp", "IdentityFuncOp")


def transformer_layers(chunks: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """Every chunk's ``TransformerLayer``s, in order (as the memory trace finds them)."""
    # lazy: megatron takes seconds to import; tools that never build a model skip it
    from megatron.core.transformer.transformer_layer import TransformerLayer

    return [m for chunk in chunks for m in chunk.modules() if isinstance(m, TransformerLayer)]


class _Clock:
    """CUDA events on the current stream (GPU) or the wall clock (CPU)."""

    def __init__(self, cuda: bool):
        self.cuda = cuda

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def ms(self, start, end) -> float:
        return start.elapsed_time(end) if self.cuda else (end - start) * 1e3


class ModuleTimer:
    """Forward hooks on each layer's ``TIMED`` modules: (layer number, name, in backward) -> intervals.

    With ``marks``, the timeline instead: a mark ("<layer>:<module>:<pre|end|bwd>") at each timed
    module's forward start and end and its backward start, in the host's order, with the host's clock
    ("host"), or a CUDA event ending the interval before it, a sleep (``sleep_ms``, one a mark) and one
    starting the interval after it ("gpu"). "host" and "light" also mark where backward leaves the
    first layer (``input:bwd``), "light" nothing else: the two passes' host clocks there give what a
    mark's hooks cost the host."""

    def __init__(self, chunks: list[torch.nn.Module], cuda: bool, marks: str | None = None,
                 sleep_ms: list[float] | None = None):
        self.clock, self.handles = _Clock(cuda), []
        self.intervals: dict[tuple[int, str, bool], list] = defaultdict(list)
        self.mode, self.marks = marks, []
        per_ms = _cycles_per_ms() if marks == "gpu" and sleep_ms else 0.0
        self.sleep_cycles = [int(ms * per_ms) for ms in sleep_ms or []]
        self.layers = []
        layers = transformer_layers(chunks)
        for layer in layers:
            self.layers.append(layer.layer_number)
            if marks == "light":
                continue
            modules = dict(layer.named_modules())
            for name in TIMED:
                module = modules.get(name)
                if module is not None and type(module).__name__ not in _SKIP:
                    self._hook(module, layer.layer_number, name)
        if marks in ("host", "light") and layers:  # where backward leaves the layers: both passes mark it
            self.handles.append(layers[0].register_forward_pre_hook(self._input_hook, with_kwargs=True))

    def _input_hook(self, _module, args, kwargs):
        hidden = args[0] if args else kwargs.get("hidden_states")
        if isinstance(hidden, torch.Tensor) and hidden.requires_grad and torch._C._current_graph_task_id() == -1:
            hidden.register_hook(lambda _grad: self.note("input:bwd"))

    def note(self, name: str) -> None:
        """One mark: the host's clock, and in the GPU pass the events around a sleep."""
        if self.mode in ("host", "light"):
            self.marks.append((name, time.perf_counter()))
            return
        end = self.clock.mark()
        if self.sleep_cycles:
            torch.cuda._sleep(self.sleep_cycles[min(len(self.marks), len(self.sleep_cycles) - 1)])
        self.marks.append((name, time.perf_counter(), end, self.clock.mark()))

    def _hook(self, module: torch.nn.Module, layer: int, name: str) -> None:
        open_: list = []

        def pre(_module, _args):
            if self.mode is None:
                open_.append(self.clock.mark())
            elif torch._C._current_graph_task_id() == -1:
                self.note(f"{layer}:{name}:pre")

        def post(_module, _args, output):
            replay = torch._C._current_graph_task_id() != -1  # inside autograd's backward: a replay
            if self.mode is None:
                self.intervals[(layer, name, replay)].append((open_.pop(), self.clock.mark()))
                return
            if replay:
                return
            self.note(f"{layer}:{name}:end")
            out = output[0] if isinstance(output, (tuple, list)) else output
            if isinstance(out, torch.Tensor) and out.requires_grad:  # fires as backward reaches the module
                out.register_hook(lambda _grad: self.note(f"{layer}:{name}:bwd"))

        self.handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def summary(self, microbatches: int) -> dict:
        """Per module name: ms of one micro-batch in each layer, forward and replayed (read after a
        synchronize)."""
        out: dict = {"layers": self.layers, "microbatches": microbatches, "forward_ms": {}, "replay_ms": {}}
        index = {n: i for i, n in enumerate(self.layers)}
        for (layer, name, replay), spans in sorted(self.intervals.items()):
            per_layer = out["replay_ms" if replay else "forward_ms"].setdefault(name, [0.0] * len(self.layers))
            per_layer[index[layer]] += sum(self.clock.ms(a, b) for a, b in spans) / microbatches
        return out


def _cycles_per_ms() -> float:
    """GPU clock cycles a ms of ``torch.cuda._sleep`` spins (measured: the clock under load varies).
    The faster of two spins: an idle GPU's clock rises during the first (on a freshly started H200 the
    first read 0.6 million cycles a ms, the next ones 1.97), and a sleep sized at a slow clock would be
    too short at the pass's."""
    rates = []
    for _ in range(2):
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        torch.cuda._sleep(20_000_000)
        b.record()
        b.synchronize()
        rates.append(20_000_000 / max(a.elapsed_time(b), 1e-3))
    return max(rates)


def _pass(trainer, timer: ModuleTimer, forward_only: bool = False) -> float:
    """One forward and backward of the step's micro-batches under ``timer`` (no update), or with
    ``forward_only`` their forward under ``torch.no_grad`` as a checkpoint runs its region's first
    (``Trainer.forward_only``); its origin on the host's clock (the stream drained first), after which
    the pass starts with a mark."""
    try:
        if timer.clock.cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        if timer.mode:
            timer.note("start")
        if forward_only:
            trainer.forward_only()
        else:
            trainer.compute_gradients()
        if timer.clock.cuda:
            torch.cuda.synchronize()
        return t0
    finally:
        timer.remove()
        trainer.optimizer.zero_grad()


#: The GPU pass's sleep at each mark (ms): the host pass's time to the next mark this many times over,
#: plus ``SLEEP_PLUS_MS`` (the GPU pass's events), so the host has issued an interval's work before the
#: GPU starts it. At the h200 size (MoE: 961 marks) a base point's measurements after its steps took
#: 1.4-1.7 s with the three passes, the other points' 0.5-0.8 s (one H200); the two
#: forward-only passes added later ran 80-160 ms each.
SLEEP_FACTOR, SLEEP_PLUS_MS = 1.5, 0.2
#: The most a mark's hooks are taken to cost the host (ms; about 0.025 on a CPU core).
MARK_COST_MAX_MS = 0.1


def time_modules(trainer, marks: bool = True) -> dict:
    """One more forward and backward of the step's micro-batches with the layers' modules timed (no
    update: the gradients are zeroed after); on a GPU with ``marks``, also the timeline (``timeline``).
    Python's collector is off throughout (``collector_off``)."""
    with collector_off():
        return _time_modules(trainer, marks)


def _time_modules(trainer, marks: bool) -> dict:
    cuda = trainer.on_gpu
    timer = ModuleTimer(trainer.chunks, cuda)
    _pass(trainer, timer)
    out = timer.summary(trainer.num_microbatches)
    if cuda and marks:
        try:
            out["marks"] = timeline(trainer)
        except Exception as err:  # an OOM, or passes that differ: the module times stand
            out["marks"] = {"error": f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"}
    return out


def _host_cost(measure, spent: dict[str, float], name: str) -> dict | None:
    """``measure`` (a host cost of ``recipes.measure.regions``) on this GPU, the seconds it took noted
    in ``spent[name]`` (what it adds to the pass); None where it failed: the timeline stands, and the
    price takes the settings instead (``estimate.replay_region_ms``, the offload rates)."""
    t0 = time.perf_counter()
    try:
        return measure(torch.device("cuda"))
    except Exception:
        return None
    finally:
        spent[name] = round(time.perf_counter() - t0, 3)


def note_host_wait(module_times: dict | None, wait_ms: float) -> None:
    """Put the point's measured steps' wait for the GPU at the grad-norm read (``timing.host_wait_s``,
    ms) on its timeline as ``step_host_wait_ms``, the margin ``recipes.predict.replay.Timeline.added``
    prices added host work against; nothing where the pass recorded no timeline."""
    marks = (module_times or {}).get("marks")
    if isinstance(marks, dict) and "names" in marks:
        marks["step_host_wait_ms"] = wait_ms


def timeline(trainer) -> dict:
    """The marks of a host pass and a GPU pass (``ModuleTimer``): ``names``; ``host_ms`` the host's
    clock at each since the pass began; ``pass_ms`` the host pass from its start to the end of its
    work on the GPU (a synchronize), what the timeline should replay to; ``gpu_ms`` the GPU's own work
    from the mark before to each; ``gpu_clean`` whether the host had issued that interval's work
    before the GPU began it (the GPU cannot have waited inside it); ``mark_cost_ms`` what a mark's
    hooks cost the host (``recipes.predict.replay`` takes it off); ``nograd_names`` and
    ``nograd_host_ms`` the forwards' marks and host clock in a forward-only pass under no_grad (after
    one unmarked: a process's first no-grad forward took 2-3x as long on the H200); ``region_ms`` what
    a checkpoint region of each kind costs this host beyond its function (``region_forward_ms``: its
    forward's part), ``region_function_ms``
    the median host ms of each elementwise region's function in the host pass, ``offload_ms`` what
    an offload group costs this host, a group and a tensor (``recipes.measure.regions``), and
    ``host_cost_s`` the seconds those measurements added to the pass."""
    light = ModuleTimer(trainer.chunks, True, marks="light")
    l0 = _pass(trainer, light)
    host = ModuleTimer(trainer.chunks, True, marks="host")
    with function_host_ms() as functions:
        t0 = _pass(trainer, host)
        pass_ms = (time.perf_counter() - t0) * 1e3
    # a process's first no-grad forward took 2-3x as long as the next on the H200: one unmarked first
    _pass(trainer, ModuleTimer(trainer.chunks, True, marks="light"), forward_only=True)
    nograd = ModuleTimer(trainer.chunks, True, marks="host")
    n0 = _pass(trainer, nograd, forward_only=True)
    kept = [m for m in host.marks if m[0] != "input:bwd"]  # the GPU pass does not mark backward's end
    names, issued = [m[0] for m in kept], [m[1] for m in kept]
    sleeps = [SLEEP_FACTOR * (b - a) * 1e3 + SLEEP_PLUS_MS for a, b in zip(issued, issued[1:])]
    gpu = ModuleTimer(trainer.chunks, True, marks="gpu", sleep_ms=sleeps + [SLEEP_PLUS_MS])
    g0 = _pass(trainer, gpu)
    if names != [m[0] for m in gpu.marks]:
        raise RuntimeError(f"the GPU pass made {len(gpu.marks)} marks, the host pass {len(names)}")
    # the hooks' cost a mark: the host pass reached backward's end later than the light one by that
    # many marks' worth (a process's host pace moves too: kept within [0, MARK_COST_MAX_MS])
    ends = [j for j, m in enumerate(host.marks) if m[0] == "input:bwd"]
    light_end = [m[1] - l0 for m in light.marks if m[0] == "input:bwd"]
    cost = 0.0
    if ends and light_end:
        extra = (host.marks[ends[-1]][1] - t0) - light_end[-1]
        cost = min(max(extra * 1e3 / max(ends[-1] - (len(light.marks) - 1), 1), 0.0), MARK_COST_MAX_MS)
    origin = gpu.marks[0][2]  # the stream was drained: it runs as the host records it, at g0
    spent: dict[str, float] = {}
    work, clean = [0.0], [True]
    for (_, _, _, begun), (_, noted, ended, _) in zip(gpu.marks, gpu.marks[1:]):
        work.append(round(begun.elapsed_time(ended), 4))
        clean.append(origin.elapsed_time(begun) >= (noted - g0) * 1e3)
    return {"names": names, "host_ms": [round((t - t0) * 1e3, 4) for t in issued],
            "pass_ms": round(pass_ms, 4), "mark_cost_ms": round(cost, 5), "gpu_ms": work, "gpu_clean": clean,
            "nograd_names": [m[0] for m in nograd.marks],
            "nograd_host_ms": [round((m[1] - n0) * 1e3, 4) for m in nograd.marks],
            "region_ms": _host_cost(region_host_ms, spent, "region"),
            "region_forward_ms": _host_cost(region_forward_host_ms, spent, "region_forward"),
            "region_function_ms": {label: round(sorted(ms)[len(ms) // 2], 4) for label, ms in functions.items() if ms},
            "offload_ms": _host_cost(offload_host_ms, spent, "offload"), "host_cost_s": spent}
