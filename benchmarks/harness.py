# SPDX-License-Identifier: Apache-2.0
"""Shared helpers of the dist_attn benchmarks: what ran, how it was timed, where results go.

Every benchmark script records the full config, library versions, GPU name and date, and writes
``<theme>_<hardware>_<YYYY-MM-DD>.{json,md,png}`` (torchtitan's ``benchmarks/README.md`` naming).
Timing is warm-up then median of N: CUDA events around each iteration on GPU (no host sync inside
the timed region), ``time.perf_counter`` on CPU, or wall clock with a device sync on both sides
when the timed work includes host-side communication (gloo collectives).

Nothing here may crash a benchmark: a kernel that cannot run becomes a row with its reason, a
plot that cannot be drawn becomes a placeholder PNG plus a note, and a ``--budget-s`` deadline
turns the remaining measurements into ``skipped`` rows.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.metadata
import json
import math
import os
import platform
import re
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch

from dist_attn.distributed import DistEnv
from dist_attn.distributed import init_distributed as init_dist_attn

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

__all__ = [
    "DEFAULT_OUT_DIR",
    "H3_REF",
    "Budget",
    "DistContext",
    "ResultWriter",
    "Timing",
    "add_common_args",
    "device_timeline_ms",
    "given_options",
    "smoke_values",
    "attention_tflops",
    "collect_versions",
    "describe_exception",
    "gpu_name",
    "hardware_tag",
    "init_distributed",
    "kernel_table",
    "markdown_table",
    "time_fn",
    "utc_now",
]

DEFAULT_OUT_DIR = os.path.join(_REPO, "benchmarks", "results")

#: The reference workload (h3-ref): one H3 denoise step's packed attention, one document padded
#: to a multiple of 64 rows.
H3_REF = {"used": 37_980, "total": 38_016, "heads": 56, "head_dim": 128, "dtype": "bfloat16"}


# ---------------------------------------------------------------------------------------------
# what ran
# ---------------------------------------------------------------------------------------------
def utc_now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        pass
    except Exception:  # a broken metadata dir must not stop a benchmark
        pass
    try:
        return str(getattr(importlib.import_module(name), "__version__", None) or "") or None
    except Exception:
        return None


def _git_commit() -> str | None:
    # A copy run elsewhere (e.g. a `git archive` snapshot on a GPU host) may sit inside another
    # checkout whose HEAD is not what ran: the caller then names the commit.
    if os.environ.get("DIST_ATTN_COMMIT"):
        return os.environ["DIST_ATTN_COMMIT"]
    try:
        out = subprocess.run(["git", "-C", _REPO, "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=5)
        commit = out.stdout.strip()
        if not commit:
            return None
        dirty = subprocess.run(["git", "-C", _REPO, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return commit + ("+dirty" if dirty else "")
    except Exception:
        return None


def collect_versions() -> dict[str, Any]:
    """Versions of everything a number depends on (None = not installed)."""
    try:
        import dist_attn

        da = getattr(dist_attn, "__version__", None)
    except Exception as exc:  # noqa: BLE001
        da = f"import failed: {describe_exception(exc)}"
    cudnn = None
    try:
        cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    except Exception:
        pass
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": cudnn,
        "triton": _dist_version("triton"),
        "sageattention": _dist_version("sageattention"),
        "torchao": _dist_version("torchao"),  # FP8 linears (the fp8 extra)
        "dist_attn": da,
        "dist_attn_commit": _git_commit(),
        "numpy": _dist_version("numpy"),
        "matplotlib": _dist_version("matplotlib"),
    }


def gpu_name(device: torch.device | None = None) -> str:
    """The GPU's marketing name, or ``"cpu"``."""
    if device is not None and device.type != "cuda":
        return "cpu"
    if not torch.cuda.is_available():
        return "cpu"
    try:
        return torch.cuda.get_device_name(device)
    except Exception:
        return "cuda (name unavailable)"


_KNOWN_GPUS = ("gh200", "h200", "h100", "h20", "b200", "b100", "gb200", "a100", "a10g", "l40s",
               "l40", "l4", "a6000", "4090", "3090", "v100", "t4", "mi300x", "mi250")


def hardware_tag(name: str) -> str:
    """Short file-name tag of a GPU name: ``"NVIDIA H200" -> "h200"``, ``"cpu" -> "cpu"``."""
    low = name.lower()
    for tag in _KNOWN_GPUS:
        if re.search(rf"(?<![a-z0-9]){tag}(?![0-9])", low):
            return tag
    return re.sub(r"[^a-z0-9]+", "-", low).strip("-") or "unknown"


def describe_exception(exc: BaseException) -> str:
    msg = str(exc).strip().splitlines()
    first = msg[0] if msg else ""
    return f"{type(exc).__name__}: {first[:300]}"


def attention_tflops(n_rows: int, heads: int, head_dim: int, ms: float | None) -> float | None:
    """TFLOP/s-equivalent of non-causal attention: 4 * N^2 * H * D / time (2 GEMMs of 2*N^2*D per head)."""
    if not ms or ms <= 0 or not math.isfinite(ms):
        return None
    return 4.0 * n_rows * n_rows * heads * head_dim / (ms * 1e-3) / 1e12


# ---------------------------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------------------------
class Budget:
    """A wall-time budget for the whole script (``--budget-s``); None or <= 0 = unlimited."""

    def __init__(self, seconds: float | None) -> None:
        self.seconds = seconds if seconds and seconds > 0 else None
        self.start = time.monotonic()
        self.deadline = None if self.seconds is None else self.start + self.seconds

    def left(self) -> float:
        return math.inf if self.deadline is None else self.deadline - time.monotonic()

    def expired(self, reserve_s: float = 0.0) -> bool:
        return self.left() <= reserve_s

    def elapsed(self) -> float:
        return time.monotonic() - self.start


@dataclass
class Timing:
    """Milliseconds per call over the timed iterations."""

    median_ms: float
    min_ms: float
    max_ms: float
    iters: int
    method: str

    def as_dict(self) -> dict[str, Any]:
        return {"median_ms": self.median_ms, "min_ms": self.min_ms, "max_ms": self.max_ms,
                "iters": self.iters, "timing": self.method}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_fn(fn: Callable[[], Any], *, device: torch.device, iters: int, warmup: int,
            budget: Budget | None = None, method: str = "auto",
            barrier: Callable[[], None] | None = None, min_iters: int = 1) -> Timing:
    """Warm-up, then ``iters`` timed calls of ``fn``; returns their median.

    Args:
        fn: the work, a no-argument callable.
        device: where the work runs (CUDA -> events or synced wall clock; CPU -> perf_counter).
        iters, warmup: timed and untimed calls.
        budget: stops timing early (after at least ``min_iters`` calls) once it is spent.
        method: ``"events"`` (CUDA events per call, one sync at the end), ``"wall"`` (device sync
            and optional ``barrier`` before each call, perf_counter around call + sync: use it
            when host-side communication is part of the work), or ``"auto"`` (events on CUDA,
            wall on CPU).
        barrier: called before every timed call in ``"wall"`` mode (aligns ranks).
    """
    if method == "auto":
        method = "events" if device.type == "cuda" else "wall"
    for _ in range(max(0, warmup)):
        fn()
        if budget is not None and budget.expired():
            break
    _sync(device)
    times: list[float] = []
    if method == "events":
        pairs = []
        for i in range(max(1, iters)):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            pairs.append((s, e))
            if budget is not None and i + 1 >= min_iters and budget.expired():
                break
        torch.cuda.synchronize(device)
        times = [s.elapsed_time(e) for s, e in pairs]
    else:
        for i in range(max(1, iters)):
            if barrier is not None:
                barrier()
            _sync(device)
            t0 = time.perf_counter()
            fn()
            _sync(device)
            times.append((time.perf_counter() - t0) * 1e3)
            if budget is not None and i + 1 >= min_iters and budget.expired():
                break
    return Timing(median_ms=statistics.median(times), min_ms=min(times), max_ms=max(times),
                  iters=len(times), method="cuda-events" if method == "events" else
                  ("wall+sync" if device.type == "cuda" else "perf_counter"))


# ---------------------------------------------------------------------------------------------
# distributed setup (torchrun or a single process)
# ---------------------------------------------------------------------------------------------
@dataclass
class DistContext:
    """The rank's :class:`dist_attn.DistEnv` plus what a benchmark needs on top of it."""

    env: DistEnv
    note: str = ""

    rank = property(lambda self: self.env.rank)
    world = property(lambda self: self.env.world_size)
    local_rank = property(lambda self: self.env.local_rank)
    device = property(lambda self: self.env.device)
    shared_gpu = property(lambda self: self.env.shared_gpu)

    @property
    def backend(self) -> str:
        """The process-group backend ("gloo", "nccl"), or "none" without a group."""
        if torch.distributed.is_initialized():
            return torch.distributed.get_backend()
        return "none"

    def barrier(self) -> None:
        if torch.distributed.is_initialized():
            torch.distributed.barrier()

    def gather(self, obj: Any) -> list[Any]:
        """``obj`` of every rank, by rank (a list of one outside torchrun)."""
        if not torch.distributed.is_initialized() or self.world == 1:
            return [obj]
        out: list[Any] = [None] * self.world
        torch.distributed.all_gather_object(out, obj)
        return out


def kernel_table(fn: Callable[[], Any], device: torch.device, *, calls: int = 3,
                 top: int = 12) -> list[dict[str, Any]]:
    """Where ``fn``'s time goes: torch.profiler over ``calls`` calls (after the caller's warm-up),
    the ``top`` kernels (CPU ops off CUDA) by self time, each with its calls and ms per ``fn``
    call and its share of the total."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            fn()
        _sync(device)
    attr = "self_device_time_total" if cuda else "self_cpu_time_total"
    events = [e for e in prof.key_averages() if getattr(e, attr, 0) > 0]
    total = sum(getattr(e, attr) for e in events) or 1.0
    events.sort(key=lambda e: getattr(e, attr), reverse=True)
    return [{"kernel": e.key[:100], "calls": e.count / calls,
             "ms": getattr(e, attr) / 1e3 / calls, "share": getattr(e, attr) / total}
            for e in events[:top]]


def device_timeline_ms(fn: Callable[[], Any], device: torch.device, *,
                       calls: int = 3) -> tuple[float, float | None]:
    """``(busy, idle)`` ms per call of ``fn`` from ONE torch.profiler run of ``calls`` back-to-back
    calls (after the caller's warm-up): ``busy``, the time some kernel ran (the union of their
    intervals); ``idle``, the time between the first kernel's start and the last one's end that
    none ran (launch gaps, host waits). Both from the same run: an unprofiled wall time beside a
    profiled kernel sum differs by a few percent either way (clocks), which is not waiting.
    CPU: ``busy`` is the CPU time of its ops, ``idle`` None."""
    from torch.profiler import ProfilerActivity, profile

    if device.type != "cuda":
        return sum(k["ms"] for k in kernel_table(fn, device, calls=calls, top=10 ** 6)), None
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        _sync(device)
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA and not e.is_user_annotation)
    if not spans:
        return 0.0, 0.0
    busy, (lo, hi) = 0, spans[0]
    for a, b in spans[1:]:
        if a > hi:
            busy, lo = busy + hi - lo, a
        hi = max(hi, b)
    busy += hi - lo
    window = max(b for _, b in spans) - spans[0][0]
    return busy / 1e3 / calls, (window - busy) / 1e3 / calls


def init_distributed(backend: str = "auto", device: str = "auto", *,
                     single_process_group: bool = False) -> DistContext:
    """:func:`dist_attn.init_distributed`, plus a 1-rank gloo group when a single process still
    needs collectives (``single_process_group``, or a 1-process torchrun)."""
    import torch.distributed as dist

    env = init_dist_attn(backend=backend, device=device)
    if env.world_size == 1 and (single_process_group or "RANK" in os.environ) and not dist.is_initialized():
        path = tempfile.mktemp(prefix="dist_attn_bench_store_")
        dist.init_process_group("gloo", store=dist.FileStore(path, 1), rank=0, world_size=1)
    return DistContext(env=env)


# ---------------------------------------------------------------------------------------------
# results
# ---------------------------------------------------------------------------------------------
def int_at_least(low: int):
    """An argparse ``type=`` for ints >= ``low``."""
    def parse(text: str) -> int:
        n = int(text)
        if n < low:
            raise argparse.ArgumentTypeError(f"{n} must be >= {low}")
        return n
    return parse


def _non_negative_float(text: str) -> float:
    x = float(text)
    if not x >= 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"{text} must be >= 0")
    return x


def _name_part(text: str) -> str:
    if not text or "/" in text or os.sep in text:
        raise argparse.ArgumentTypeError(f"{text!r} must be a non-empty file-name part (no '/')")
    return text


def _device(text: str) -> str:
    if text not in ("auto", "cuda", "cpu"):
        raise argparse.ArgumentTypeError(f"{text!r} is not one of 'auto', 'cuda', 'cpu'")
    if text == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(
            f"'cuda' asked for, but torch.cuda.is_available() is False (torch {torch.__version__}); "
            "use --device cpu, or auto")
    return text


def add_common_args(parser: argparse.ArgumentParser, *, iters: int, warmup: int,
                    budget_s: float) -> None:
    g = parser.add_argument_group("common benchmark options")
    g.add_argument("--smoke", action="store_true",
                   help="tiny shapes that run on CPU in seconds (CI); results are not for committing. "
                        "Options left at their defaults take small values; ones given are kept")
    g.add_argument("--out", default=None,
                   help=f"output folder (default {os.path.relpath(DEFAULT_OUT_DIR, _REPO)}; with "
                        "--smoke a fresh temp folder)")
    g.add_argument("--iters", type=int_at_least(1), default=iters,
                   help="timed iterations (median is reported)")
    g.add_argument("--warmup", type=int_at_least(0), default=warmup,
                   help="untimed iterations first")
    g.add_argument("--budget-s", type=_non_negative_float, default=budget_s,
                   help="wall-time budget of the whole script; measurements left when it is spent "
                        "are recorded as skipped rows (0 = unlimited)")
    g.add_argument("--device", type=_device, default="auto",
                   help="auto, cuda or cpu (cuda without a GPU is refused, never run on the CPU)")
    g.add_argument("--theme", type=_name_part, default=None,
                   help="override the theme part of the file names")
    g.add_argument("--hardware", type=_name_part, default=None,
                   help="override the hardware part of the file names")


def given_options(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> set[str]:
    """The destinations ``argv`` (None: ``sys.argv[1:]``) sets on the command line, whatever their
    values: ``parser`` reparsed with every default suppressed, ``set_defaults`` ones too (then
    restored). For parsers without mutually exclusive groups: a reparse there can refuse an
    ``argv`` the first parse took (argparse tells a given value equal to the default apart only
    with the defaults in place)."""
    saved = [(action, action.default) for action in parser._actions]
    saved_defaults = dict(parser._defaults)
    try:
        for action, _ in saved:
            action.default = argparse.SUPPRESS
        parser._defaults.clear()
        given, _ = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    finally:
        for action, default in saved:
            action.default = default
        parser._defaults.update(saved_defaults)
    return set(vars(given))


def smoke_values(parser: argparse.ArgumentParser, args: argparse.Namespace,
                 argv: list[str] | None = None, **values) -> None:
    """With ``--smoke``: each named option the command line ``argv`` (None: ``sys.argv[1:]``)
    did not set takes the smoke value given here; one it set keeps its value, the default's too
    (``--smoke --iters 5`` times 5 iterations)."""
    dests = {action.dest for action in parser._actions}
    unknown = sorted(set(values) - dests)
    if unknown:
        raise AttributeError(f"smoke_values: {unknown[0]!r} is not an option of this parser")
    if not args.smoke:
        return
    given = given_options(parser, argv)
    for name, value in values.items():
        if name not in given:
            setattr(args, name, value)


def refuse_unhonoured(parser: argparse.ArgumentParser, args: argparse.Namespace, *,
                      smoke_on_cpu: bool = False, cpu_only: bool = False,
                      device_unused: bool = False, no_budget: bool = False) -> None:
    """Exits with a usage error when a common flag would be ignored, never run otherwise:
    ``--device cuda`` where the benchmark runs on the CPU (always, or with ``--smoke``), any
    ``--device`` where it chooses none (a server it starts does), and ``--budget-s`` where nothing
    is budgeted."""
    if device_unused and args.device != "auto":
        parser.error(f"--device {args.device} would not be honoured: this benchmark chooses no "
                     "device (the server it starts does)")
    if args.device == "cuda" and (cpu_only or (smoke_on_cpu and args.smoke)):
        parser.error("--device cuda would not be honoured: this benchmark runs on the CPU"
                     + (" with --smoke (drop --smoke to run on the GPU)" if not cpu_only else ""))
    if no_budget and args.budget_s:
        parser.error(f"--budget-s {args.budget_s:g} would not be honoured: this benchmark has no "
                     "budget to spend")


def resolve_out_dir(args: argparse.Namespace) -> str:
    if args.out:
        return os.path.abspath(args.out)
    if args.smoke:
        return tempfile.mkdtemp(prefix="dist_attn_bench_smoke_")
    return DEFAULT_OUT_DIR


def markdown_table(rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str, str]]) -> str:
    """A GitHub markdown table; ``columns`` = (row key, header, format spec such as ``".2f"``)."""
    def cell(row, key, fmt):
        val = row.get(key)
        if val is None or (isinstance(val, float) and not math.isfinite(val)):
            return ""
        if fmt and isinstance(val, (int, float)) and not isinstance(val, bool):
            try:
                return format(val, fmt)
            except (ValueError, TypeError):
                return str(val)
        return str(val).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(h for _, h, _ in columns) + " |",
             "|" + "|".join("---" for _ in columns) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(cell(row, k, f) for k, _, f in columns) + " |")
    return "\n".join(lines)


def _json_clean(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _json_clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_clean(v) for v in obj]
    if isinstance(obj, (str, int, bool)) or obj is None:
        return obj
    if isinstance(obj, (torch.dtype, torch.device)):
        return str(obj)
    return str(obj)


def _placeholder_png(path: str, width: int = 8, height: int = 8) -> None:
    """A blank grey PNG (written when matplotlib is missing or the plot fails)."""
    raw = b"".join(b"\x00" + b"\xc0" * width for _ in range(height))

    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))

    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))
    with open(path, "wb") as f:
        f.write(png)


class ResultWriter:
    """Collects rows and writes ``<theme>_<hardware>_<date>.{json,md,png}``.

    :meth:`save` may be called after every measurement (JSON + markdown only), so a run killed
    by an outer ``timeout`` still leaves what it measured; :meth:`finish` also draws the PNG.
    """

    def __init__(self, *, theme: str, args: argparse.Namespace, config: dict[str, Any],
                 device: torch.device, out_dir: str | None = None, title: str = "") -> None:
        now = utc_now()
        self.gpu = gpu_name(device)
        self.hardware = args.hardware or hardware_tag(self.gpu)
        self.theme = args.theme or theme
        self.date = now.strftime("%Y-%m-%d")
        self.out_dir = out_dir or resolve_out_dir(args)
        os.makedirs(self.out_dir, exist_ok=True)
        self.stem = os.path.join(self.out_dir, f"{self.theme}_{self.hardware}_{self.date}")
        self.title = title or self.theme
        self.payload: dict[str, Any] = {
            "theme": self.theme,
            "hardware": self.hardware,
            "gpu": self.gpu,
            "date": self.date,
            "timestamp_utc": now.isoformat(timespec="seconds"),
            "versions": collect_versions(),
            "config": config,
            "host": {"node": platform.node(), "cpus": os.cpu_count(),
                     "platform": platform.platform(), "argv": sys.argv,
                     "gpu_capability": (list(torch.cuda.get_device_capability(device))
                                        if device.type == "cuda" else None),
                     "gpu_count": torch.cuda.device_count() if torch.cuda.is_available() else 0},
            "notes": [],
            "rows": [],
        }
        self.sections: list[tuple[str, str]] = []  # (heading, markdown body)
        self._announced = False  # the first save says where the files go when git tracks it

    @property
    def rows(self) -> list[dict[str, Any]]:
        return self.payload["rows"]

    def note(self, text: str) -> None:
        if text not in self.payload["notes"]:
            self.payload["notes"].append(text)

    def paths(self) -> dict[str, str]:
        return {ext: f"{self.stem}.{ext}" for ext in ("json", "md", "png")}

    def save(self, sections: Iterable[tuple[str, str]] | None = None) -> None:
        if sections is not None:
            self.sections = list(sections)
        p = self.paths()
        if not self._announced and os.path.abspath(self.out_dir) == os.path.abspath(DEFAULT_OUT_DIR):
            # the default folder is the repository's tracked results: a run from a laptop or a
            # CPU host (benchmarks.job_model always is one) must not leave files there unsaid
            print(f"[{self.theme}] writing {os.path.basename(self.stem)}.{{json,md,png}} into "
                  f"{os.path.relpath(self.out_dir, _REPO)}/, which git tracks (a run on this "
                  f"{self.gpu} host); commit them, or pass --out DIR to write elsewhere", flush=True)
        self._announced = True
        tmp = p["json"] + ".tmp"
        with open(tmp, "w") as f:
            json.dump(_json_clean(self.payload), f, indent=1, allow_nan=False)
        os.replace(tmp, p["json"])
        v = self.payload["versions"]
        head = [
            f"# {self.title}",
            "",
            f"- date (UTC): {self.payload['timestamp_utc']}",
            f"- GPU: {self.gpu}",
            "- versions: " + ", ".join(f"{k} {v[k]}" for k in v),
            "- config: `" + json.dumps(_json_clean(self.payload["config"]), sort_keys=True) + "`",
            f"- raw rows: `{os.path.basename(p['json'])}`; plot: `{os.path.basename(p['png'])}`",
        ]
        if self.payload["notes"]:
            head += ["", "Notes:", ""] + [f"- {n}" for n in self.payload["notes"]]
        body = []
        for heading, text in self.sections:
            body += ["", f"## {heading}", "", text]
        with open(p["md"], "w") as f:
            f.write("\n".join(head + body) + "\n")

    def finish(self, plot: Callable[[Any], None] | None,
               sections: Iterable[tuple[str, str]] | None = None) -> dict[str, str]:
        """Writes JSON, markdown and the PNG (``plot(plt)`` draws on a fresh figure)."""
        p = self.paths()
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt

            plt.close("all")
            if plot is None:
                raise RuntimeError("no plot for this run")
            plot(plt)
            plt.savefig(p["png"], dpi=110, bbox_inches="tight")
            plt.close("all")
        except Exception as exc:  # noqa: BLE001 - a missing plot must not lose the numbers
            self.note(f"plot not drawn ({describe_exception(exc)}); {os.path.basename(p['png'])} is a "
                      "blank placeholder")
            _placeholder_png(p["png"])
        self.save(sections)
        return p


if __name__ == "__main__":
    raise SystemExit("benchmarks.harness is a module of other benchmarks, with nothing to run by itself; "
                     "run one of the benchmarks in the table of benchmarks/README.md")
