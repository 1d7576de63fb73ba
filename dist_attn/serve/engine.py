"""The denoise loop over the sequence-sharded DiT, run by every rank for every request.

Between denoise steps all ranks vote on whether to go on (:func:`dist_attn.serve.wire.agree_abort`),
so a request whose client left, whose deadline passed or that a shutdown ends stops at the same
step on every rank and the group stays in lockstep.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from dist_attn.distributed import DistEnv
from dist_attn.profiling import PhaseTimer
from dist_attn.serve.config import Config
from dist_attn.serve.jobs import Abort
from dist_attn.serve.model import rope_tables
from dist_attn.serve.protocol import Request
from dist_attn.serve.weights import save_safetensors
from dist_attn.serve.wire import agree_abort

__all__ = ["Checksum", "TokenCounts", "RunResult", "Engine", "latent_checksum"]

log = logging.getLogger(__name__)


@dataclass(kw_only=True, frozen=True)
class Checksum:
    """A checksum of the used rows of a latent, identical for any world size."""

    bits64: str
    """Hex of sum over elements of bits(x_i) * (2 i + 1) mod 2**64 (i = global flat index):
    exact, order-free, changes with any bit of any element."""
    sum: float
    abs_sum: float
    l2: float


@dataclass(kw_only=True, frozen=True)
class TokenCounts:
    """Packed rows of one request."""

    used: int
    total: int
    latent_shape: list[int] | None


@dataclass(kw_only=True)
class RunResult:
    """What rank 0 reports about one request (the JSON body of a 200 answer)."""

    request_id: str
    request: dict[str, int]
    tokens: TokenCounts
    world_size: int
    backend: str
    step_latency_ms: list[float]
    denoise_ms: float
    run_ms: float
    setup_ms: float
    finalize_ms: float
    phase_ms: dict[str, float]
    attention_share: float
    all_to_all_share: float
    checksum: Checksum | None
    output: str | None = None
    queue_ms: float = 0.0
    total_latency_ms: float = 0.0
    aborted: Abort = field(default=Abort.NONE, metadata={"json": False})
    """Why the denoise loop stopped early (not part of the answer: aborted jobs get no 200)."""
    latent: torch.Tensor | None = field(default=None, repr=False, metadata={"json": False})
    """[used, C] float32 on the CPU when an output directory asks for the latent."""

    def to_json(self) -> dict[str, Any]:
        """The answer body (internal fields left out)."""
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)
                if f.metadata.get("json", True)}


def _plain(value: Any) -> Any:
    return dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value


def latent_checksum(z: torch.Tensor, offset: int, used: int, *, group: Any = None,
                    distributed: bool = False) -> Checksum:
    """Checksum of the used rows of the sharded latent, identical for any world size.

    Args:
        z: [S_local, C] float32, this rank's rows [offset, offset + S_local).
        used: rows [used, ...) are padding and excluded.
        distributed: gather the partial sums of every rank of ``group`` (one all-gather of 4
            numbers per rank); False checksums ``z`` alone.
    """
    rows = max(0, min(z.shape[0], used - offset))
    x = z[:rows].float()  # [rows, C]; padding rows excluded
    idx = torch.arange(offset * z.shape[1], (offset + rows) * z.shape[1], device=z.device,
                       dtype=torch.int64).view(rows, z.shape[1])
    bits = x.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    # int64 products and sums wrap mod 2**64, and integer addition is associative, so partial
    # sums over any sharding add up to the same value.
    h = (bits * (2 * idx + 1)).sum()
    xd = x.double()
    # [4] float64 per rank: the int64 hash bit-cast into a float64 slot, then the float sums.
    part = torch.stack([h.view(torch.float64), xd.sum(), xd.abs().sum(), xd.pow(2).sum()])
    if distributed:
        parts = [torch.empty_like(part) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, part, group=group)
        part_all = torch.stack(parts)  # [W, 4]
    else:
        part_all = part[None]  # [1, 4]
    h = part_all[:, 0].contiguous().view(torch.int64).sum()  # wraps mod 2**64
    total, abs_sum, sq = part_all[:, 1:].sum(0).tolist()
    return Checksum(bits64=f"{int(h.item()) & 0xFFFFFFFFFFFFFFFF:016x}", sum=total,
                    abs_sum=abs_sum, l2=sq ** 0.5)


def _keep_going() -> Abort:
    return Abort.NONE


class Engine:
    """The denoise loop over the sequence-sharded DiT; ``run`` is called on every rank."""

    def __init__(self, cfg: Config, env: DistEnv, model: torch.nn.Module, timer: PhaseTimer,
                 *, output_dir: str | None = None) -> None:
        self.cfg, self.env, self.model, self.timer = cfg, env, model, timer
        self.output_dir = output_dir
        self.dtype = next(model.parameters()).dtype

    def _sync(self) -> None:
        if self.env.device.type == "cuda":
            torch.cuda.synchronize(self.env.device)

    @torch.no_grad()
    def run(self, req: Request, *, abort: Callable[[], Abort] = _keep_going) -> RunResult | None:
        """Denoises one request on every rank; returns the result on rank 0 (None elsewhere).

        ``abort`` is rank 0's vote before each step after the first (other ranks vote NONE; the
        caller checked just before sending the request); the loop stops on every rank at the
        first vote that is not NONE, and the result says why.

        Initial noise is drawn for ALL packed rows from one generator seeded with the request's
        seed, then sliced: the result does not depend on the world size. Flow-matching Euler from
        t = 1 to 0: z <- z + (t_next - t) * v(z, t).
        """
        cfg, env = self.cfg, self.env
        t_start = time.perf_counter()
        layout = req.layout(cfg)
        s_local = layout.total // env.world_size
        offset = env.rank * s_local
        bounds = layout.cu_seqlens()
        cu = torch.tensor(bounds, dtype=torch.int32, device=env.device)
        gen = torch.Generator(device=env.device).manual_seed(req.seed)
        noise = torch.randn(layout.total, cfg.model.latent_channels, generator=gen,
                            device=env.device, dtype=torch.float32)
        z = noise[offset:offset + s_local].clone()  # [S_local, C] float32 state
        positions = torch.arange(offset, offset + s_local, device=env.device)
        rope = rope_tables(positions, cfg.model.rope_dims, cfg.model.rope_theta)
        self.timer.reset()
        self._sync()
        t_loop = time.perf_counter()
        step_ms: list[float] = []
        aborted = Abort.NONE
        for i in range(req.steps):
            if i:
                aborted = agree_abort(abort(), env)
                if aborted is not Abort.NONE:
                    break
            t0 = time.perf_counter()
            t, t_next = 1.0 - i / req.steps, 1.0 - (i + 1) / req.steps
            v = self.model(z.to(self.dtype), torch.tensor(t, device=env.device), cu, layout.used,
                           row_offset=offset, cu_seqlens_host=bounds, rope=rope)
            z = z + (t_next - t) * v.float()
            self._sync()  # per-step latency and progress; one sync per ~layers x 25 ms at h3-ref
            step_ms.append((time.perf_counter() - t0) * 1e3)
            if env.rank == 0:
                log.info("%s step %d/%d %.1f ms", req.request_id, i + 1, req.steps, step_ms[-1])
        t_denoised = time.perf_counter()
        csum, latent = None, None
        if aborted is Abort.NONE:
            # The checksum is reduced from per-rank partials (a few scalars in one all-gather), so
            # a request costs no gather of the latent (9.7 MB fp32 at h3-ref, plus a ~6 ms host
            # sha256) unless --output-dir asks for the latent itself.
            csum = latent_checksum(z, offset, layout.used, distributed=env.distributed)
            if self.output_dir:
                latent = self._gather_latent(z)[: layout.used].float().cpu()  # [used, C]
        if env.rank != 0:
            return None
        phases = self.timer.totals_ms()
        denoise_ms = sum(step_ms)
        attn_ms = sum(phases.values())
        a2a_ms = sum(v for k, v in phases.items() if k.startswith("a2a"))
        t_end = time.perf_counter()
        return RunResult(
            request_id=req.request_id, request=req.to_json(),
            tokens=TokenCounts(used=layout.used, total=layout.total,
                               latent_shape=list(layout.latent_shape) if layout.latent_shape
                               else None),
            world_size=env.world_size, backend=getattr(self.model, "backend_name", "unknown"),
            step_latency_ms=[round(x, 3) for x in step_ms], denoise_ms=round(denoise_ms, 3),
            run_ms=round((t_end - t_start) * 1e3, 3), setup_ms=round((t_loop - t_start) * 1e3, 3),
            finalize_ms=round((t_end - t_denoised) * 1e3, 3),
            phase_ms={k: round(v, 3) for k, v in sorted(phases.items())},
            attention_share=attn_ms / denoise_ms if denoise_ms else 0.0,
            all_to_all_share=a2a_ms / denoise_ms if denoise_ms else 0.0,
            checksum=csum, aborted=aborted, latent=latent)

    def _gather_latent(self, z: torch.Tensor) -> torch.Tensor:
        """[S_local, C] on every rank -> [total, C] (an all-gather; every rank takes part)."""
        if not self.env.distributed:
            return z
        parts = [torch.empty_like(z) for _ in range(self.env.world_size)]
        dist.all_gather(parts, z.contiguous())
        return torch.cat(parts)  # [W * S_local, C] = [total, C]

    def save_output(self, result: RunResult) -> None:
        """Rank 0 only: writes ``result.latent`` to ``<output_dir>/<request_id>.safetensors`` and
        sets ``result.output``. An OSError here concerns this request alone."""
        if result.latent is None or not self.output_dir:
            return
        os.makedirs(self.output_dir, exist_ok=True)
        path = os.path.join(self.output_dir, f"{result.request_id}.safetensors")
        save_safetensors({"latent": result.latent}, path,
                         metadata={"request": json.dumps(result.request),
                                   "checksum": json.dumps(dataclasses.asdict(result.checksum))})
        result.output = path
        result.latent = None
