# SPDX-License-Identifier: Apache-2.0
"""Arguments that are wrong before any tensor exists fail where they are given: in the
constructor, or at the call with an empty head axis (it divided by zero in the softmax scale)."""

from __future__ import annotations

import pytest
import torch

from dist_attn import UlyssesSageAttention, sage_varlen, ulysses_attention


@pytest.mark.parametrize("shape", [(8, 2, 0), (8, 0, 4), (1, 8, 2, 0)],
                         ids=["head_dim0", "heads0", "batched_head_dim0"])
def test_an_empty_head_axis_is_a_value_error_naming_it(shape):
    q = torch.randn(shape)
    axis = len(shape) - 1 if shape[-1] == 0 else len(shape) - 2
    with pytest.raises(ValueError, match=rf"q.shape\[{axis}\]=0 .*must be at least 1"):
        ulysses_attention(q, q, q, backend="sdpa")
    with pytest.raises(ValueError, match=rf"q.shape\[{axis}\]=0 .*must be at least 1"):
        sage_varlen(q, q, q, [0, 8], 8, backend="sdpa")


def test_default_softmax_scale_names_a_bad_head_dim():
    from dist_attn.backends import default_softmax_scale

    with pytest.raises(ValueError, match=r"head_dim=0 must be a positive int"):
        default_softmax_scale(0)
    assert default_softmax_scale(64) == 0.125


def test_unknown_backend_is_refused_by_the_constructor():
    with pytest.raises(ValueError, match=r"backend='nope' is not one of \('auto', 'sdpa'"):
        UlyssesSageAttention(2, 4, backend="nope")
    with pytest.raises(ValueError, match=r"backend=3 is not one of"):
        UlyssesSageAttention(2, 4, backend=3)


@pytest.mark.parametrize("kw,needle", [({"group": "x"}, r"group='x' must be a torch.distributed."
                                                        r"ProcessGroup or None"),
                                       ({"mesh": "x"}, r"mesh='x' must be a torch.distributed."
                                                       r"device_mesh.DeviceMesh")])
def test_a_group_or_mesh_that_is_not_one_is_refused_by_the_constructor(kw, needle):
    with pytest.raises(TypeError, match=needle):
        UlyssesSageAttention(2, 4, backend="sdpa", **kw)


def test_the_module_checks_its_scalars_once_and_forward_trusts_them(monkeypatch):
    """softmax_scale and overlap_chunks are validated at the constructor (the public boundary);
    forward hands the checked values to the core instead of checking them on every call, and
    they cannot be changed afterwards, around the check."""
    import dist_attn.ulysses as ulysses

    with pytest.raises(ValueError, match=r"overlap_chunks=0 must be an int >= 1"):
        UlyssesSageAttention(2, 8, backend="sdpa", overlap_chunks=0)
    attn = UlyssesSageAttention(2, 8, backend="sdpa", softmax_scale=0.5, overlap_chunks=2)
    calls = []
    monkeypatch.setattr(ulysses, "check_scalars", lambda *a: calls.append(a))
    q = torch.randn(6, 2, 8)
    out = attn(q, q, q)
    assert calls == [] and out.shape == q.shape
    torch.testing.assert_close(out, ulysses_attention(q, q, q, backend="sdpa", softmax_scale=0.5))
    assert calls == [(0.5, 1)]  # the plain function is its own boundary
    with pytest.raises(AttributeError):
        attn.overlap_chunks = 0
    assert (attn.softmax_scale, attn.overlap_chunks) == (0.5, 2)
