"""Training step time at one rank: no communication, PyTorch DDP and commsched's two modes, plus torch.compile.

    python benchmarks/gpu_step_time.py                           # one NVIDIA GPU (gpu_check.py section (e))
    python benchmarks/gpu_step_time.py --device cpu --quick      # a dry run on the CPU: tiny models, Gloo

Models: ResNet-50 (batch 64) and ViT-B/16 (batch 32), from torchvision when it is installed, else
replicas with the same parameter tensors (step_time_models.py), and a GPT-2-small-shaped
``transformers`` GPT2LMHeadModel built from GPT2Config() (8 x 512 tokens; skipped, with a note,
when transformers is missing). bf16 autocast on the GPU, SGD with momentum, synthetic data. Each
variant runs in a process of its own (this script with --worker), so no allocator, cuDNN choice
or process group leaks from one into the next. A variant's time is the median over windows of
steps after a warmup, with torch.cuda.synchronize() around each window; commsched's launches and
fused launches per step come from commsched.stats() before and after the windows.

The torch.compile rows train a small compiled MLP through commsched (barrier mode, judged: the
losses must equal an eager model's under a plain optimizer; overlap mode, reported only).
Targets (reported, never judged): commsched within 2% of DDP in both modes, and at most
max(8, parameter tensors / 16) launches per step. Table on stdout, JSON at --out.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

# Beside this file: the script's folder is on sys.path.
from step_time_models import (
    Unavailable,
    build,
    missing,
    package_version,
    parameter_tensors,
)

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("resnet50", "vit_b_16", "gpt2")
VARIANTS = ("no-comm", "ddp", "barrier", "overlap")
COMPILE_MODES = ("barrier", "overlap")
LABELS = {
    "no-comm": "no communication",
    "ddp": "DDP",
    "barrier": "commsched barrier",
    "overlap": "commsched overlap",
}
WITHIN = 1.02  # commsched's target: at most 2% slower than DDP
COMPILE_STEPS = 5
# Eager and compiled kernels may round differently on a GPU (fused pointwise ops); on the CPU with
# aot_eager the kernels are eager's own, so the losses must agree to float32 rounding.
COMPILE_TOLERANCE = {"cuda": 1e-4, "cpu": 1e-5}
# A worker normally takes 10-30 s (inductor's first compile up to a minute); a hung one must not eat
# the GPU session.
WORKER_TIMEOUT_S = {"full": 180, "quick": 120}
# Errors of torch.compile's backend, not of commsched: the compile rows retry with aot_eager.
BACKEND_FAILURES = ("BackendCompilerFailed", "InductorError", "CppCompileError", "CUDACompileError")

Row = dict[str, Any]


def launch_target(parameters: int) -> float:
    """The most launches per step the plug-in may use for a model with this many parameter tensors."""
    return max(8.0, parameters / 16)


# -- the worker: one variant in this process -----------------------------------------------------
def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _synchronize(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _failure(error: BaseException) -> dict[str, Any]:
    """The error's first line, and where it was raised in this repository (innermost frames last)."""
    frames = [
        f"{Path(f.filename).relative_to(ROOT)}:{f.lineno} in {f.name}"
        for f in traceback.extract_tb(error.__traceback__)
        if f.filename.startswith(str(ROOT))
        and not any(part in f.filename for part in ("site-packages", "benchmarks"))
    ]
    first = (str(error).strip().split("\n") or [""])[0]
    return {"error": f"{type(error).__name__}: {first}"[:600], "where": frames[-4:]}


def run_variant(args: argparse.Namespace) -> dict[str, Any]:
    """Times one (model, variant) pair; returns its row."""
    import torch

    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cudnn.benchmark = True
    torch.manual_seed(0)
    module, loss_of, source = build(args.model, args.quick, device)
    row: dict[str, Any] = {"source": source, "parameters": parameter_tensors(module)}
    row["elements"] = sum(p.numel() for p in module.parameters() if p.requires_grad)
    model = module
    if args.variant == "ddp":
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        # One rank of an env:// rendezvous, as torchrun would describe it.
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1")
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            dist.init_process_group(backend, device_id=device)
            model = DistributedDataParallel(module, device_ids=[device.index])
        else:
            dist.init_process_group(backend)
            model = DistributedDataParallel(module)
        row["ddp_backend"] = backend
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    commsched_variant = args.variant in ("barrier", "overlap")
    if commsched_variant:
        import commsched.torch as ct

        import commsched

        optimizer = ct.DistributedOptimizer(
            optimizer, model=module, overlap_forward=args.variant == "overlap"
        )
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    def step() -> Any:
        optimizer.zero_grad(set_to_none=True)
        with autocast:
            loss = loss_of(model)
        loss.backward()
        optimizer.step()
        return loss

    for _ in range(args.warmup):
        step()
    _synchronize(device)
    before = commsched.stats() if commsched_variant else {}
    window_ms: list[float] = []
    loss = None
    for _ in range(args.windows):
        _synchronize(device)
        started = time.perf_counter()
        for _ in range(args.steps):
            loss = step()
        _synchronize(device)
        window_ms.append((time.perf_counter() - started) * 1e3 / args.steps)
    steps = args.windows * args.steps
    if commsched_variant:
        after = commsched.stats()
        row["launches_per_step"] = (after.get("launches", 0) - before.get("launches", 0)) / steps
        row["fused_per_step"] = (after.get("fused_launches", 0) - before.get("fused_launches", 0)) / steps
        row["buckets"] = len(optimizer.buckets()) if hasattr(optimizer, "buckets") else None
        optimizer.synchronize()
        row["transport"] = commsched.config().get("transport")
    row["ms"] = window_ms
    row["last_loss"] = float(loss.detach().float().item()) if loss is not None else None
    if args.variant == "ddp":
        import torch.distributed as dist

        dist.destroy_process_group()
    return row


def run_compile(args: argparse.Namespace) -> dict[str, Any]:
    """Trains a small torch.compile'd MLP through commsched and an eager copy under a plain optimizer."""
    import copy

    import commsched.torch as ct
    import torch
    import torch.nn.functional as F

    import commsched

    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        # TF32 would round eager and compiled matmuls differently from float32 and from each other.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    mode = args.variant.removeprefix("compile-")
    torch.manual_seed(0)
    layers = [torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 256), torch.nn.GELU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(256, 10)).to(device)
    reference = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(2)
    xs = torch.randn(COMPILE_STEPS, 32, 64, generator=generator).to(device)
    ys = torch.randint(0, 10, (COMPILE_STEPS, 32), generator=generator).to(device)

    def train(net: Any, optimizer: Any) -> list[float]:
        losses = []
        for x, y in zip(xs, ys):
            optimizer.zero_grad()
            loss = F.cross_entropy(net(x), y)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        return losses

    def sgd(net: Any) -> Any:
        return torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)

    row: dict[str, Any] = {"mode": mode, "backend": args.compile_backend, "steps": COMPILE_STEPS}
    row["eager_losses"] = train(reference, sgd(reference))
    compiled = torch.compile(model, backend=args.compile_backend)
    started = time.perf_counter()
    try:
        # model= is the module itself: its hooks measure the order and, in overlap mode, wait per layer.
        optimizer = ct.DistributedOptimizer(sgd(model), model=model, overlap_forward=mode == "overlap")
        row["losses"] = train(compiled, optimizer)
        optimizer.synchronize()
    except Exception as error:  # noqa: BLE001 - reported in the table: this row is there to find out
        row.update(_failure(error))
        return row
    row["seconds"] = round(time.perf_counter() - started, 1)
    row["max_loss_difference"] = max(abs(a - b) for a, b in zip(row["losses"], row["eager_losses"]))
    row["max_parameter_difference"] = max(
        (p - q).abs().max().item() for p, q in zip(model.parameters(), reference.parameters())
    )
    row["launches"] = commsched.stats().get("launches", 0)
    return row


def worker_main(args: argparse.Namespace) -> int:
    """--worker: one variant (or one torch.compile mode) in this process; its row goes to --result."""
    try:
        row = run_compile(args) if args.variant.startswith("compile-") else run_variant(args)
        code = 0
    except Unavailable as reason:
        row, code = {"skipped": str(reason)[:400]}, 0
    except Exception as error:  # noqa: BLE001 - the parent reports it as this row's failure
        traceback.print_exc()
        row, code = _failure(error), 1
    if args.device == "cuda":
        import torch

        try:
            row["device_name"] = torch.cuda.get_device_name(0)
        except RuntimeError as error:  # no usable GPU: the row says why already
            row["device_name"] = f"unavailable: {error}"[:200]
    Path(args.result).write_text(json.dumps(row))
    if args.variant.startswith("compile-") or args.variant in ("barrier", "overlap"):
        import commsched

        if commsched.is_initialized():
            commsched.shutdown()
    return code


# -- the parent: one process per variant, then the table -----------------------------------------
def child_env() -> dict[str, str]:
    """This environment without a surrounding launcher's rank variables, with the repository importable."""
    launcher = ("PMI_", "PMIX_", "OMPI_", "MPI_LOCALRANKID")
    env = {k: v for k, v in os.environ.items() if not k.startswith(launcher)}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    env["PYTHONUNBUFFERED"] = "1"
    # The models are built from configs; nothing may wait on a network the GPU machine does not have.
    env.setdefault("HF_HUB_OFFLINE", "1")
    return env


def _spawn(args: argparse.Namespace, env: dict[str, str], folder: Path, *extra: str) -> dict[str, Any]:
    """Runs this script with --worker and `extra`; its row, or what went wrong."""
    result = Path(tempfile.mkstemp(prefix="row.", suffix=".json", dir=folder)[1])
    result.unlink()  # the worker writes it; one that is there afterwards is this worker's
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", "--result", str(result)]
    command += ["--device", args.device, "--compile-backend", args.compile_backend, *extra]
    command += ["--windows", str(args.windows), "--steps", str(args.steps), "--warmup", str(args.warmup)]
    if args.quick:
        command.append("--quick")
    limit = WORKER_TIMEOUT_S["quick" if args.quick else "full"]
    started = time.perf_counter()
    try:
        done = subprocess.run(
            command, cwd=ROOT, env=env, capture_output=True, text=True, check=False, timeout=limit
        )
    except subprocess.TimeoutExpired:
        row = json.loads(result.read_text()) if result.exists() else {}
        after = " after writing its row" if row else ""
        return {**row, "error": f"the worker did not exit within {limit}s{after}"}
    row: dict[str, Any] = json.loads(result.read_text()) if result.exists() else {}
    row["process_seconds"] = round(time.perf_counter() - started, 1)
    if done.returncode != 0 and "error" not in row:
        row["error"] = f"worker exited {done.returncode}: {(done.stdout + done.stderr)[-600:]}"
    return row


def _summarise(rows: list[Row]) -> None:
    """Median, range, ratio to DDP and the targets, for the rows of one model."""
    for row in rows:
        if row.get("ms"):
            row.update(median_ms=statistics.median(row["ms"]), min_ms=min(row["ms"]), max_ms=max(row["ms"]))
    ddp = next((r.get("median_ms") for r in rows if r["variant"] == "ddp"), None)
    for row in rows:
        median = row.get("median_ms")
        row["vs_ddp"] = median / ddp if median is not None and ddp else None
        if row["variant"] in ("barrier", "overlap") and median is not None:
            row["launch_target"] = launch_target(row["parameters"])
            row["within_2pct_of_ddp"] = row["vs_ddp"] <= WITHIN if row["vs_ddp"] is not None else None
            row["launches_within_target"] = row["launches_per_step"] <= row["launch_target"]


def _git_commit() -> str | None:
    try:
        done = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False
        )
    except OSError:  # no git on the machine
        return None
    return (done.stdout.strip() or None) if done.returncode == 0 else None


def _compile_row(args: argparse.Namespace, env: dict[str, str], folder: Path, mode: str) -> Row:
    """One torch.compile row: its worker, retried with aot_eager where the backend itself broke."""
    row = {"mode": mode, **_spawn(args, env, folder, "--variant", f"compile-{mode}")}
    if row.get("error", "").startswith(BACKEND_FAILURES) and args.compile_backend != "aot_eager":
        # The backend itself (a compiler, Triton) is broken here: say so, and still find out
        # whether commsched trains a compiled model, with the backend that needs neither.
        problem = f"{args.compile_backend} failed: {row['error'][:300]}"
        retry = ("--variant", f"compile-{mode}", "--compile-backend", "aot_eager")  # the last wins
        row = {"mode": mode, **_spawn(args, env, folder, *retry), "backend_problem": problem}
    row["tolerance"] = COMPILE_TOLERANCE[args.device]
    # Barrier mode is judged; overlap mode is reported (see the module docstring).
    row["judged"] = mode == "barrier"
    difference = row.get("max_loss_difference")
    row["passed"] = "error" not in row and difference is not None and difference <= row["tolerance"]
    return row


def _variant_row(
    args: argparse.Namespace, env: dict[str, str], folder: Path, model: str, variant: str
) -> Row:
    """One (model, variant) row from its worker, its progress line on stderr."""
    row = {
        "model": model,
        "variant": variant,
        **_spawn(args, env, folder, "--model", model, "--variant", variant),
    }
    if not row.get("skipped"):
        _report_progress(row)
    return row


def run_all(args: argparse.Namespace) -> dict[str, Any]:
    """Every requested model x variant and the torch.compile rows, each in its own process."""
    env = child_env()
    result: dict[str, Any] = {
        "device": args.device,
        "quick": args.quick,
        "windows": args.windows,
        "steps": args.steps,
        "warmup": args.warmup,
        "jobs": args.jobs,
        "environment": {
            "date": time.strftime("%Y-%m-%d"),
            "commit": _git_commit(),
            **{p: package_version(p) for p in ("torch", "torchvision", "transformers")},
            "settings": {k: v for k, v in sorted(env.items()) if k.startswith("COMMSCHED_")},
        },
        "rows": [],
        "compile": [],
    }
    models = [m for m in args.models if not missing(m)]
    cells = [(m, v) for m in models for v in args.variants]
    modes = [] if args.skip_compile else list(COMPILE_MODES)
    with tempfile.TemporaryDirectory(prefix="gpu_step_time.") as scratch:
        folder = Path(scratch)
        # --jobs > 1 (CPU dry runs only) runs workers side by side: their times then share the cores.
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            variant_rows = [pool.submit(_variant_row, args, env, folder, m, v) for m, v in cells]
            compile_rows = [pool.submit(_compile_row, args, env, folder, mode) for mode in modes]
            done = dict(zip(cells, (f.result() for f in variant_rows)))
            result["compile"] = [f.result() for f in compile_rows]
    for model in args.models:
        reason = missing(model)
        rows = [done[(model, v)] for v in args.variants] if not reason else []
        # Found out in a worker: the model cannot be built here, so its row says why, once.
        reason = reason or next((r["skipped"] for r in rows if r.get("skipped")), None)
        if reason:
            result["rows"].append({"model": model, "variant": None, "skipped": reason})
            continue
        _summarise(rows)
        result["rows"] += rows
    names = [r.get("device_name") for r in result["rows"] + result["compile"] if r.get("device_name")]
    result["environment"]["device_name"] = names[0] if names else args.device
    broken = [r for r in result["rows"] if not r.get("skipped") and "error" in r]
    misjudged = [r for r in result["compile"] if r["judged"] and not r["passed"]]
    result["passed"] = not broken and not misjudged
    return result


def _report_progress(row: Row) -> None:
    state = f"error: {row['error'][:200]}" if "error" in row else f"{row.get('process_seconds')} s"
    print(f"  ... {row['model']} {row['variant']}: {state}", file=sys.stderr, flush=True)


def _number(value: float | None, form: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, form)


def table_lines(result: dict[str, Any]) -> list[str]:
    """The report as text lines (gpu_check.py prints them as its section (e))."""
    mark = {True: "met", False: "MISSED", None: "-"}
    env = result["environment"]
    quick = " (--quick: tiny models)" if result["quick"] else ""
    jobs = result.get("jobs", 1)
    side_by_side = f", {jobs} at a time" if jobs > 1 else ""
    heading = (
        f"one rank on {env['device_name']}{quick}, median of {result['windows']} windows x {result['steps']} "
        f"steps after {result['warmup']} warmup steps, each variant in its own process{side_by_side}; "
        f"commit {env['commit']}, {env['date']}"
    )
    columns = (
        f"  {'model':10} {'variant':18} {'median ms':>10} {'range ms':>17} {'vs DDP':>7} "
        f"{'launches/step':>14} {'fused/step':>11}"
    )
    lines = [heading, columns]
    models: dict[str, list[Row]] = {}
    for row in result["rows"]:
        models.setdefault(row["model"], []).append(row)
    for model, rows in models.items():
        for row in rows:
            if row.get("skipped"):
                lines.append(f"  {model:10} skipped: {row['skipped']}")
                continue
            label = LABELS[row["variant"]]
            if "error" in row:
                where = f" (at {row['where'][-1]})" if row.get("where") else ""
                lines.append(f"  {model:10} {label:18} FAIL {row['error'][:300]}{where}")
                continue
            spread = f"{row['min_ms']:.2f}-{row['max_ms']:.2f}"
            lines.append(
                f"  {model:10} {label:18} {row['median_ms']:>10.2f} {spread:>17} "
                f"{_number(row.get('vs_ddp'), '.3f'):>7} {_number(row.get('launches_per_step'), '.1f'):>14} "
                f"{_number(row.get('fused_per_step'), '.1f'):>11}"
            )
        timed = [r for r in rows if r.get("launch_target") is not None]
        first = next((r for r in rows if r.get("parameters")), None)
        if first is not None:
            targets = "; ".join(
                f"{r['variant']}: within 2% of DDP {mark[r['within_2pct_of_ddp']]}, "
                f"launches <= {r['launch_target']:.1f} {mark[r['launches_within_target']]}"
                for r in timed
            )
            lines.append(
                f"  {'':10} {first['parameters']} parameter tensors, {first['source']}"
                + (f"; {targets}" if targets else "")
            )
    for row in result["compile"]:
        judged = "" if row["judged"] else " (reported, not judged)"
        verdict = "PASS" if row["passed"] else "FAIL"
        if "error" in row:
            where = f" at {' <- '.join(reversed(row['where']))}" if row.get("where") else ""
            detail = f"{row['error'][:240]}{where}"
        else:
            detail = (
                f"max loss difference {row['max_loss_difference']:.2e} over {row['steps']} steps "
                f"(tolerance {row['tolerance']:.0e}), {row['launches']} launches"
            )
        if row.get("backend_problem"):
            detail += f"; {row['backend_problem'][:200]}"
        lines.append(
            f"  torch.compile ({row.get('backend')}), commsched {row['mode']}: {verdict}{judged} {detail}"
        )
    lines.append(
        "  targets (reported, never judged): commsched within 2% of DDP in both modes; "
        "launches per step <= max(8, parameter tensors / 16)"
    )
    return lines


def main() -> int:
    """Parses the arguments; runs one worker, or every worker and the table."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--quick", action="store_true", help="tiny models, 2 windows x 2 steps: a dry run")
    parser.add_argument("--out", default="out/gpu_step_time.json", help="where the JSON goes")
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {','.join(MODELS)}")
    parser.add_argument(
        "--variants", default=",".join(VARIANTS), help=f"comma-separated, of {','.join(VARIANTS)}"
    )
    parser.add_argument("--windows", type=int, default=None, help="timed windows (default 5; --quick 2)")
    parser.add_argument("--steps", type=int, default=None, help="steps per window (default 10; --quick 2)")
    parser.add_argument(
        "--warmup", type=int, default=None, help="untimed steps first (default 10; --quick 2)"
    )
    parser.add_argument(
        "--compile-backend",
        default=None,
        help="torch.compile backend of the compile rows (default inductor; aot_eager on the CPU, where "
        "inductor spends half a minute in the C++ compiler on a model that only checks the plumbing)",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="workers at once (default 1); more only with --device cpu, a dry run whose times are not judged",
    )
    parser.add_argument("--skip-compile", action="store_true", help="leave out the torch.compile rows")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    quick = args.quick
    args.windows = args.windows or (2 if quick else 5)
    args.steps = args.steps or (2 if quick else 10)
    args.warmup = args.warmup if args.warmup is not None else (2 if quick else 10)
    args.compile_backend = args.compile_backend or ("inductor" if args.device == "cuda" else "aot_eager")
    if args.worker:
        return worker_main(args)
    args.models = [m for m in args.models.split(",") if m]
    args.variants = [v for v in args.variants.split(",") if v]
    if args.jobs < 1 or (args.jobs > 1 and args.device != "cpu"):
        parser.error(
            f"--jobs {args.jobs}: give 1, or more only with --device cpu (workers side by side share "
            "the device, so their times would not be the variants' own)"
        )
    unknown = sorted(set(args.models) - set(MODELS)) + sorted(set(args.variants) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown model or variant: {', '.join(unknown)}")
    result = run_all(args)
    out = Path(args.out)
    result["out"] = str(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print("\n".join(table_lines(result)))
    print(f"step time: {'PASS' if result['passed'] else 'FAIL'}  (JSON: {out})")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
