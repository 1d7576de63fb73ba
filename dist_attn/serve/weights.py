"""Weight files: a stdlib + torch safetensors reader/writer, torch state dicts, and validation.

safetensors format (https://huggingface.co/docs/safetensors): an 8-byte little-endian unsigned
header length N; N bytes of UTF-8 JSON mapping each tensor name to
``{"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}`` (offsets relative to the byte
after the header) plus an optional ``"__metadata__"`` dict of strings; then the raw little-endian,
row-major tensor bytes. Implemented here instead of depending on the ``safetensors`` package.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
import sys
from typing import Mapping

import torch

__all__ = [
    "WeightsError",
    "SAFETENSORS_DTYPES",
    "load_safetensors",
    "save_safetensors",
    "load_weights",
    "check_state_dict",
]

#: safetensors dtype tag <-> torch dtype.
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
_TAGS = {v: k for k, v in SAFETENSORS_DTYPES.items()}

# The JSON header is capped by the reference implementation at 100 MB; a larger length means a
# corrupt or non-safetensors file, and reading it would allocate that much.
_MAX_HEADER = 100_000_000


class WeightsError(ValueError):
    """A weight file that cannot be read, or whose tensors do not fit the model."""


def save_safetensors(tensors: Mapping[str, torch.Tensor], path: str | os.PathLike,
                     metadata: Mapping[str, str] | None = None) -> None:
    """Writes ``tensors`` (any shapes, dtypes in :data:`SAFETENSORS_DTYPES`) to ``path``.

    Tensors are laid out in name order, contiguous, little-endian; the header is padded with
    spaces to a multiple of 8 bytes as the reference writer does (keeps data 8-byte aligned).
    """
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    blobs, offset = [], 0
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        if t.dtype not in _TAGS:
            raise WeightsError(f"{name}: dtype {t.dtype} has no safetensors tag")
        data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[name] = {"dtype": _TAGS[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for data in blobs:
            f.write(data)


def load_safetensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Reads a safetensors file into CPU tensors (memory-mapped copy-on-write, so an H3-sized
    file is paged in as tensors are used, not read up front). Raises :class:`WeightsError` on a
    malformed file, naming what is wrong."""
    if sys.byteorder != "little":  # the format is little-endian and we reinterpret bytes in place
        raise WeightsError("safetensors loading needs a little-endian host")
    path = os.fspath(path)
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise WeightsError(f"{path}: {size} bytes, too short for a safetensors header")
        (n,) = struct.unpack("<Q", prefix)
        if n > min(_MAX_HEADER, size - 8):
            raise WeightsError(f"{path}: header length {n} exceeds the file ({size} bytes) or the "
                               f"{_MAX_HEADER}-byte limit; not a safetensors file")
        try:
            header = json.loads(f.read(n).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise WeightsError(f"{path}: header is not valid JSON ({e})") from None
        if not isinstance(header, dict):
            raise WeightsError(f"{path}: header is not a JSON object")
        header.pop("__metadata__", None)
        data_len = size - 8 - n
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size else None
    out: dict[str, torch.Tensor] = {}
    for name, info in header.items():
        try:
            tag, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
        except (TypeError, KeyError, ValueError):
            raise WeightsError(f"{path}: entry {name!r} needs dtype, shape and data_offsets, "
                               f"got {info!r}") from None
        if tag not in SAFETENSORS_DTYPES:
            raise WeightsError(f"{path}: {name}: unknown dtype {tag!r}")
        dtype = SAFETENSORS_DTYPES[tag]
        if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
            raise WeightsError(f"{path}: {name}: bad shape {shape!r}")
        nbytes = math.prod(shape) * dtype.itemsize
        if not (0 <= begin <= end <= data_len) or end - begin != nbytes:
            raise WeightsError(f"{path}: {name}: data_offsets [{begin}, {end}] do not hold "
                               f"{tag}{shape} ({nbytes} bytes) within {data_len} data bytes")
        if nbytes == 0:
            out[name] = torch.empty(shape, dtype=dtype)
            continue
        flat = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=8 + n + begin)
        out[name] = flat.view(dtype).reshape(shape)
    return out


def load_weights(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Loads a ``.safetensors`` file (by its header, whatever the extension) or a torch state
    dict saved with ``torch.save`` (loaded with ``weights_only=True``: no pickled code runs)."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise WeightsError(f"--weights {path}: no such file")
    with open(path, "rb") as f:
        head = f.read(9)
    # A safetensors header starts with its length then '{'; a torch zip archive with 'PK'.
    if len(head) == 9 and head[8:9] == b"{":
        return load_safetensors(path)
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unpickling failure is a bad weight file
        raise WeightsError(f"{path}: neither safetensors nor a torch state dict ({e})") from None
    if isinstance(obj, dict) and "state_dict" in obj and isinstance(obj["state_dict"], dict):
        obj = obj["state_dict"]
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise WeightsError(f"{path}: expected a dict of name -> tensor, got {type(obj).__name__}")
    return obj


def check_state_dict(loaded: Mapping[str, torch.Tensor],
                     expected: Mapping[str, torch.Tensor | torch.Size | tuple[int, ...]],
                     *, source: str = "weights") -> None:
    """Raises :class:`WeightsError` listing every missing, unexpected and mis-shaped key.

    Args:
        loaded: name -> tensor from the file.
        expected: name -> tensor (e.g. a meta-device model's state_dict) or shape.
    """
    def shape_of(v: object) -> tuple[int, ...]:
        return tuple(v.shape) if isinstance(v, torch.Tensor) else tuple(v)  # type: ignore[arg-type]

    missing = sorted(set(expected) - set(loaded))
    unexpected = sorted(set(loaded) - set(expected))
    misshaped = sorted(
        f"{k}: file {list(loaded[k].shape)} vs model {list(shape_of(expected[k]))}"
        for k in set(expected) & set(loaded) if tuple(loaded[k].shape) != shape_of(expected[k]))
    not_float = sorted(k for k in set(expected) & set(loaded)
                       if not loaded[k].is_floating_point())
    if not (missing or unexpected or misshaped or not_float):
        return
    lines = [f"{source} does not fit the model:"]
    for title, items in (("missing keys", missing), ("unexpected keys", unexpected),
                         ("mis-shaped keys", misshaped), ("non-float keys", not_float)):
        if items:
            lines.append(f"  {title} ({len(items)}): " + ", ".join(items))
    raise WeightsError("\n".join(lines))
