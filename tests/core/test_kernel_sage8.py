# SPDX-License-Identifier: Apache-2.0
"""Tests of the Sage8 kernels (dist_attn.kernels.sage8), both attention loops.

Two families:

* GPU tests (need CUDA and compute capability 9.0, skipped with the reason otherwise), each run for
  ``impl="gluon"`` and ``impl="triton"``: accuracy vs float64 on three input families, robustness
  (odd lengths, tiny sequences, zero rows, fp16/bf16, head_dim 64/128), inputs unmodified,
  bit-identical reruns, varlen == per-segment dense, zero tail, no host sync, agreement with the
  torch reference of the scheme, LSE vs float64, varlen with 1, 3 and 17 segments.
* CPU interpreter tests (``test_interp_*``): run the Triton loop under ``TRITON_INTERPRET=1`` in a
  subprocess (the variable must be set before triton decorates the kernels) at tiny shapes and
  compare with float64 and with the torch reference. Skipped when triton is not importable. The
  Gluon kernel has no interpreter path (warp specialization, TMA and wgmma are not emulated).

Tolerances: FP8 e4m3 keeps 3 mantissa bits, so rounding P and V alone gives rel-L2 ~2.7e-2 and
~2.6e-2 on N(0,1) data (torch emulation, see benchmarks/KERNEL_NOTES.md); with INT8 QK the total is
~4e-2, the level of SageAttention-2 (3.9e-2 measured at h3-ref on an H200). On tiny problems the
error is a statistic of few numbers, hence a looser bound there.
"""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from dist_attn.kernels import sage8_dense, sage8_varlen, unsupported_reason
from dist_attn.kernels.sage8 import IMPLS, reference

__all__: list[str] = []

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: the accuracy target (SageAttention 2's level), at a realistic size (8192 rows)
REL_L2_MAX = 4e-2
COS_MIN = 0.999
#: a few channels x20 in q, k and v: INT8 QK loses the small channels next to the outliers. Measured
#: on the H200 (8192 x 4 x 128): sage8 7.1e-2 / 0.9976, sageattention 1.0.6 9.0e-2 / 0.9960, cuDNN
#: 1.1e-3. The 4e-2 target is NOT met for this family; this bound only guards against regressions.
REL_L2_MAX_OUTLIER = 8e-2
COS_MIN_OUTLIER = 0.997
#: tiny shapes: the error is an average over few rows/keys, so it fluctuates more
REL_L2_MAX_SMALL = 6e-2
COS_MIN_SMALL = 0.998


def _gpu_skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "needs a CUDA GPU (the sage8 kernel uses Hopper INT8/FP8 tensor cores)"
    if torch.cuda.get_device_capability() != (9, 0):
        return f"needs compute capability 9.0 (Hopper), this GPU is {torch.cuda.get_device_capability()}"
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    return None


_GPU_REASON = _gpu_skip_reason()
gpu = pytest.mark.skipif(_GPU_REASON is not None, reason=_GPU_REASON or "")


def _ref(q, k, v, scale=None):
    """float64 attention; q/k/v [B, T, H, D] -> [B, T, H, D]."""
    q, k, v = (t.double().transpose(1, 2) for t in (q, k, v))
    s = (q @ k.transpose(-1, -2)) * (scale if scale is not None else 1 / math.sqrt(q.shape[-1]))
    return (torch.softmax(s, dim=-1) @ v).transpose(1, 2)


def _err(out, ref):
    a, b = out.double().flatten(), ref.double().flatten()
    rel = ((a - b).norm() / b.norm()).item()
    cos = torch.nn.functional.cosine_similarity(a, b, dim=0).item()
    return rel, cos


def _inputs(case, shape, dtype, seed=0, device="cuda"):
    g = torch.Generator(device=device).manual_seed(seed)
    q, k, v = (torch.randn(shape, generator=g, device=device) for _ in range(3))
    if case == "bias":  # keys with a per-channel bias: what the K smoothing is for
        k += 0.5
    if case == "outlier":  # a few channels 20x larger, in q, k and v
        for t in (q, k, v):
            t[..., [3, 77 % shape[-1], 100 % shape[-1]]] *= 20
    return tuple(t.to(dtype) for t in (q, k, v))


# ------------------------------------------------------------------------------------------------ GPU


impls = pytest.mark.parametrize("impl", IMPLS)


@pytest.fixture(autouse=True)
def _cute_opt_in(monkeypatch):
    # the experimental CuTe DSL loop runs only when asked for; these tests ask (api.CUTE_OPT_IN)
    monkeypatch.setenv("DIST_ATTN_SAGE8_CUTE", "1")


@gpu
@impls
@pytest.mark.parametrize("case", ["normal", "bias", "outlier"])
def test_accuracy_table(case, impl):
    q, k, v = _inputs(case, (1, 8192, 4, 128), torch.bfloat16, seed=7)
    keep = [t.clone() for t in (q, k, v)]
    out = sage8_dense(q, k, v, impl=impl)
    rel, cos = _err(out, _ref(q, k, v))
    print(f"\n[sage8 accuracy] case={case} rel_l2={rel:.4f} cos={cos:.6f}")
    assert out.isfinite().all()
    if case == "outlier":
        assert rel <= REL_L2_MAX_OUTLIER and cos >= COS_MIN_OUTLIER, (case, rel, cos)
    else:
        assert rel <= REL_L2_MAX and cos >= COS_MIN, (case, rel, cos)
    for t, t0 in zip((q, k, v), keep):
        assert torch.equal(t, t0), "inputs must be unmodified (sageattention 1.0.6 shifts k in place)"


@gpu
@pytest.mark.parametrize("dtype,D", [(torch.bfloat16, 128), (torch.float16, 64), (torch.float16, 128),
                                     (torch.bfloat16, 64)])
@pytest.mark.parametrize("T", [1, 77, 300])
@impls
def test_robust_shapes(dtype, D, T, impl):
    q, k, v = _inputs("bias", (2, T, 3, D), dtype, seed=T + D)
    out = sage8_dense(q, k, v, impl=impl)
    assert out.shape == q.shape and out.dtype == dtype
    assert out.isfinite().all()
    rel, cos = _err(out, _ref(q, k, v))
    assert rel <= REL_L2_MAX_SMALL and cos >= COS_MIN_SMALL, (rel, cos)


@gpu
@impls
def test_zero_rows_and_blocks(impl):
    q, k, v = _inputs("normal", (1, 300, 2, 128), torch.bfloat16, seed=3)
    q[:, 10] = 0            # a zero query row -> uniform attention
    k[:, 128:256] = 0       # a whole zero key block -> block scale would be 0 (0/0 guard)
    v[:, 5:9] = 0
    out = sage8_dense(q, k, v, impl=impl)
    assert out.isfinite().all()
    rel, cos = _err(out, _ref(q, k, v))
    assert rel <= REL_L2_MAX_SMALL and cos >= COS_MIN_SMALL, (rel, cos)
    z = torch.zeros((1, 200, 2, 64), dtype=torch.float16, device="cuda")
    oz = sage8_dense(z, z, z, impl=impl)
    assert oz.isfinite().all() and (oz == 0).all()


@gpu
@impls
def test_bit_identical_reruns(impl):
    q, k, v = _inputs("bias", (1, 3000, 4, 128), torch.bfloat16, seed=11)
    a = sage8_dense(q, k, v, impl=impl)
    b = sage8_dense(q, k, v, impl=impl)
    assert torch.equal(a, b)
    cu = torch.tensor([0, 1000, 1000, 2999, 3000], dtype=torch.int64, device="cuda")
    c = sage8_varlen(q[0], k[0], v[0], cu, 1999, impl=impl)
    d = sage8_varlen(q[0], k[0], v[0], cu, 1999, impl=impl)
    assert torch.equal(c, d)


@gpu
@pytest.mark.parametrize("D,dtype", [(128, torch.bfloat16), (64, torch.float16)])
@impls
def test_varlen_matches_per_segment_dense(D, dtype, impl):
    lens = [0, 77, 300, 1, 0, 129, 128]
    used = sum(lens)
    T = used + 40
    H = 3
    g = torch.Generator(device="cuda").manual_seed(5)
    # the Ulysses receive layout: [S, 3, H, D]; q/k/v are views with strides (3*H*D, D, 1)
    buf = torch.randn((T, 3, H, D), generator=g, device="cuda").to(dtype)
    q, k, v = buf[:, 0], buf[:, 1], buf[:, 2]
    keep = buf.clone()
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    # destination: a strided view too, pre-filled with NaN to prove every row is written
    obuf = torch.full((T, 2, H, D), float("nan"), dtype=dtype, device="cuda")
    out = sage8_varlen(q, k, v, cu, max(lens), used=used, out=obuf[:, 1], impl=impl)
    assert out.data_ptr() == obuf[:, 1].data_ptr()
    assert torch.equal(buf, keep)
    assert (out[used:] == 0).all(), "rows [used, T) must come back exactly zero"
    assert out[:used].isfinite().all()
    for s in range(len(lens)):
        a, b = int(cu[s]), int(cu[s + 1])
        if b == a:
            continue
        dense = sage8_dense(q[a:b][None], k[a:b][None], v[a:b][None], impl=impl)[0]
        # same quantization groups (per segment) and the same arithmetic -> equal up to rounding
        rel_vs_dense, _ = _err(out[a:b], dense.float())
        assert rel_vs_dense <= 1e-3, (s, rel_vs_dense)
        rel, cos = _err(out[a:b], _ref(q[a:b][None], k[a:b][None], v[a:b][None])[0])
        assert rel <= REL_L2_MAX_SMALL and cos >= COS_MIN_SMALL, (s, rel, cos)


@gpu
@impls
def test_single_segment_varlen_equals_dense(impl):
    q, k, v = _inputs("normal", (1, 1000, 2, 128), torch.bfloat16, seed=2)
    cu = torch.tensor([0, 1000], dtype=torch.int32, device="cuda")
    assert torch.equal(sage8_varlen(q[0], k[0], v[0], cu, 1000, impl=impl), sage8_dense(q, k, v, impl=impl)[0])


@gpu
@impls
def test_no_host_sync(impl):
    q, k, v = _inputs("normal", (1, 600, 2, 128), torch.bfloat16, seed=4)
    cu = torch.tensor([0, 250, 590, 600], dtype=torch.int32, device="cuda")
    sage8_varlen(q[0], k[0], v[0], cu, 340, used=590, impl=impl)  # compile outside the checked region
    sage8_dense(q, k, v, impl=impl)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = sage8_varlen(q[0], k[0], v[0], cu, 340, used=590, impl=impl)
        out2 = sage8_dense(q, k, v, impl=impl)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.isfinite().all() and out2.isfinite().all()


@gpu
def test_unsupported_reason_gpu():
    q = torch.empty((1, 4, 96), dtype=torch.bfloat16, device="cuda")
    assert "head_dim" in unsupported_reason(q)
    assert unsupported_reason(q.float()) is not None
    assert unsupported_reason(torch.empty((1, 4, 128), dtype=torch.float16, device="cuda")) is None
    assert unsupported_reason(torch.empty((1, 4, 128), dtype=torch.float16, device="cuda"), impl="gluon") is None


@gpu
@impls
@pytest.mark.parametrize("case", ["normal", "bias"])
def test_matches_torch_reference(case, impl):
    """The kernels compute the scheme of dist_attn.kernels.sage8.reference, rounding for rounding
    (up to fp32 order of operations and exp2.approx: rel-L2 ~3e-3 seen under the interpreter).
    With x20 channel outliers single INT8 rounding flips (the K mean summed in another order)
    move whole scores: 2.7e-2 was seen on the H200 there, so that family is not compared."""
    q, k, v = _inputs(case, (1, 1500, 2, 128), torch.bfloat16, seed=8)
    out, lse = sage8_dense(q, k, v, impl=impl, return_lse=True)
    ref_out, ref_lse = reference.sage8_reference(q[0].cpu(), k[0].cpu(), v[0].cpu())
    assert _err(out[0].cpu(), ref_out)[0] <= 1e-2
    assert (lse[0].cpu().double() - ref_lse).abs().max().item() <= 1e-2


@gpu
@impls
@pytest.mark.parametrize("nseg", [1, 3, 17])
def test_lse_and_varlen_segments(nseg, impl):
    """LSE of every segment vs float64; segments of mixed lengths incl. empty ones and padding."""
    g = torch.Generator().manual_seed(nseg)
    lens = torch.randint(0, 300, (nseg,), generator=g).tolist()
    if nseg > 1:
        lens[1] = 0
    lens[0] = max(lens[0], 1)
    used = sum(lens)
    T = used + 17
    q, k, v = (t[0] for t in _inputs("bias", (1, T, 2, 128), torch.bfloat16, seed=nseg))
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    out, lse = sage8_varlen(q, k, v, cu, max(lens), used=used, return_lse=True, impl=impl)
    assert lse.shape == (2, T) and lse.dtype == torch.float32
    assert (out[used:] == 0).all() and torch.isneginf(lse[:, used:]).all()
    for s in range(nseg):
        a, b = int(cu[s]), int(cu[s + 1])
        if b == a:
            continue
        q64, k64 = q[a:b].double().transpose(0, 1), k[a:b].double().transpose(0, 1)
        ref_lse = torch.logsumexp(q64 @ k64.transpose(1, 2) / math.sqrt(128), dim=-1)
        # INT8 scores: the LSE error is that of the largest scores, ~1e-2 nats on this data
        assert (lse[:, a:b].double() - ref_lse).abs().max().item() <= 5e-2, s
        rel, cos = _err(out[a:b], _ref(q[a:b][None], k[a:b][None], v[a:b][None])[0])
        assert rel <= REL_L2_MAX_SMALL and cos >= COS_MIN_SMALL, (s, rel, cos)


@gpu
@impls
def test_balance_helps_outliers(impl):
    """Per-channel Q/K balancing: measured on CPU with the reference (docs in KERNEL_NOTES.md)."""
    from dist_attn.kernels.sage8.quant import QuantConfig

    g = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (torch.randn((1, 4096, 2, 128), generator=g, device="cuda") for _ in range(3))
    k[..., [3, 77, 100]] *= 20
    q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
    ref = _ref(q, k, v)
    plain = _err(sage8_dense(q, k, v, impl=impl), ref)[0]
    bal = _err(sage8_dense(q, k, v, impl=impl, quant_config=QuantConfig(balance=True)), ref)[0]
    assert bal <= 0.75 * plain, (plain, bal)


# --------------------------------------------------------------------------------------- CPU (interp)


def test_quantize_refuses_an_unknown_v_order():
    pytest.importorskip("triton")
    from dist_attn.kernels.sage8 import launch
    from dist_attn.kernels.sage8.quant import quantize

    q = torch.zeros((1, 128, 2, 64), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"v_order='natural' is not one of \('keys', 'mma'\)"):
        quantize(q, q, q, launch.dense_layout(1, 128), 0.125, kblock=128, v_order="natural")
    assert (launch.v_order("triton"), launch.v_order("gluon")) == ("mma", "keys")


@pytest.mark.parametrize("over, needle", [({"pv_first": True, "pingpong": True}, "pingpong=True"),
                                          ({"pv_accum": "fp32"}, "pv_accum='fp32'")])
def test_gluon_config_refuses_what_cannot_run(over, needle):
    """A launch config that would deadlock (P V first has no turn hand-over) or names no
    accumulation scheme is refused when it is made, not at the first launch."""
    pytest.importorskip("triton")
    from dist_attn.kernels.sage8.attn_gluon import GluonConfig

    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace("=", "=")):
        GluonConfig(**over)


@pytest.mark.parametrize("over, needle", [({"pv_accum": "fp32"}, "pv_accum='fp32'"),
                                          ({"kscale_load": "lazy"}, "kscale_load='lazy'")])
def test_triton_config_refuses_unknown_options(over, needle):
    pytest.importorskip("triton")
    from dist_attn.kernels.sage8.attn_triton import TritonConfig

    with pytest.raises(ValueError, match=needle):
        TritonConfig(**over)
    assert TritonConfig().kscale_load == "direct"


@pytest.mark.parametrize("field", ["tile", "stats_tile", "warps"])
def test_quant_config_refuses_a_tile_that_is_not_a_power_of_two(field):
    pytest.importorskip("triton")
    from dist_attn.kernels.sage8.quant import QuantConfig

    with pytest.raises(ValueError, match=f"QuantConfig.{field}=24 must be a power of two"):
        QuantConfig(**{field: 24})


def test_unsupported_reason_cpu():
    q = torch.empty((2, 3, 128), dtype=torch.bfloat16)
    if os.environ.get("TRITON_INTERPRET") != "1":
        reason = unsupported_reason(q)
        assert reason is not None and ("CUDA" in reason or "triton" in reason)


_INTERP_SCRIPT = textwrap.dedent(
    """
    import math, torch
    from dist_attn.kernels import sage8_dense, sage8_varlen, unsupported_reason

    def ref(q, k, v):
        q, k, v = (t.double().transpose(1, 2) for t in (q, k, v))
        s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        return (torch.softmax(s, -1) @ v).transpose(1, 2)

    def err(a, b):
        a, b = a.double().flatten(), b.double().flatten()
        return ((a - b).norm() / b.norm()).item(), torch.nn.functional.cosine_similarity(a, b, dim=0).item()

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 200, 2, 64) for _ in range(3))
    k += 0.5
    q, k, v = (t.to(torch.float16) for t in (q, k, v))
    assert unsupported_reason(q) is None
    k0 = k.clone()
    o = sage8_dense(q, k, v)
    assert torch.equal(k, k0) and o.isfinite().all()
    print("dense", *err(o, ref(q, k, v)))
    assert torch.equal(o, sage8_dense(q, k, v))

    lens = [0, 37, 130, 1]
    T = sum(lens) + 11
    buf = torch.randn(T, 3, 2, 128).to(torch.bfloat16)
    q, k, v = buf[:, 0], buf[:, 1], buf[:, 2]
    q[5] = 0
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    used = sum(lens)
    out = torch.full((T, 2, 128), float("nan"), dtype=torch.bfloat16)
    sage8_varlen(q, k, v, cu, max(lens), used=used, out=out)
    assert (out[used:] == 0).all() and out[:used].isfinite().all()
    for s in range(len(lens)):
        a, b = int(cu[s]), int(cu[s + 1])
        if b > a:
            print("seg", s, *err(out[a:b], ref(q[a:b][None], k[a:b][None], v[a:b][None])[0]))
    z = torch.zeros(1, 40, 1, 64, dtype=torch.bfloat16)
    assert (sage8_dense(z, z, z) == 0).all()

    # the pre-pass stores V in "mma" key order exactly as numerics.mma_key_order says
    from dist_attn.kernels.sage8 import launch, numerics
    from dist_attn.kernels.sage8.quant import quantize
    lay = launch.dense_layout(1, 200)
    x = torch.randn(1, 200, 2, 128).to(torch.bfloat16)
    plain, mma = (quantize(x, x, x, lay, 0.1, kblock=128, interpret=True, v_order=o).vt8[..., :256].float()
                  for o in ("keys", "mma"))  # the two written key blocks (the buffer's spare PAD is not)
    assert torch.equal(mma, plain[..., numerics.mma_key_order(256)]) and not torch.equal(mma, plain)

    # the torch reference of the scheme, LSE included, and balancing on a key-outlier input
    from dist_attn.kernels.sage8 import reference
    from dist_attn.kernels.sage8.quant import QuantConfig
    q, k, v = (torch.randn(1, 150, 2, 64) for _ in range(3))
    k[..., 5] *= 20
    q, k, v = (t.to(torch.float16) for t in (q, k, v))
    for bal in (False, True):
        o, lse = sage8_dense(q, k, v, return_lse=True, quant_config=QuantConfig(balance=bal))
        ro, rl = reference.sage8_reference(q[0], k[0], v[0], balance=bal)
        print("refdiff", err(o[0], ro)[0], (lse[0].double() - rl).abs().max().item())
        print("balance" if bal else "plain", *err(o, ref(q, k, v)))
    print("OK")
    """
)


def test_interp_kernels_match_float64():
    """The Triton kernels themselves, on CPU, under Triton's interpreter (tiny shapes, < 60 s)."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not importable: the interpreter tests need it (pip install triton)")
    import triton

    if tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 9):
        # Seen on the H200 image (triton 3.6): its interpreter raises "only 0-dimensional arrays
        # can be converted to Python scalars" in the prep kernel; CI pins triton 3.9.
        pytest.skip(f"the interpreter run needs triton >= 3.9, found {triton.__version__}")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
               CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", _INTERP_SCRIPT], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[-1] == "OK", proc.stdout
    for line in lines:
        if line.startswith(("dense", "seg")):
            rel, cos = map(float, line.split()[-2:])
            assert rel <= REL_L2_MAX_SMALL and cos >= COS_MIN_SMALL, line
        if line.startswith("refdiff"):
            rel, lse_diff = map(float, line.split()[1:])
            assert rel <= 1e-2 and lse_diff <= 1e-2, line
    plain = float(next(x for x in lines if x.startswith("plain")).split()[1])
    balanced = float(next(x for x in lines if x.startswith("balance")).split()[1])
    assert balanced <= 0.75 * plain, (plain, balanced)


def test_one_seg_bounds_rule_for_both_kernel_languages():
    """Gluon's segment bounds are Triton's, transliterated (tl -> gl, the dense lo a tensor), and
    every kernel of both languages takes its bounds from one of the two."""
    pytest.importorskip("triton")
    import ast
    import inspect

    from dist_attn.kernels.sage8 import attn_gluon, attn_triton, quant

    def body(fn) -> str:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn.fn)))
        node = tree.body[0]
        node.body = node.body[1:]  # the docstring
        node.decorator_list, node.name = [], "seg_bounds"
        return ast.dump(node)

    derived = body(quant.seg_bounds).replace("Name(id='tl'", "Name(id='gl'").replace(
        "targets=[Name(id='lo', ctx=Store())], value=Constant(value=0)",
        "targets=[Name(id='lo', ctx=Store())], value=Call(func=Attribute(value=Name(id='gl', "
        "ctx=Load()), attr='to_tensor', ctx=Load()), args=[Constant(value=0)], keywords=[])")
    assert body(attn_gluon._seg_bounds) == derived
    for module, name in ((quant, "seg_bounds"), (attn_triton, "seg_bounds"), (attn_gluon, "_seg_bounds")):
        source = inspect.getsource(module)
        assert source.count(f"= {name}(cu, seg, used, T, DENSE)") >= 1, module.__name__
        assert "tl.load(cu + seg)" not in source.replace(inspect.getsource(quant.seg_bounds.fn), "")
    assert attn_triton.seg_bounds is quant.seg_bounds
