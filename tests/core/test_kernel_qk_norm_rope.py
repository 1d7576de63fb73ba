# SPDX-License-Identifier: Apache-2.0
"""The fused q/k RMSNorm + RoPE kernel (dist_attn.kernels.qk_norm_rope) on CPU, and on the GPU
where there is one.

The Triton kernel runs under ``TRITON_INTERPRET=1`` in a subprocess (the variable must be set
before triton decorates the kernel) and must equal its float32 torch reference (to one bf16 step
in under 0.1% of the elements, where float32 sums in another order land on the other side of a
tie), and sit as near float64 as a single bf16 rounding allows, over shapes that hit its edges:
batches, rows and heads that do not fill a program, R < D and R = D, zero (padding) table rows.
Without the interpreter the op computes the reference itself. The GPU test runs H3's shape.
"""

from __future__ import annotations

import textwrap

import pytest
import torch

from tests.core._interp import run_interpreted

__all__: list[str] = []


_SCRIPT = textwrap.dedent(
    """
    import torch
    from dist_attn.kernels.qk_norm_rope import qk_norm_rope, qk_norm_rope_reference

    g = torch.Generator().manual_seed(0)
    for B, S, H, D, R in ((1, 37, 11, 128, 96), (2, 20, 3, 64, 64), (1, 5, 8, 32, 2)):
        q, k = (torch.randn(B, S, H, D, generator=g).mul(3).add(0.4).bfloat16() for _ in range(2))
        q[0, 1, 2] = 0.0  # an all-zero row: rsqrt(eps), finite
        wq, wk = (torch.rand(D, generator=g).add(0.5).bfloat16() for _ in range(2))
        ang = torch.rand(S, R // 2, generator=g) * 6
        cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
        cos[-2:], sin[-2:] = 0.0, 0.0  # padding rows: zero tables
        before = (q.clone(), k.clone())
        got = qk_norm_rope(q, k, wq, wk, 1e-5, cos, sin)
        assert torch.equal(q, before[0]) and torch.equal(k, before[1]), "q or k was modified"
        want = qk_norm_rope_reference(q, k, wq, wk, 1e-5, cos, sin)
        exact = qk_norm_rope_reference(q, k, wq, wk, 1e-5, cos, sin, dtype=torch.float64)
        for name, a, b, c in zip("qk", got, want, exact):
            assert a.shape == q.shape and a.dtype == q.dtype and a.is_contiguous()
            assert torch.isfinite(a.float()).all()
            diff = (a.float() - b.float()).abs().max().item()
            # one bf16 ulp where fp32 sums in another order land on the other side of a tie
            assert diff <= b.float().abs().max().item() * 2 ** -8, (name, B, S, H, D, R, diff)
            off = (a.view(torch.int16) != b.view(torch.int16)).float().mean().item()
            assert off < 1e-3, (name, B, S, H, D, R, off)
            rel = ((a.double() - c).norm() / c.norm()).item()
            assert rel < 2.2e-3, (name, rel)  # one bf16 rounding: ~1.6e-3 on these values
            assert (a[:, -2:, :, R:].float() != 0).any() or R == D
            print(name, B, S, H, D, R, f"{off:.2e} codes off, rel-L2 vs float64 {rel:.2e}")
    print("OK")
    """
)


def _interpreted(*argv: str, runtime_loop: bool = True) -> None:
    """Runs ``python -W ignore *argv`` under Triton's interpreter (no GPU); it must print OK last.
    ``runtime_loop``: the script runs the pack, whose loop bound is a runtime value (triton 3.6's
    interpreter cannot loop over one)."""
    run_interpreted(*argv, min_triton=(3, 9) if runtime_loop else (0, 0),
                    why="the pack's interpreter runs" if runtime_loop else "")


def test_interp_qk_norm_rope_equals_its_reference():
    _interpreted("-c", _SCRIPT, runtime_loop=False)


def _inputs(device, B=1, S=9, H=3, D=64, R=48, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, S, H, D, generator=g).to(device, dtype) for _ in range(2))
    wq, wk = (torch.rand(D, generator=g).add(0.5).to(device, dtype) for _ in range(2))
    ang = torch.rand(S, R // 2, generator=g) * 6
    return q, k, wq, wk, torch.cat([ang.cos()] * 2, -1).to(device), torch.cat([ang.sin()] * 2, -1).to(device)


def test_cpu_without_the_interpreter_computes_the_reference(monkeypatch):
    pytest.importorskip("triton", reason="the kernel module imports triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    from dist_attn.kernels.qk_norm_rope import qk_norm_rope, qk_norm_rope_reference

    q, k, wq, wk, cos, sin = _inputs("cpu")
    for a, b in zip(qk_norm_rope(q, k, wq, wk, 1e-6, cos, sin), qk_norm_rope_reference(q, k, wq, wk, 1e-6, cos, sin)):
        assert torch.equal(a, b)


def test_reference_is_diffusers_norm_then_rope():
    """The reference in float64 is nn.RMSNorm followed by H3's rotate-half RoPE, computed in
    float64 too: the definition the kernel is held to."""
    pytest.importorskip("triton", reason="the kernel module imports triton")
    pytest.importorskip("diffusers", reason="H3's processor lives in the diffusers adapter")
    from dist_attn.integrations.diffusers._minimax_h3 import _rotate
    from dist_attn.kernels.qk_norm_rope import qk_norm_rope_reference

    q, k, wq, wk, cos, sin = _inputs("cpu", dtype=torch.float64)
    norm = torch.nn.RMSNorm(q.shape[-1], eps=1e-5, dtype=torch.float64)
    got = qk_norm_rope_reference(q, k, wq, wk, 1e-5, cos, sin, dtype=torch.float64)
    for x, w, y in ((q, wq, got[0]), (k, wk, got[1])):
        with torch.no_grad():
            norm.weight.copy_(w)
            want = _rotate(norm(x), cos.double(), sin.double())
        torch.testing.assert_close(y, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("change, match", [
    (lambda a: a.update(k=a["k"][..., :32]), "one shape"),
    (lambda a: a.update(q_weight=a["q_weight"][:5]), "q_weight must be a \\[64\\]"),
    (lambda a: a.update(eps=0.0), "eps=0.0 must be a positive float"),
    (lambda a: a.update(cos=a["cos"].double()), "cos must be a float32"),
    (lambda a: a.update(cos=a["cos"][:4], sin=a["sin"][:4]), "S=9 rows"),
    (lambda a: a.update(cos=a["cos"][:, :5], sin=a["sin"][:, :5]), "even R"),
])
def test_qk_norm_rope_rejects_bad_arguments(change, match):
    pytest.importorskip("triton", reason="the kernel module imports triton")
    from dist_attn.kernels.qk_norm_rope import qk_norm_rope

    q, k, wq, wk, cos, sin = _inputs("cpu")
    args = dict(q=q, k=k, q_weight=wq, k_weight=wk, eps=1e-5, cos=cos, sin=sin)
    change(args)
    with pytest.raises(ValueError, match=match):
        qk_norm_rope(**args)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the Triton kernel on hardware)")
def test_gpu_qk_norm_rope_at_h3_shape():
    """H3's shape (56 heads x 128, RoPE on 96), 2,048 rows: within one bf16 rounding of the float32
    reference (the GPU's rsqrt is approximate), as near float64 as that, and compiled (fullgraph)
    equal to eager."""
    from dist_attn.kernels.qk_norm_rope import qk_norm_rope, qk_norm_rope_reference

    q, k, wq, wk, cos, sin = _inputs("cuda", S=2048, H=56, D=128, R=96, seed=1)
    got = qk_norm_rope(q, k, wq, wk, 1e-5, cos, sin)
    want = qk_norm_rope_reference(q, k, wq, wk, 1e-5, cos, sin)
    exact = qk_norm_rope_reference(q, k, wq, wk, 1e-5, cos, sin, dtype=torch.float64)
    for a, b, c in zip(got, want, exact):
        assert (a.float() - b.float()).abs().max().item() <= b.float().abs().max().item() * 2 ** -7
        assert (a.view(torch.int16) != b.view(torch.int16)).float().mean().item() < 0.02
        assert ((a.double() - c).norm() / c.norm()).item() < 2.2e-3
    fn = torch.compile(lambda *x: qk_norm_rope(*x), fullgraph=True)
    for a, b in zip(fn(q, k, wq, wk, 1e-5, cos, sin), got):
        assert torch.equal(a, b)


_PACK_SCRIPT = textwrap.dedent(
    """
    import torch
    from dist_attn import QKNormRope
    from dist_attn.comm import pack_qkv_chunks
    from dist_attn.kernels.qk_norm_rope import pack_qkv_prologue, qk_norm_rope
    from dist_attn.plan import make_plan

    g = torch.Generator().manual_seed(0)
    S, H, D, R, W = 13, 8, 32, 16, 4
    q, k, v = (torch.randn(1, S, H, D, generator=g).bfloat16() for _ in range(3))
    ang = torch.rand(S, R // 2, generator=g) * 6
    p = QKNormRope(torch.rand(D, generator=g).add(0.5).bfloat16(), torch.rand(D, generator=g).add(0.5).bfloat16(),
                   1e-5, torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1))
    qq, kk = qk_norm_rope(q, k, p.q_weight, p.k_weight, p.eps, p.cos, p.sin)
    for C in (1, 2):
        plan = make_plan(world=W, rank=1, s_local=S, folded_heads=H, head_dim=D, overlap_chunks=C)
        for a, b in plan.pack_runs:
            run = plan.chunks[a:b]
            n = run[-1].in_send[1] - run[0].in_send[0]
            ranges = [c.head_ranges for c in run]
            fused, plain = torch.full((n,), 7.0).bfloat16(), torch.full((n,), 7.0).bfloat16()
            assert pack_qkv_prologue(q, k, v, fused, ranges, p)
            pack_qkv_chunks(qq, kk, v, plain, ranges)
            assert torch.equal(fused, plain), (C, a, b)
    # two samples: not one strided run, so the caller is told to apply the prologue first
    q2 = torch.cat([q, q])
    assert not pack_qkv_prologue(q2, q2, q2, torch.empty(2 * S * 3 * H * D).bfloat16(),
                                 [make_plan(world=W, rank=0, s_local=S, folded_heads=2 * H, head_dim=D,
                                            overlap_chunks=1).chunks[0].head_ranges], p)
    print("OK")
    """
)


def test_interp_the_pack_applies_the_prologue_as_the_kernel_does():
    """The Ulysses pack with the prologue folded in writes the send blocks that the one-pass
    kernel followed by the plain pack writes, bit for bit (one chunk and two, each run)."""
    _interpreted("-c", _PACK_SCRIPT)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the Triton kernel on hardware)")
def test_gpu_the_pack_applies_the_prologue_as_the_kernel_does():
    """H3's W = 4 rank 0 (56 heads, 2,048 rows), the core's pack calls at C = 4: the fused pack
    against the one-pass kernel then the plain pack, within one bf16 step in rare elements."""
    from dist_attn import QKNormRope
    from dist_attn.comm import pack_qkv_chunks
    from dist_attn.kernels.qk_norm_rope import pack_qkv_prologue, qk_norm_rope
    from dist_attn.plan import make_plan

    q, k, wq, wk, cos, sin = _inputs("cuda", S=2048, H=56, D=128, R=96, seed=2)
    v = torch.randn_like(q)
    p = QKNormRope(wq, wk, 1e-5, cos, sin)
    qq, kk = qk_norm_rope(q, k, wq, wk, 1e-5, cos, sin)
    plan = make_plan(world=4, rank=0, s_local=2048, folded_heads=56, head_dim=128, overlap_chunks=4)
    for a, b in plan.pack_runs:
        run = plan.chunks[a:b]
        n = run[-1].in_send[1] - run[0].in_send[0]
        ranges = [c.head_ranges for c in run]
        fused, plain = (torch.empty(n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        assert pack_qkv_prologue(q, k, v, fused, ranges, p)
        pack_qkv_chunks(qq, kk, v, plain, ranges)
        assert (fused.view(torch.int16) != plain.view(torch.int16)).float().mean().item() < 1e-3
        assert (fused.float() - plain.float()).abs().max().item() <= plain.float().abs().max().item() * 2 ** -7


_ULYSSES_SCRIPT = textwrap.dedent(
    """
    import os, sys, tempfile
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp

    def _inputs(B, S, H, D, R, seed):
        g = torch.Generator().manual_seed(seed)
        q, k, v = (torch.randn(B, S, H, D, generator=g).bfloat16() for _ in range(3))
        wq, wk = (torch.rand(D, generator=g).add(0.5).bfloat16() for _ in range(2))
        ang = torch.rand(S, R // 2, generator=g) * 6
        return q, k, v, wq, wk, torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)

    def worker(rank, world, init, out):
        dist.init_process_group("gloo", init_method="file://" + init, rank=rank, world_size=world)
        import dist_attn.kernels.qk_norm_rope as kernels
        from dist_attn import QKNormRope, ulysses_attention

        packs = []
        fused = kernels.pack_qkv_prologue
        kernels.pack_qkv_prologue = lambda *a: packs.append(a[0].shape[0]) or fused(*a)
        S, H, D, R = 24, 4, 32, 16
        res = {}
        for B in (1, 2):
            q, k, v, wq, wk, cos, sin = _inputs(B, S, H, D, R, B)
            rows = slice(rank * S // world, (rank + 1) * S // world)
            p = QKNormRope(wq, wk, 1e-5, cos[rows].contiguous(), sin[rows].contiguous())
            qq, kk = kernels.qk_norm_rope(q, k, wq, wk, 1e-5, cos, sin)
            for C in (1, 2):
                got = ulysses_attention(q[:, rows], k[:, rows], v[:, rows], backend="sdpa", valid_len=S - 3,
                                        overlap_chunks=C, qk_prologue=p)
                want = ulysses_attention(qq[:, rows], kk[:, rows], v[:, rows], backend="sdpa",
                                         valid_len=S - 3, overlap_chunks=C)
                res[f"{B},{C}"] = float((got.float() - want.float()).abs().max())
        errors = []
        for bad in (QKNormRope(wq, wk, 0.0, p.cos, p.sin), QKNormRope(wq[:8], wk, 1e-5, p.cos, p.sin),
                    QKNormRope(wq, wk, 1e-5, cos, sin), QKNormRope(wq, wk, 1e-5, p.cos.double(), p.sin), "norm"):
            try:
                ulysses_attention(q[:, rows], k[:, rows], v[:, rows], backend="sdpa", qk_prologue=bad)
                errors.append(None)
            except ValueError as exc:
                errors.append(str(exc))
        torch.save((res, errors, packs), f"{out}.{rank}")
        dist.barrier()
        os._exit(0)  # gloo's teardown under the interpreter's threads may abort a clean exit

    if __name__ == "__main__":
        d = tempfile.mkdtemp()
        mp.spawn(worker, args=(2, os.path.join(d, "init"), os.path.join(d, "out")), nprocs=2)
        for r in range(2):
            res, errors, packs = torch.load(os.path.join(d, f"out.{r}"))
            assert all(x == 0.0 for x in res.values()), res
            # batch 1 went through the fused pack: one call at C = 1, two at C = 2 (the first
            # chunk alone, then the rest); batch 2 (not one strided run) through the kernel first
            assert packs == [1, 1, 1], packs
            assert errors[0] and "eps=0.0 must be a positive float" in errors[0], errors
            assert errors[1] and "q_weight" in errors[1] and "[32]" in errors[1], errors
            assert errors[2] and "S_local=12" in errors[2], errors  # the whole sequence's tables
            assert errors[3] and "float32" in errors[3], errors
            assert errors[4] and "must be a dist_attn.QKNormRope" in errors[4], errors
        print("OK")
    """
)


def test_ulysses_attention_applies_the_prologue_on_each_ranks_rows(tmp_path):
    """On 2 gloo ranks under Triton's interpreter: q/k through ``qk_prologue`` inside
    ulysses_attention (batch 1: the pack applies it; batch 2: the one-pass kernel first) equal the
    same rows transformed first, bit for bit, at C = 1 and 2; the errors are raised on every rank
    before any collective."""
    script = tmp_path / "ulysses_prologue.py"
    script.write_text(_ULYSSES_SCRIPT)
    _interpreted(str(script))
