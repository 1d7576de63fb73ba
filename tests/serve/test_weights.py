"""The stdlib+torch safetensors reader/writer, torch state dicts, and weight validation."""

from __future__ import annotations

import json
import struct

import pytest
import torch

from dist_attn.serve.config import ModelConfig
from dist_attn.serve.model import DiT, build_model
from dist_attn.serve.weights import (SAFETENSORS_DTYPES, WeightsError, check_state_dict,
                               load_safetensors, load_weights, save_safetensors)

CFG = ModelConfig(num_layers=1, hidden_size=32, num_heads=2, head_dim=16, ffn_size=48,
                  rope_dims=8, latent_channels=4, freq_dim=16)


def _write_raw(path, header: dict, data: bytes) -> None:
    """A safetensors file written by hand from the documented format (not by our writer)."""
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def test_reads_a_hand_written_file(tmp_path):
    a = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    b = torch.tensor([1.5, -2.0], dtype=torch.bfloat16)
    c = torch.tensor([[7, -8]], dtype=torch.int64)
    blobs = [t.reshape(-1).view(torch.uint8).numpy().tobytes() for t in (a, b, c)]
    offs, pos = [], 0
    for blob in blobs:
        offs.append([pos, pos + len(blob)])
        pos += len(blob)
    header = {"__metadata__": {"format": "pt"},
              "a": {"dtype": "F32", "shape": [2, 3], "data_offsets": offs[0]},
              "b": {"dtype": "BF16", "shape": [2], "data_offsets": offs[1]},
              "c": {"dtype": "I64", "shape": [1, 2], "data_offsets": offs[2]}}
    path = tmp_path / "hand.safetensors"
    _write_raw(path, header, b"".join(blobs))
    out = load_safetensors(path)
    assert sorted(out) == ["a", "b", "c"]
    assert torch.equal(out["a"], a) and torch.equal(out["b"], b) and torch.equal(out["c"], c)
    assert out["b"].dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", sorted(SAFETENSORS_DTYPES.values(), key=str))
def test_round_trip_every_dtype(tmp_path, dtype):
    src = (torch.randn(3, 5) * 4).to(dtype)
    path = tmp_path / "t.safetensors"
    save_safetensors({"x": src, "scalar": torch.tensor(2.0), "empty": torch.zeros(0, 4)}, path,
                     metadata={"k": "v"})
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert n % 8 == 0 and json.loads(raw[8:8 + n])["__metadata__"] == {"k": "v"}
    out = load_safetensors(path)
    assert out["x"].dtype == dtype and torch.equal(out["x"].view(torch.uint8),
                                                   src.view(torch.uint8))
    assert out["scalar"].shape == () and float(out["scalar"]) == 2.0
    assert out["empty"].shape == (0, 4)


def test_cross_check_with_safetensors_package_if_installed(tmp_path):
    st = pytest.importorskip("safetensors.torch")
    tensors = {"w": torch.randn(4, 3), "h": torch.randn(2).to(torch.float16)}
    ours, theirs = tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors"
    save_safetensors(tensors, ours)
    st.save_file(tensors, str(theirs))
    for name, t in st.load_file(str(ours)).items():
        assert torch.equal(t, tensors[name])
    for name, t in load_safetensors(theirs).items():
        assert torch.equal(t, tensors[name])


@pytest.mark.parametrize("mutate, match", [
    (lambda h, d: (h, d[:-4]), r"data_offsets \[\d+, \d+\] do not hold F32\[2, 3\]"),
    (lambda h, d: ({"a": {**h["a"], "dtype": "F7"}}, d), r"unknown dtype 'F7'"),
    (lambda h, d: ({"a": {"dtype": "F32"}}, d), r"entry 'a' needs dtype, shape and data_offsets"),
    (lambda h, d: ({"a": {**h["a"], "shape": [2, -3]}}, d), r"bad shape"),
])
def test_malformed_files_are_named(tmp_path, mutate, match):
    a = torch.zeros(2, 3)
    header = {"a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}}
    header, data = mutate(header, a.numpy().tobytes())
    path = tmp_path / "bad.safetensors"
    _write_raw(path, header, data)
    with pytest.raises(WeightsError, match=match):
        load_safetensors(path)


def test_garbage_file_is_rejected(tmp_path):
    path = tmp_path / "junk.bin"
    path.write_bytes(b"\xff" * 64)
    with pytest.raises(WeightsError, match=r"neither safetensors nor a torch state dict|header"):
        load_weights(path)
    with pytest.raises(WeightsError, match=r"header length .* exceeds the file"):
        load_safetensors(path)
    with pytest.raises(WeightsError, match="no such file"):
        load_weights(tmp_path / "absent.safetensors")


def test_model_round_trips_through_both_formats(tmp_path):
    model = build_model(CFG, device=torch.device("cpu"), dtype=torch.float32, backend="sdpa")
    sd = model.state_dict()
    save_safetensors(sd, tmp_path / "m.safetensors")
    torch.save(sd, tmp_path / "m.pt")
    for name in ("m.safetensors", "m.pt"):
        loaded = load_weights(tmp_path / name)
        check_state_dict(loaded, DiT(CFG, device="meta").state_dict())
        other = build_model(CFG, device=torch.device("cpu"), dtype=torch.float32,
                            backend="sdpa", state_dict=loaded)
        for key, value in other.state_dict().items():
            assert torch.equal(value, sd[key]), key


def test_bad_state_dict_lists_missing_unexpected_and_misshaped(tmp_path):
    sd = dict(build_model(CFG, device=torch.device("cpu"), dtype=torch.float32,
                          backend="sdpa").state_dict())
    del sd["blocks.0.fc1.bias"], sd["proj_out.weight"]
    sd["blocks.0.extra"] = torch.zeros(3)
    sd["blocks.0.qkv.weight"] = torch.zeros(7, 32)
    path = tmp_path / "bad.safetensors"
    save_safetensors(sd, path)
    with pytest.raises(WeightsError) as info:
        check_state_dict(load_weights(path), DiT(CFG, device="meta").state_dict(),
                         source=str(path))
    msg = str(info.value)
    assert "missing keys (2): blocks.0.fc1.bias, proj_out.weight" in msg
    assert "unexpected keys (1): blocks.0.extra" in msg
    assert "mis-shaped keys (1): blocks.0.qkv.weight: file [7, 32] vs model [96, 32]" in msg
    assert "bad.safetensors does not fit the model" in msg
