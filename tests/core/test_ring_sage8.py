# SPDX-License-Identifier: Apache-2.0
"""An 8-bit kernel inside the ring, on a 2 x 2 (ring x Ulysses) mesh of CPU gloo ranks.

The CuTe loop (``sage8_cute``) needs a Hopper GPU, so here its kernel is the float64 model of the
same scheme (``kernels.sage8.reference``) over the same attended keys, the prefix ``kv_len`` of a
padded piece (the real pre-pass takes K's mean and the K and V scales over all the piece's rows,
zero rows included; the model over the attended ones: the same keys, slightly other rounding).
Everything around it is the library's own: the backend's padding of unequal ring pieces, the
ring's rotation and its log-sum-exp merge. The merged result must stay as close to float64 as
one 8-bit call on the whole sequence (the GPU test of the real kernel:
``test_kernel_sage8_cute.py::test_ring_pieces_merged_by_their_lse_match_float64``).
Ring pieces are of unequal lengths only in ``trailing_padding`` (32 query rows against 19 keys);
``one_segment``'s are 32 and 32.
"""

from __future__ import annotations

import pytest
import torch

from tests._multirank import run_ranks
from tests.reference import reference_attention

S, H, D = 64, 4, 32
# (global valid_len or None): one document, and one padded at the end (the bridge's layout)
LAYOUTS = {"one_segment": None, "trailing_padding": 51}


def _inputs():
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, S, H, D, generator=g) for _ in range(3))
    k += 0.5  # a key mean for the smoothing to remove
    v += torch.rand(H, D, generator=g)  # V channel means
    return q, k, v


def _fake_dense_lse_kv(q, k, v, softmax_scale, impl, kv_len):
    """The kernel's contract on [B, T, H, D]: keys [0, kv_len) attended, (out, lse [B, H, T])."""
    from dist_attn.kernels.sage8.reference import sage8_reference

    outs, lses = [], []
    for b in range(q.shape[0]):
        o, lse = sage8_reference(q[b], k[b, :kv_len], v[b, :kv_len], softmax_scale)
        outs.append(o.to(q.dtype))
        lses.append(lse.float())
    return torch.stack(outs), torch.stack(lses)


def _worker(rank, world):
    from dist_attn import register_backend, ulysses_attention
    from dist_attn.backends import sage8 as sage8_backend
    from dist_attn.mesh import init_usp_mesh

    sage8_backend.ops.dense_lse_kv = _fake_dense_lse_kv
    sage8_backend.ops.dense_lse = lambda q, k, v, scale, impl: _fake_dense_lse_kv(q, k, v, scale, impl, k.shape[1])

    class CpuCute(sage8_backend.Sage8Backend):
        def unsupported_reason(self, q):
            return None

    register_backend(CpuCute("sage8_cute", "cute"), replace=True)
    mesh = init_usp_mesh(2, 2)
    q, k, v = _inputs()
    rows = S // world
    sl = slice(rank * rows, (rank + 1) * rows)  # shard r*U + u is the global rank here
    out = {}
    for name, valid_len in LAYOUTS.items():
        ql, kl, vl = (t[:, sl].clone() for t in (q, k, v))
        res = ulysses_attention(ql, kl, vl, valid_len=valid_len, mesh=mesh, backend="sage8_cute")
        out[name] = (res.numpy(), torch.equal(ql, q[:, sl]) and torch.equal(kl, k[:, sl]))
    return out


@pytest.fixture(scope="module")
def ring_sage8(tmp_path_factory):
    return run_ranks(_worker, 4, tmp_path_factory.mktemp("ring_sage8"), timeout=240)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_ring_with_an_8bit_kernel_matches_float64(ring_sage8, layout):
    from dist_attn.kernels.sage8.reference import sage8_reference

    valid_len = LAYOUTS[layout]
    q, k, v = _inputs()
    used = S if valid_len is None else valid_len
    ref = reference_attention(q, k, v, (0, S), valid_len)
    merged = torch.cat([torch.from_numpy(ring_sage8[r][layout][0]) for r in range(4)], dim=1).double()
    assert all(ring_sage8[r][layout][1] for r in range(4)), "the caller's q/k changed"
    assert torch.isfinite(merged).all()
    # one 8-bit call over the whole (unpadded) sequence: the error the ring must not exceed by 10%
    whole = torch.zeros_like(ref)
    whole[0, :used] = sage8_reference(q[0, :used], k[0, :used], v[0, :used], D ** -0.5)[0]
    err = lambda o: ((o - ref).norm() / ref.norm()).item()
    assert err(whole) > 1e-3, "the 8-bit model must differ from float64, or the test checks nothing"
    assert err(merged) <= 1.1 * err(whole), (layout, err(merged), err(whole))
    if valid_len is not None:
        assert torch.count_nonzero(merged[:, valid_len:]) == 0, "padding rows must be exactly zero"
