"""recipes.measure.steptrace: a profiled step's trace read as kernel time, idle GPU, copies and
blocking CUDA calls (the arithmetic, on a synthetic trace; a GPU run records real ones)."""

from __future__ import annotations

import gzip
import json

import pytest
import torch

from recipes.measure.steptrace import summarize, trace_step


def _x(cat, name, ts, dur):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def test_a_step_summary_splits_kernels_idle_copies_and_host_calls():
    trace = {"traceEvents": [
        _x("kernel", "gemm", 0, 40), _x("kernel", "gemm", 100, 40), _x("kernel", "softmax", 30, 20),
        _x("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 140, 20),  # after every kernel: exposed
        _x("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 110, 10),  # under the second gemm: hidden
        _x("gpu_memset", "Memset (Device)", 190, 10),
        _x("cuda_runtime", "cudaStreamWaitEvent", 0, 5), _x("cuda_runtime", "cudaStreamWaitEvent", 50, 7),
        _x("cuda_runtime", "cudaLaunchKernel", 0, 1),
        _x("cpu_op", "aten::mm", 0, 500),  # host ops are not GPU time
        {"ph": "i", "cat": "kernel", "name": "marker", "ts": 900},  # no duration: ignored
    ]}
    s = summarize(trace)
    us = 1e-6
    assert s["span_s"] == pytest.approx(200 * us)
    assert s["kernel_busy_s"] == pytest.approx(90 * us)  # [0, 50) and [100, 140)
    assert s["kernel_total_s"] == pytest.approx(100 * us)  # overlapping kernels counted each
    assert s["gpu_idle_s"] == pytest.approx(200 * us - 50 * us - 40 * us - 20 * us - 10 * us)
    assert s["gpu_busy_s"] == pytest.approx(120 * us)  # kernels, copies and the memset: what the host did not idle
    assert s["copies"]["d2h_exposed_s"] == pytest.approx(20 * us) and s["copies"]["h2d_exposed_s"] == 0
    assert s["copies"]["exposed_s"] == pytest.approx(20 * us) and s["copies"]["copies"] == 2
    assert [k["name"] for k in s["kernels"]] == ["gemm", "softmax"] and s["kernels"][0]["calls"] == 2
    assert s["kernels"][0]["ms"] == pytest.approx(0.08)
    assert s["runtime"][0] == {"name": "cudaStreamWaitEvent", "ms": pytest.approx(0.012), "calls": 2}


def test_an_empty_trace_summarizes_to_zeros():
    s = summarize({"traceEvents": []})
    assert s["span_s"] == 0 and s["kernels"] == [] and s["copies"]["copy_busy_s"] == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU answer; a GPU run records the trace")
def test_tracing_a_step_needs_a_gpu():
    assert trace_step(lambda: None) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: CUDA kernels and copies to trace")
def test_a_traced_step_on_a_gpu_sees_its_kernels_and_copies(tmp_path):
    a = torch.randn(2048, 2048, device="cuda")
    host = torch.empty(2048, 2048, pin_memory=True)

    def step():
        (a @ a).relu_()
        host.copy_(a, non_blocking=True)

    s = trace_step(step, keep=tmp_path / "t.json.gz")
    assert s["kernel_busy_s"] > 0 and s["kernels"] and s["copies"]["d2h_busy_s"] > 0
    assert (tmp_path / "t.json.gz").stat().st_size > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: CUDA kernels to time")
def test_the_gpu_s_busy_time_alone_leaves_the_host_out_and_the_idle_gaps_out(tmp_path):
    a = torch.randn(2048, 2048, device="cuda")

    def step():
        a @ a
        torch.cuda._sleep(1)  # keep the device's clock running
        import time
        time.sleep(0.05)  # the host idles the GPU for 50 ms between two GEMMs
        a @ a

    s = trace_step(step, keep=tmp_path / "t.json.gz", host=False)
    events = json.loads(gzip.decompress((tmp_path / "t.json.gz").read_bytes()))["traceEvents"]
    assert not [e for e in events if e.get("cat") == "cpu_op"]  # no host operators recorded
    assert s["kernels"] and s["gpu_idle_s"] > 0.04 and 0 < s["gpu_busy_s"] < 0.01
