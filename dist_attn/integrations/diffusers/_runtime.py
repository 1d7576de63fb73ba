# SPDX-License-Identifier: Apache-2.0
"""The hooks of an enabled transformer: one sequence plan per forward, shard once, gather once.

Every rank calls the transformer with the FULL inputs. The forward pre-hook checks them (once
across the ranks, then locally), plans the shard of the S-token sequence (padded at its end to a
multiple of W, or of the sequence bucket) and cuts the per-token forward arguments; the
submodule hooks cut every other tensor that carries the sequence (hidden states entering the
first block, RoPE tables, per-row index tensors) to this rank's rows and gather the output
projections back to all S rows; the forward hook closes the plan.
The processors' attention goes through :meth:`Runtime.attend`, the one place that turns the plan
into an attention call (:func:`dist_attn.ulysses.checked_attention`: the scalars enable_ulysses
checked once are trusted).
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from dist_attn import SequenceShard, gather_sequence, plan_shard, shard_rows
from dist_attn.ulysses import checked_attention
from dist_attn.validation import CheckedScalars, checked_scalars
from dist_attn.agreement import (FLOAT_TENSOR, FP_ROW, FP_SHAPE, UNCOMPARABLE, describe_fingerprint,
                                 fingerprint, fingerprint_kind, fingerprints_differ, gather_rows)
from dist_attn.distributed import group_size_and_rank
from dist_attn.mesh import parallel_groups
from dist_attn.plan import too_few_heads_fix
from dist_attn.sharding import bucket_multiple
from dist_attn.integrations.diffusers._spec import ModelSpec, ShardPoint

__all__ = ["Runtime", "fuses_qk_norm_rope", "install_hooks"]

logger = logging.getLogger(__name__)

# diffusers caches that decide from the activations whether to skip the remaining blocks: each
# rank would decide from its own shard, and a rank that skips leaves the others waiting in the
# next block's all-to-all. Caches that follow the step schedule decide alike on every rank.
_PER_RANK_CACHES = ("FirstBlockCacheConfig", "SeaCacheConfig")


def _host_scalar() -> torch.Tensor:
    """A 0-d int64 CPU tensor that may be filled in place inside and outside inference mode
    (created under inference mode it would be an inference tensor, read-only outside it)."""
    with torch.inference_mode(False):
        return torch.zeros((), dtype=torch.int64)


def fuses_qk_norm_rope(backend: str) -> bool:
    """Whether a processor hands q and k to ``backend`` with a :class:`dist_attn.QKNormRope`
    instead of running diffusers' norm and RoPE: only for a named 8-bit backend, whose results are
    not diffusers' bit for bit anyway ("auto" is not known until it runs)."""
    from dist_attn.backends import get_backend

    return backend != "auto" and not get_backend(backend).exact


@dataclass(kw_only=True)
class Runtime:
    """The state one enabled transformer shares between its hooks and processors."""

    spec: ModelSpec
    group: Any
    """Process group of the ranks that share one sequence, as the caller gave it (None = the
    default group; always None with ``mesh``, whose ranks are the default group's)."""
    backend: str
    """dist_attn backend name for the self-attention."""
    mesh: Any = None
    """``("ring", "ulysses")`` DeviceMesh for Ulysses x Ring, or None for pure Ulysses over
    ``group``. Shard ``r*U + u`` sits at global rank ``r*U + u`` (checked by enable_ulysses)."""
    timer: Any = None
    """Optional :class:`~dist_attn.profiling.PhaseTimer` handed to every eager attention call."""
    checked: CheckedScalars = field(default_factory=lambda: checked_scalars(None, 1))
    """The attention calls' softmax scale (None: the kernels' default) and ``overlap_chunks`` (head
    chunks each call pipelines against its all-to-alls, 1 = the plain path), checked once by
    enable_ulysses: the calls trust them."""
    sequence_bucket: int = 1
    """Rows the packed sequence is padded to a multiple of, with W: each rank's rows are a multiple
    of ``ceil(sequence_bucket / W)`` (:func:`plan_shard`'s ``multiple_of``)."""
    valid_len_host: torch.Tensor = field(default_factory=_host_scalar)
    """The forward in flight's ``valid_len`` as a CPU tensor, refilled in place by every forward:
    compiled attention reads it as a graph input, so sequences of one padded length share one
    compiled graph whatever their true length."""
    world_size: int = 1
    """W of the forward in flight (read from the group at each forward: the group may be
    initialised after enable_ulysses)."""
    shard: SequenceShard | None = None
    """The plan of the forward in flight; None outside a forward."""
    handles: list = field(default_factory=list)
    """The ``RemovableHandle`` of every hook registered on the transformer."""
    fused_qk_norm_rope: bool = False
    """Whether processors that can normalise and rotate q and k in one kernel do (H3's): True
    when ``backend`` names an 8-bit kernel, whose results are not bit for bit those of diffusers'
    ops anyway; an exact backend (the lossless tier's) keeps diffusers' arithmetic."""

    @property
    def overlap_chunks(self) -> int:
        """Head chunks each attention call pipelines against its all-to-alls (read-only)."""
        return self.checked.overlap_chunks

    def plan(self, seq_len: int) -> SequenceShard:
        """Plans the forward's sequence of ``seq_len`` rows (padded to W and the bucket) and
        refills :attr:`valid_len_host`; returns the plan, also kept in :attr:`shard`."""
        _, world, _ = group_size_and_rank(self.group)
        self.shard = plan_shard(seq_len, self.group,
                                multiple_of=bucket_multiple(self.sequence_bucket, world))
        self.valid_len_host.fill_(seq_len)
        return self.shard

    def current(self, where: str) -> SequenceShard:
        """The plan of the forward in flight, or a clear error when called outside one."""
        if self.shard is None:
            raise RuntimeError(
                f"{where} was called outside the transformer's forward; after enable_ulysses the "
                f"sequence is sharded by the transformer's forward hooks, so call the transformer "
                f"itself (or remove the handle first)"
            )
        return self.shard

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, where: str,
               qk_prologue=None) -> torch.Tensor:
        """Self-attention of this rank's rows over the whole planned sequence.

        Args:
            q, k, v: ``[B, S_local, H, D]``, this rank's rows of the padded sequence (padding rows
                past ``valid_len`` may hold anything: they are never attended).
            where: names the caller in the error raised outside a forward.
            qk_prologue: an optional :class:`dist_attn.QKNormRope` for q and k (tables of this
                rank's rows), see :func:`dist_attn.ulysses_attention`.

        Returns:
            ``[B, S_local, H, D]`` in q's dtype; padding rows are exactly zero.
        """
        shard = self.current(where)
        compiling = torch.compiler.is_compiling()
        # A PhaseTimer cannot cross torch.compile's custom-op boundary (it is host state); an int
        # valid_len would be a constant of the compiled graph, guarded on: each prompt length of
        # a padded length would compile again.
        timer = None if compiling else self.timer
        valid_len = self.valid_len_host if compiling else shard.valid_len
        return checked_attention(q, k, v, self.checked, valid_len=valid_len,
                                 group=self.group if self.mesh is None else None, mesh=self.mesh,
                                 backend=self.backend, timer=timer, qk_prologue=qk_prologue)


def _submodules(model: nn.Module, path: str) -> list[tuple[str, nn.Module]]:
    """``[(path, module)]``; ``"a.b.*"`` names every child of the container ``a.b`` (each block)."""
    base, star, rest = path.partition(".*")
    if rest:
        raise ValueError(f"module path {path!r}: '*' may only end the path")
    try:
        sub = model.get_submodule(base) if base else model
    except AttributeError:
        raise TypeError(
            f"{type(model).__name__} has no submodule {base!r}, which dist_attn's plan for it "
            f"expects; this diffusers version is not supported"
        ) from None
    if not star:
        return [(path, sub)]
    return [(f"{base}.{name}", child) for name, child in sub.named_children()]


def _cut(rt: Runtime, x: torch.Tensor, point: ShardPoint, item: int | None = None) -> torch.Tensor:
    """This rank's rows of ``x`` under the forward's plan (a narrow and a pad). Messages are built
    only on the error paths. The hooks run eagerly, outside ``torch.compile(block)`` (:func:`_eager`)."""
    shard = rt.shard if rt.shard is not None else rt.current(_where(point, item))
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{_where(point, item)} should be a tensor carrying the sequence, got "
                        f"{type(x).__name__}")
    if x.shape[point.dim] != shard.valid_len:
        raise ValueError(
            f"{_where(point, item)} has {x.shape[point.dim]} rows along dim {point.dim} (shape "
            f"{tuple(x.shape)}), but the sequence of this forward has S={shard.valid_len} tokens"
        )
    return shard_rows(x, shard, dim=point.dim)


def _where(point: ShardPoint, item: int | None) -> str:
    if point.where == "output":
        return f"the output of {point.module!r}" + ("" if item is None else f"[{item}]")
    if not point.module:
        return f"argument {point.name!r}"
    return f"argument {point.items[0]} ({point.name!r}) of {point.module!r}"


def _output_hook(rt: Runtime, point: ShardPoint):
    def hook(module, args, output):
        if not point.items:
            return _cut(rt, output, point)
        out = list(output)
        for i in point.items:
            out[i] = _cut(rt, out[i], point, i)
        return tuple(out) if isinstance(output, tuple) else out
    return hook


def _input_hook(rt: Runtime, point: ShardPoint):
    (index,) = point.items

    def hook(module, args, kwargs):
        if len(args) > index:
            args = (*args[:index], _cut(rt, args[index], point), *args[index + 1:])
        elif point.name in kwargs:
            kwargs = {**kwargs, point.name: _cut(rt, kwargs[point.name], point)}
        else:
            raise TypeError(f"{point.module!r} was called without its {point.name!r} argument")
        return args, kwargs
    return hook


def _gather_hook(rt: Runtime, path: str, dim: int):
    def hook(module, args, output):
        shard = rt.current(f"the output of {path!r}")
        return gather_sequence(output, shard, rt.group, dim=dim)
    return hook


_FORWARD_ONLY = ("dist_attn's sequence-parallel attention is forward only: call the transformer "
                 "under torch.no_grad() or torch.inference_mode() (diffusers pipelines do)")


def _check_same_on_all_ranks(rt: Runtime, arguments: dict, device: torch.device, *,
                             grad: bool) -> None:
    """One all-gather of shape and contents fingerprints; raises the same error on every rank.

    Ranks that pass different inputs (another seed, another prompt, another resolution) would
    otherwise either crash inside an all-to-all with a size mismatch or, with equal shapes,
    return a silently wrong mix of the two inputs.
    """
    names = rt.spec.compared_inputs
    # the last row: grad mode, then the settings that decide the collectives' shapes (a rank
    # with another bucket pads to another length; another chunk count issues other all-to-alls)
    settings = {"sequence_bucket": rt.sequence_bucket, "overlap_chunks": rt.overlap_chunks}
    own = torch.zeros((1, FP_ROW), dtype=torch.float64, device=device)
    own[0, :1 + len(settings)] = torch.tensor([float(grad), *map(float, settings.values())],
                                              dtype=torch.float64)
    mine = torch.cat([torch.stack([fingerprint(arguments.get(n), device) for n in names]),
                      own])  # [len(names) + 1, FP_ROW]
    every = gather_rows(mine, rt.group, rt.world_size)  # [W, len(names) + 1, FP_ROW]
    _check_settings(every[:, -1], settings, rt.world_size)
    _check_inputs(every[:, :-1], names, rt.world_size)


def _check_settings(every: torch.Tensor, settings: dict, world: int) -> None:
    """``every``: ``[W, FP_ROW]``, each rank's grad mode and then its ``settings``."""
    with_grad = [r for r in range(world) if every[r, 0] != 0]
    if with_grad:
        raise RuntimeError(f"{_FORWARD_ONLY}; grad mode is on for rank(s) {with_grad} of the group")
    for j, name in enumerate(settings, start=1):
        values = [int(every[r, j]) for r in range(world)]
        if len(set(values)) > 1:
            raise ValueError(f"enable_ulysses({name}=...) differs across the W={world} "
                             f"ranks of the group: {values} by rank; pass the same on every rank")


def _check_inputs(every: torch.Tensor, names, world: int) -> None:
    """``every``: ``[W, len(names), FP_ROW]``, each rank's fingerprints of the compared inputs."""
    for i, name in enumerate(names):
        odd = [r for r in range(world) if every[r, i, 0] == UNCOMPARABLE]
        if odd:
            raise ValueError(
                f"{name} on rank(s) {odd} is neither a tensor nor Python numbers (a number or a "
                f"flat tuple/list of them), so the ranks cannot check they agree; pass "
                f"{name} as one of those"
            )
    ref = every[0]
    for r in range(1, world):
        for i, name in enumerate(names):
            mine, theirs = every[r, i], ref[i]
            what = fingerprints_differ(mine, theirs)
            if what == "shape":
                kinds = (f" ({fingerprint_kind(mine)} on rank {r}, {fingerprint_kind(theirs)} on "
                         "rank 0)" if mine[FP_SHAPE - 1] != theirs[FP_SHAPE - 1] else "")
                raise ValueError(
                    f"{name} differs across the W={world} ranks of the group: "
                    f"{describe_fingerprint(mine)} on rank {r}, {describe_fingerprint(theirs)} on "
                    f"rank 0{kinds}; every rank must pass the same full inputs to the transformer"
                )
            if what and theirs[FP_SHAPE - 1] != FLOAT_TENSOR:  # integers, numbers: bit for bit
                raise ValueError(
                    f"{name} has different contents on rank {r} and rank 0 of the group (its "
                    f"integers or Python numbers, compared exactly, differ in value or "
                    f"order); every rank must pass the same full inputs to the transformer"
                )
            if what:
                raise ValueError(
                    f"{name} has different contents on rank {r} and rank 0 of the group (sum |x| "
                    f"{float(mine[FP_SHAPE]):.6g} vs {float(theirs[FP_SHAPE]):.6g}); every rank "
                    f"must pass the same full inputs (same seed, same prompt) to the transformer"
                )


def _forward_pre_hook(rt: Runtime):
    def hook(model, args, kwargs):
        spec = rt.spec
        rt.shard = None
        try:
            # The class's signature, not the instance's: offloading wrappers (accelerate's
            # cpu_offload) replace model.forward by a (*args, **kwargs) function.
            bound = inspect.signature(type(model).forward).bind(model, *args, **kwargs)
        except TypeError as exc:
            raise TypeError(f"{type(model).__name__}.forward: {exc}") from None
        arguments = bound.arguments
        grad = torch.is_grad_enabled() and any(p.requires_grad for p in model.parameters())
        # W: every rank that shares the sequence (R*U with a mesh); U: the all-to-all's ranks,
        # which need one folded (sample, head) pair each.
        groups = parallel_groups(mesh=rt.mesh, group=rt.group)
        rt.world_size = groups.world
        cache = type(getattr(model, "_cache_config", None)).__name__
        if rt.world_size > 1 and cache in _PER_RANK_CACHES:
            raise ValueError(
                f"the transformer has a {cache} cache (enable_cache), which decides from each "
                f"rank's shard of the activations whether to skip blocks; ranks could decide "
                f"differently and wait forever; disable it (transformer.disable_cache()) or use "
                f"one that follows the step schedule"
            )
        # The cross-rank comparison comes before the model's own input checks: inputs that are
        # bad on one rank only would otherwise raise there and leave its peers waiting in the
        # first all-to-all; after it, the inputs are the same everywhere, so every check below
        # raises on every rank alike.
        if rt.world_size > 1:
            device = next(model.parameters()).device  # NCCL needs the compute device
            # grad mode travels with the fingerprints: one rank with grad enabled raised alone
            # and left its peers in this all-gather
            _check_same_on_all_ranks(rt, arguments, device, grad=grad)
        elif grad:
            raise RuntimeError(_FORWARD_ONLY)
        inputs = spec.read_inputs(model, arguments)
        heads = spec.num_heads(model)
        if inputs.batch * heads < groups.ulysses_size:
            raise ValueError(
                f"batch={inputs.batch} samples x num_heads={heads} = {inputs.batch * heads} folded "
                f"heads, fewer than the W={groups.ulysses_size} ranks of {groups.desc}; each rank "
                f"needs one: {too_few_heads_fix(inputs.batch * heads, groups.ulysses_size, pad=False)}"
            )
        rt.plan(inputs.seq_len)
        logger.debug("S=%d tokens over W=%d ranks: %d rows each, %d padding rows", rt.shard.valid_len,
                     rt.world_size, rt.shard.local_len, rt.shard.total_len - rt.shard.valid_len)
        for point in spec.shards:
            if point.module or point.where != "input":
                continue
            x = arguments.get(point.name)
            if isinstance(x, torch.Tensor) and (point.only_if_ndim is None or x.ndim == point.only_if_ndim):
                arguments[point.name] = _cut(rt, x, point)
        return bound.args[1:], bound.kwargs
    return hook


def _forward_hook(rt: Runtime):
    def hook(model, args, output):
        rt.shard = None
    return hook


def _eager(hook):
    """``hook`` kept out of torch.compile. Under ``compile_repeated_blocks`` a block's hooks are
    Dynamo frames of their own, and every hook made by one factory shares one code object: Dynamo
    specialised it on each closure (the argument index, the shard point) and on the step's
    shapes, four cache entries a geometry, so a second geometry hit ``recompile_limit`` (8) and,
    under ``fullgraph``, raised. The hooks slice, check and gather on the host's terms; run
    eagerly between the compiled blocks they cost what they cost before, minus the guards."""
    return torch.compiler.disable(hook, recursive=True)


def install_hooks(rt: Runtime, model: nn.Module) -> None:
    """Registers every hook of ``rt.spec`` on ``model`` (each outside torch.compile: :func:`_eager`);
    their handles go to ``rt.handles``."""
    subs = [(p, sub) for p in rt.spec.shards if p.module for _, sub in _submodules(model, p.module)]
    gathers = [(path, dim, sub) for path, dim in rt.spec.gathers for _, sub in _submodules(model, path)]
    hs = rt.handles
    hs.append(model.register_forward_pre_hook(_eager(_forward_pre_hook(rt)), with_kwargs=True))
    for point, sub in subs:
        if point.where == "output":
            hs.append(sub.register_forward_hook(_eager(_output_hook(rt, point))))
        else:
            hs.append(sub.register_forward_pre_hook(_eager(_input_hook(rt, point)), with_kwargs=True))
    for path, dim, sub in gathers:
        hs.append(sub.register_forward_hook(_eager(_gather_hook(rt, path, dim))))
    # always_call: a forward that raised must not leave its plan for the next call.
    hs.append(model.register_forward_hook(_eager(_forward_hook(rt)), always_call=True))
