# SPDX-License-Identifier: Apache-2.0
"""The quality decision is a pure function of gathered device facts: tested with fakes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dist_attn.models.h3.serve.config.quality import (DeviceFacts, Topology, check_tier_name,
                                                      gather_device_facts, is_8bit_backend,
                                                      local_device_facts, quality_failures)

H200_MEM = 150_000_000_000
TOPO4 = Topology(world_size=4, ulysses_degree=4)


def _gpu(rank: int, *, name: str = "NVIDIA H200", cap=(9, 0), host: str = "node0",
         index: int | None = None, peers: dict[int, bool] | None = None, mem: int = H200_MEM,
         n: int = 4) -> DeviceFacts:
    index = rank if index is None else index
    return DeviceFacts(rank=rank, hostname=host, device_type="cuda", device_index=index,
                       device_uuid=f"GPU-{host}-{index}", gpu_name=name, capability=cap,
                       total_memory=mem,
                       peer_access=peers if peers is not None else
                       {j: True for j in range(n) if j != index})


def _h200x4() -> list[DeviceFacts]:
    return [_gpu(r) for r in range(4)]


def test_4x_h200_passes_high():
    assert quality_failures("high", _h200x4(), TOPO4, backend="sage") == []


def test_absent_tier_admits_anything():
    cpu = [DeviceFacts(rank=r, hostname="h", device_type="cpu") for r in range(3)]
    assert quality_failures(None, cpu, Topology(world_size=3, ulysses_degree=3),
                            backend="sage") == []


def _only(failures: list[str], prefix: str) -> str:
    assert len(failures) == 1, failures
    assert failures[0].startswith(prefix), failures
    return failures[0]


def test_h100_fails_on_gpu_model_and_capability():
    facts = [_gpu(r, name="NVIDIA H100 80GB HBM3", mem=85_000_000_000) for r in range(4)]
    failures = quality_failures("high", facts, TOPO4)
    assert len(failures) == 1
    assert "GPU model: every GPU name must contain H200" in failures[0]
    assert "rank 0: NVIDIA H100 80GB HBM3" in failures[0]


def test_three_gpus_fail_on_world_size_and_ulysses_degree():
    facts = [_gpu(r, n=3) for r in range(3)]
    failures = quality_failures("high", facts, Topology(world_size=3, ulysses_degree=3))
    assert failures == ["world size: exactly 4 ranks required, observed 3",
                        "Ulysses degree: must be 4, observed 3"]


def test_mixed_gpus_fail_as_not_identical():
    facts = _h200x4()
    facts[2] = _gpu(2, name="NVIDIA H100 80GB HBM3", mem=85_000_000_000)
    failures = quality_failures("high", facts, TOPO4)
    assert any(f.startswith("GPU model:") and "rank 2: NVIDIA H100" in f for f in failures)
    identical = [f for f in failures if f.startswith("identical GPUs:")]
    assert len(identical) == 1 and "H100" in identical[0] and "H200" in identical[0]


def test_two_h200_variants_fail_as_not_identical():
    facts = _h200x4()
    facts[3] = _gpu(3, name="NVIDIA H200 NVL", mem=143_000_000_000)
    _only(quality_failures("high", facts, TOPO4), "identical GPUs:")


def test_compute_capability_8_9_fails():
    facts = [_gpu(r, cap=(8, 9)) for r in range(4)]
    msg = _only(quality_failures("high", facts, TOPO4), "compute capability:")
    assert "must be 9.0" in msg and "rank 0: 8.9" in msg


def test_missing_p2p_fails_naming_the_pair():
    facts = _h200x4()
    facts[1] = _gpu(1, peers={0: True, 2: True, 3: False})
    msg = _only(quality_failures("high", facts, TOPO4), "P2P:")
    assert "1<->3" in msg and "0<->1" not in msg


def test_shared_gpu_and_two_hosts_fail():
    facts = [_gpu(r, index=0) for r in range(4)]  # four ranks on GPU 0
    msg = _only(quality_failures("high", facts, TOPO4), "own GPU:")
    assert "rank 3: GPU-node0-0" in msg
    facts = [_gpu(r, host=f"node{r // 2}", index=r % 2, n=2) for r in range(4)]
    failures = quality_failures("high", facts, TOPO4)
    assert [f.split(":")[0] for f in failures] == ["one host"]


def test_ring_and_tensor_parallel_must_be_1():
    failures = quality_failures("high", _h200x4(), Topology(world_size=4, ulysses_degree=2,
                                                             ring_degree=2))
    assert failures == ["Ulysses degree: must be 4, observed 2",
                        "ring degree: must be 1, observed 2"]
    failures = quality_failures("high", _h200x4(), Topology(world_size=4, ulysses_degree=1,
                                                             tensor_parallel=4))
    assert failures[-1] == "tensor parallel: must be 1, observed 4"


def test_cpu_ranks_fail_high_with_every_reason():
    cpu = [DeviceFacts(rank=r, hostname="h", device_type="cpu") for r in range(4)]
    failures = quality_failures("high", cpu, TOPO4)
    kinds = [f.split(":")[0] for f in failures]
    assert kinds == ["GPU per rank", "GPU model", "compute capability"]
    assert "H200" in failures[1] and "rank 3: None" in failures[1]


def test_lossless_rejects_8bit_backends():
    facts = _h200x4()
    assert quality_failures("lossless", facts, TOPO4, backend="sdpa") == []
    msg = _only(quality_failures("lossless", facts, TOPO4, backend="sage"), "backend:")
    assert "8-bit" in msg

    class Fake:  # a registered backend that declares itself inexact, whatever its name
        name, exact = "mykernel", False

    assert quality_failures("lossless", facts, TOPO4, backend="mykernel", backend_obj=Fake())
    assert is_8bit_backend("sage8") and not is_8bit_backend("sdpa")


def test_is_8bit_backend_reads_the_declared_numerics_not_the_name():
    """One owner: AttentionBackend.exact. A name that merely sounds 8-bit decides nothing."""
    from dist_attn import available_backends, get_backend

    for name in available_backends():
        if name != "auto":
            assert is_8bit_backend(name) is (not get_backend(name).exact), name

    class Exact:
        name, exact = "sage_fp8_int8", True

    assert not is_8bit_backend("sage_fp8_int8", Exact())
    assert not is_8bit_backend("triton_fp8")  # not registered: declares nothing
    assert not is_8bit_backend("auto")


def test_unknown_tier_lists_valid_values():
    with pytest.raises(ValueError, match=r"'medium' is not a quality tier; valid values: "
                                         r"'lossless', 'high'"):
        quality_failures("medium", _h200x4(), TOPO4)
    with pytest.raises(ValueError, match="valid values"):
        check_tier_name("HIGH")


def test_local_facts_on_cpu_and_gather_without_process_group():
    facts = local_device_facts(0, torch.device("cpu"))
    assert facts.device_type == "cpu" and facts.gpu_name is None
    assert gather_device_facts(facts) == [facts]
    # the gathered form round-trips through asdict (what all_gather_object sends)
    assert DeviceFacts(**dataclasses.asdict(_gpu(0))) == _gpu(0)


def test_auto_under_lossless_chooses_an_exact_kernel(monkeypatch):
    """With an 8-bit kernel first in "auto"'s order and runnable, "lossless" still gets an exact
    one (FA3 on Hopper when importable, else SDPA) and no tier leaves the 8-bit one."""
    import dataclasses

    import torch

    from dist_attn import AttentionBackend, get_backend, register_backend
    from dist_attn.distributed import DistEnv
    from dist_attn.models.h3.serve.config import load_config
    from dist_attn.models.h3.serve.launch.checks import resolve_backend_name

    class Runnable8bit(AttentionBackend):
        # accuracy_verified: "auto" chooses only verified 8-bit kernels (registry.auto_refusal)
        name, exact, accuracy_verified = "sage8", False, True

        def unsupported_reason(self, q):
            return None

    real = get_backend("sage8")
    register_backend(Runnable8bit(), replace=True)
    try:
        env = DistEnv(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend=None)
        cfg = load_config(None)
        assert resolve_backend_name(cfg, env, torch.float32)[0] == "sage8"
        lossless = dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, quality="lossless"))
        name, obj = resolve_backend_name(lossless, env, torch.float32)
        assert name == "sdpa" and obj.exact
    finally:
        register_backend(real, replace=True)
