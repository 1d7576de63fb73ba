# SPDX-License-Identifier: Apache-2.0
"""The multi-host model of benchmarks/scaling.py --modeled --multi-host: its arithmetic agrees with
hand-computed figures, and the script writes its JSON / markdown / PNG (in-process, no device)."""

from __future__ import annotations

import json

import pytest

from benchmarks.multihost_model import LayoutSpec, Params, model_layer

SEQ, USED, H, D = 38016, 37980, 56, 128
P = Params()


def _row(u, r, chunks=1, ring_overlap=True, gpus_per_host=8):
    return model_layer(LayoutSpec("x", u, r, gpus_per_host), seq=SEQ, used=USED, heads=H, head_dim=D,
                       chunks=chunks, ring_overlap=ring_overlap, params=P)


def test_one_gpu_is_the_kernel_alone():
    row = _row(1, 1)
    flops = 4 * USED * USED * H * D
    assert row["total_ms"] == pytest.approx(flops / (P.kernel_tflops * 1e9))
    assert row["a2a_in"] == row["pack"] == row["ring_xfer"] == 0


def test_pure_ulysses_across_hosts_pays_internode_for_its_largest_head_share():
    row = _row(16, 1)
    assert row["heads"] == 4  # 56 = 8 x 4 + 8 x 3: uneven heads, the slowest rank holds 4
    s_local = SEQ // 16
    # the 4-head rank receives 3 x S_local x 4 heads from each of the 8 peers on the other host
    inter = 8 * 3 * s_local * 4 * D * 2
    assert row["a2a_in"] == pytest.approx(inter / (P.internode_gbs * 1e6))


def test_ring_transfer_hides_under_the_kernel_step():
    with_overlap, without = _row(8, 2), _row(8, 2, ring_overlap=False)
    x = 2 * (SEQ // 2) * 7 * D * 2 / (P.internode_gbs * 1e6)  # K and V of one chunk, 7 heads
    assert with_overlap["ring_xfer"] == pytest.approx(x)
    assert without["total_ms"] - with_overlap["total_ms"] == pytest.approx(x)  # fully hidden
    assert with_overlap["heads"] == 7 and with_overlap["s_local"] == SEQ // 16


def test_script_writes_the_report(tmp_path):
    from benchmarks import scaling

    paths = scaling.main(["--modeled", "--multi-host", "--out", str(tmp_path)])
    data = json.loads(open(paths["json"]).read())
    names = {r["name"] for r in data["rows"]}
    assert names == {"1 GPU", "1 host: U8", "2 hosts: U16", "2 hosts: U8 x R2"}
    assert data["config"]["params"]["internode_gbs"] == 50.0
    assert any("PLANNING figures" in n for n in data["notes"])
    md = open(paths["md"]).read()
    assert "MODELED" in md and "| 2 hosts: U8 x R2 |" in md
    assert open(paths["png"], "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_chunked_ulysses_sends_the_first_chunk_while_the_rest_is_packed():
    """Two 7-head chunks at Ulysses 4 (one host): the first chunk is packed alone and its input
    all-to-all leaves at half the pack; the kernels queue behind the whole pack; the unpacks queue
    behind the last kernel, chunk 0's while chunk 1's output travels. Hand timeline, pack made slow."""
    slow = Params(copy_gbs=20.0)
    row = model_layer(LayoutSpec("x", 4, 1, 8), seq=SEQ, used=USED, heads=H, head_dim=D, chunks=2,
                      ring_overlap=True, params=slow)
    assert row["effective_chunks"] == 2 and row["heads"] == 14
    pack, a_in, k, a_out, unpack = (row[x] for x in ("pack", "a2a_in", "kernel", "a2a_out", "unpack"))
    in0 = pack / 2 + a_in / 2
    in1 = max(in0, pack) + a_in / 2
    k0 = max(pack, in0) + k / 2
    k1 = max(k0, in1) + k / 2
    out0 = max(in1, k0) + a_out / 2
    out1 = max(out0, k1) + a_out / 2
    u0 = max(k1, out0) + unpack / 2
    assert row["total_ms"] == pytest.approx(max(u0, out1) + unpack / 2)
    assert in0 < pack  # the case the pack calls change: chunk 0's input left before the pack ended
