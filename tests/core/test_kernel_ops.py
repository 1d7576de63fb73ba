# SPDX-License-Identifier: Apache-2.0
"""CPU tests of the Sage8 custom ops' fake implementations and of the backends' registration."""

from __future__ import annotations

import os

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from dist_attn import backends
from dist_attn.kernels.sage8 import IMPLS, ops  # noqa: F401  (registers the ops)

__all__: list[str] = []


def test_fake_shapes():
    with FakeTensorMode():
        q = torch.empty(2, 100, 3, 64, dtype=torch.bfloat16)
        out = torch.ops.dist_attn.sage8_dense(q, q, q, 0.125, "gluon")
        assert out.shape == q.shape and out.dtype == q.dtype
        out, lse = torch.ops.dist_attn.sage8_dense_lse(q, q, q, 0.125, "triton")
        assert out.shape == q.shape and lse.shape == (2, 3, 100) and lse.dtype == torch.float32
        q3 = torch.empty(100, 3, 64, dtype=torch.float16)
        cu = torch.tensor([0, 40, 100], dtype=torch.int32)
        assert torch.ops.dist_attn.sage8_varlen(q3, q3, q3, cu, 60, 100, 0.1, "gluon").shape == q3.shape


def test_compile_traces_without_graph_break():
    """A compiled function calling the op makes one graph (the fake impl gives the shapes)."""
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()

    @torch.compile(backend=counter, fullgraph=True)
    def f(q):
        return torch.ops.dist_attn.sage8_dense(q, q, q, 0.125, "triton") * 2

    q = torch.empty(1, 8, 1, 64, dtype=torch.bfloat16, device="meta")
    f(q)
    assert counter.frame_count == 1


def test_both_kernels_registered():
    names = backends.available_backends()
    assert "sage8" in names and "sage8_gluon" in names
    # "sage8" is the faster loop as measured on the H200 (benchmarks/KERNEL_NOTES.md, 2026-12-04)
    assert (backends.get_backend("sage8").impl, backends.get_backend("sage8_gluon").impl) == ("triton", "gluon")
    impls = {backends.get_backend(n).impl for n in names if n.startswith("sage8")}
    assert impls == set(IMPLS)
    be = backends.get_backend("sage8")
    # dense_lse exists (tested on the GPU), but only for equal q/k lengths: no ring support
    assert not be.supports_lse and not be.exact
    q = torch.empty(1, 4, 2, 128, dtype=torch.bfloat16)
    if os.environ.get("TRITON_INTERPRET") != "1":  # the Triton loop runs on a CPU under the interpreter
        assert be.unsupported_reason(q) is not None  # CPU: needs a Hopper GPU


@pytest.mark.parametrize("interpret", ["0", "1"])
def test_the_gluon_backend_on_a_cpu_points_to_the_backend_that_runs_there(monkeypatch, interpret):
    """Without TRITON_INTERPRET the Gluon backend said to set it; with it set, to use
    impl='triton', which is not a user-facing argument: a dead end both ways. Both now name
    backend 'sage8' with TRITON_INTERPRET=1."""
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    q = torch.empty(1, 4, 2, 128, dtype=torch.bfloat16)
    reason = backends.get_backend("sage8_gluon").unsupported_reason(q)
    assert reason is not None and "(backend 'sage8_gluon') needs a CUDA GPU" in reason, reason
    assert "use backend 'sage8'" in reason and "TRITON_INTERPRET=1" in reason, reason
    assert "no Gluon" not in reason  # said first, whatever triton this is


def test_off_a_gpu_the_device_is_named_before_dtype_and_head_size(monkeypatch):
    """A diffusers user with a float32 model on a CPU was told to cast q, k and v, then about
    the head size, and only last that sage8 needs a Hopper GPU: the first reason is the device."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q = torch.empty(1, 4, 2, 80, dtype=torch.float32)
    reason = backends.get_backend("sage8").unsupported_reason(q)
    assert reason.startswith("sage8 needs a CUDA GPU of compute capability 9.0 (q is on cpu)"), reason
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the interpreter runs it: then the dtype speaks
    reason = backends.get_backend("sage8").unsupported_reason(q)
    assert reason.startswith("sage8 takes float16 or bfloat16 inputs, got torch.float32"), reason
    assert "load or .to() it in torch.bfloat16" in reason
