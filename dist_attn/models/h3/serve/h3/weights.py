# SPDX-License-Identifier: Apache-2.0
"""Files in and out of the served DiT: a diffusers-format H3 checkpoint directory in, output
latents out, both through the ``safetensors`` package (which diffusers brings).

A checkpoint is what ``MiniMaxH3Transformer3DModel.save_pretrained`` writes (H3's own release
ships its ``transformer/`` folder so): ``config.json`` plus safetensors shards. Its architecture
must equal the serving config's ``[model]`` table; every mismatch is listed before any weight is
read, on every rank alike (all ranks read the same file).
"""

from __future__ import annotations

import glob
import json
import logging
import os
from typing import Any, Mapping

import torch
from torch import nn

from dist_attn.extras import install_hint
from dist_attn.models.h3.serve.config.sections import H3_ARCHITECTURE, ModelConfig
from dist_attn.models.h3.serve.h3.transformer import H3_CLASS_NAME, h3_class

__all__ = ["CheckpointTensors", "WeightsError", "check_checkpoint", "load_checkpoint",
           "save_output", "load_output", "prune_outputs", "SERVED_OUTPUTS"]

log = logging.getLogger(__name__)

#: The files /v1/generate writes into --output-dir (one per request: ``<request_id>.safetensors``).
SERVED_OUTPUTS = "req-*.safetensors"


class WeightsError(ValueError):
    """A checkpoint that cannot be read, or whose architecture is not the serving config's."""


def check_checkpoint(path: str | os.PathLike, cfg: ModelConfig) -> dict:
    """Reads ``<path>/config.json`` and raises :class:`WeightsError` listing every architecture
    field that differs from ``cfg`` (or naming what is missing); returns the config dict."""
    path = os.fspath(path)
    config_file = os.path.join(path, "config.json")
    if not os.path.isdir(path):
        raise WeightsError(f"--checkpoint {path}: not a directory (a diffusers-format checkpoint is "
                           "a folder with config.json and safetensors weights, as save_pretrained "
                           "writes it)")
    try:
        with open(config_file, encoding="utf-8") as f:
            found = json.load(f)
    except FileNotFoundError:
        raise WeightsError(f"--checkpoint {path}: no config.json (not a diffusers-format "
                           "checkpoint)") from None
    except (OSError, json.JSONDecodeError) as e:
        raise WeightsError(f"--checkpoint {config_file}: cannot be read as JSON ({e})") from None
    if not isinstance(found, dict) or found.get("_class_name") != H3_CLASS_NAME:
        got = found.get("_class_name") if isinstance(found, dict) else type(found).__name__
        raise WeightsError(f"--checkpoint {config_file}: _class_name={got!r}, expected "
                           f"{H3_CLASS_NAME!r}")
    expected = cfg.diffusers_config()
    diffs = []
    for name in H3_ARCHITECTURE:
        value = found.get(name)
        value = tuple(value) if isinstance(value, list) else value
        if value != expected[name]:
            diffs.append(f"{name}: checkpoint {value!r} vs config {expected[name]!r}")
    if diffs:
        raise WeightsError(f"--checkpoint {path} does not match the serving config's [model] "
                           f"({len(diffs)} field(s); pass the matching --config, or --set "
                           "model.FIELD=VALUE):\n  " + "\n  ".join(diffs))
    return found


def load_checkpoint(path: str | os.PathLike, cfg: ModelConfig, *, device: torch.device,
                    dtype: torch.dtype) -> nn.Module:
    """``MiniMaxH3Transformer3DModel.from_pretrained(path, torch_dtype=dtype)`` straight onto
    ``device``: the blocks in ``dtype``, the class's ``_keep_in_fp32_modules`` in float32.

    Loading goes through accelerate's ``device_map`` (each tensor is read into place); without it
    diffusers would first build the whole model in float32 on the host (H3: 132 GB per rank).
    On CPU every tensor then gets memory of its own (see :func:`_own_memory`).
    """
    check_checkpoint(path, cfg)
    try:
        import accelerate  # noqa: F401 - diffusers' device_map loading needs it
    except ImportError:
        raise WeightsError("--checkpoint needs the accelerate package (diffusers loads a checkpoint "
                           f"into place with it): {install_hint('serve')}") from None
    try:
        model = h3_class().from_pretrained(os.fspath(path), torch_dtype=dtype,
                                           device_map={"": str(device)})
    except (OSError, ValueError, RuntimeError) as e:
        raise WeightsError(f"--checkpoint {path}: {type(e).__name__}: {e}") from None
    if torch.device(device).type == "cpu":
        _own_memory(model)
    return model


def _own_memory(model: nn.Module) -> None:
    """Moves every parameter and buffer that lies in a checkpoint file's memory (on CPU,
    ``from_pretrained`` leaves uncast tensors where the file put them, 8-byte aligned) into an
    allocation of its own: CPU matmuls round some shapes differently on misaligned operands, and
    the sharded build, like the class's own init, computes on fresh memory."""
    with torch.no_grad():
        for t in (*model.parameters(), *model.buffers()):
            if t.data_ptr() % 64:
                t.data = t.data.clone()


class CheckpointTensors:
    """The tensors of a safetensors checkpoint directory (one file or an indexed set of shards,
    as ``save_pretrained`` writes them), read one module at a time: what a model materialised
    unit by unit (:func:`dist_attn.weight_sharding.shard_module`) copies in, so that no rank
    holds more than one block of the checkpoint at once. Each tensor is read once; the copy
    casts it to the parameter's dtype, as ``from_pretrained(torch_dtype=...)`` does."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        files = sorted(glob.glob(os.path.join(glob.escape(self.path), "*.safetensors")))
        if not files:
            raise WeightsError(f"--checkpoint {self.path}: no *.safetensors file (a "
                               "diffusers-format checkpoint holds its weights in safetensors)")
        from safetensors import safe_open

        self._where: dict[str, str] = {}
        for file in files:
            with safe_open(file, framework="pt") as f:
                for key in f.keys():
                    self._where[key] = file
        self._open: dict[str, Any] = {}
        self.read: set[str] = set()

    def fill(self, prefix: str, module: nn.Module) -> None:
        """Copies ``<prefix>.<name>`` into each of ``module``'s own parameters; WeightsError
        naming the keys the checkpoint lacks."""
        from safetensors import safe_open

        own = list(module.named_parameters(recurse=False))
        keys = [f"{prefix}.{name}" if prefix else name for name, _ in own]
        missing = [k for k in keys if k not in self._where]
        if missing:
            raise WeightsError(f"--checkpoint {self.path}: no tensor {', '.join(missing)} (the "
                               "served class has it; is the checkpoint of another version?)")
        with torch.no_grad():
            for key, (_, param) in zip(keys, own):
                file = self._where[key]
                if file not in self._open:
                    self._open[file] = safe_open(file, framework="pt", device="cpu")
                t = self._open[file].get_tensor(key)
                if tuple(t.shape) != tuple(param.shape):
                    raise WeightsError(f"--checkpoint {self.path}: {key} has shape "
                                       f"{tuple(t.shape)}, the served model {tuple(param.shape)}")
                param.copy_(t)
                self.read.add(key)

    def unread(self) -> list[str]:
        """Keys no :meth:`fill` copied (after a whole model: tensors it has no parameter for)."""
        return sorted(set(self._where) - self.read)


def save_output(tensors: Mapping[str, torch.Tensor], path: str | os.PathLike,
                metadata: Mapping[str, str] | None = None) -> None:
    """Writes CPU copies of ``tensors`` to a ``.safetensors`` file (``metadata``: strings)."""
    from safetensors.torch import save_file

    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, os.fspath(path),
              metadata={str(k): str(v) for k, v in (metadata or {}).items()})


def load_output(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Reads a file written by :func:`save_output` (``video`` and ``audio`` latent rows)."""
    from safetensors.torch import load_file

    return load_file(os.fspath(path))


def prune_outputs(directory: str | os.PathLike, *, keep: int,
                  pattern: str = SERVED_OUTPUTS) -> list[str]:
    """Deletes all but the newest ``keep`` files of ``directory`` matching ``pattern`` (newest by
    modification time, then by name); returns the names deleted, oldest first.

    /v1/generate writes one file per request; this bounds them. A file that cannot be deleted is
    logged as a warning and left: the request that wrote the newest one succeeded regardless.
    """
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"keep={keep!r} must be a positive integer")
    paths = []
    for path in glob.glob(os.path.join(glob.escape(os.fspath(directory)), pattern)):
        try:
            paths.append((os.stat(path).st_mtime_ns, os.path.basename(path), path))
        except FileNotFoundError:  # deleted meanwhile (another server, an operator)
            continue
    paths.sort()
    removed = []
    for _, name, path in paths[:max(0, len(paths) - keep)]:
        try:
            os.remove(path)
        except FileNotFoundError:
            continue
        except OSError as e:
            log.warning("could not delete the old output %s (%s); it stays", path,
                        e.strerror or e)
            continue
        removed.append(name)
    return removed
