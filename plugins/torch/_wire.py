"""Where a tensor's bytes go: the commsched core, for CPU and CUDA tensors alike.

There is one road. A CUDA gradient is submitted from its grad hook, where torch's current
stream is the one that produced it; commsched records its ordering event on that stream at
submit, so the collective (on commsched's own stream) runs after the kernel that wrote the
gradient, with no host synchronisation. A handle completes only once the GPU finished the
collective, so after wait() any stream, the current one included, may read the result.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import commsched
import torch
from commsched.buffers import torch_current_stream

COMPRESSIONS = {None: None, "none": None, "fp16": torch.float16, "bf16": torch.bfloat16}
_CORE_DTYPES = frozenset(
    {
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.int32,
        torch.int64,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.bool,
    }
)


def compression_dtype(compression: str | None) -> torch.dtype | None:
    """The wire dtype for a compression name; raises ValueError naming the accepted values."""
    if compression not in COMPRESSIONS:
        raise ValueError(f'compression must be None, "fp16" or "bf16", not {compression!r}')
    return COMPRESSIONS[compression]


@dataclass
class Outgoing:
    """One tensor on the wire: `wire` is reduced, then copied back into `target` if they differ.

    A temporary wire (a contiguous or compressed copy, or a copy on the transport's device) is
    allocated on the current stream and then read and written by commsched's stream. The caching
    allocator would hand its block to the next allocation on the current stream as soon as the
    last reference went, even while commsched's stream still used it; ``wire.record_stream()`` is
    the usual cure. It is not needed here: this object (and the handle) hold the wire until
    finish(), and the handle completes only when the GPU finished the collective, so the block is
    never freed while commsched's stream uses it, and its reuse is not delayed past that point.
    """

    target: torch.Tensor
    wire: torch.Tensor
    work: commsched.Handle

    def finish(self, timeout: float | None = None) -> torch.Tensor:
        """Returns `target` holding the reduced values for work queued next on the current stream.

        A CUDA tensor on a GPU waits only until the collective is launched: the current stream then
        waits for it on the GPU (as torch.distributed's Work.wait()), and the host goes on. Anything
        else waits until the collective finished.
        """
        wire = self.wire
        if wire.is_cuda and _STREAMS_ARE_REAL():
            self.work.wait_stream(torch_current_stream(wire.get_device()), timeout)
        else:
            self.work.wait(timeout)
        if self.wire is not self.target:
            # Queued on the current stream; the collective already finished on the GPU, so no wait.
            self.target.copy_(self.wire)
        return self.target


def _STREAMS_ARE_REAL() -> bool:
    """True where torch drives real CUDA streams (not a process without a GPU runtime)."""
    return torch.cuda.is_available()


def _wire_tensor(
    tensor: torch.Tensor, op: str, wire_dtype: torch.dtype | None, device: torch.device | None, ranks: int
) -> tuple[torch.Tensor, str]:
    """The tensor that goes on the wire and the op to run on it (no copy when none is needed)."""
    if device is not None and tensor.device != device:
        tensor = tensor.to(device)
    if wire_dtype is not None and tensor.is_floating_point() and tensor.dtype != wire_dtype:
        scaled = tensor / ranks if op == "average" else tensor
        return scaled.to(wire_dtype).contiguous(), "sum" if op == "average" else op  # no fp16 overflow
    if tensor.dtype not in _CORE_DTYPES:
        raise TypeError(
            f"commsched.torch cannot send {tensor.dtype} tensors; it takes float16, bfloat16, float32, float64, "
            "int8, uint8, int16, int32, int64 and bool"
        )
    if not tensor.is_contiguous():
        return tensor.contiguous(), op
    return tensor, op


def start_allreduce(
    tensor: torch.Tensor,
    name: str,
    priority: int,
    op: str,
    wire_dtype: torch.dtype | None = None,
    device: torch.device | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    ranks: int | None = None,
    **core: Any,
) -> Outgoing:
    """Starts an in-place allreduce of `tensor` through commsched; the result lands in it on finish().

    `device`: where the bytes must be for the running transport (None: where they are); `ranks`:
    how many ranks average (default all); `core`: further arguments for commsched (process_set).
    """
    wire, wire_op = _wire_tensor(tensor, op, wire_dtype, device, commsched.size() if ranks is None else ranks)
    if prescale_factor != 1.0 or postscale_factor != 1.0:  # older cores take no scale arguments
        core.update(prescale_factor=prescale_factor, postscale_factor=postscale_factor)
    work = commsched.allreduce_async(wire, name=name, priority=priority, op=wire_op, **core)
    return Outgoing(tensor, wire, work)


def start_broadcast(
    tensor: torch.Tensor, name: str, root: int, device: torch.device | None = None, **core: Any
) -> Outgoing:
    """Starts an in-place broadcast of `tensor` from `root` (a commsched rank) through commsched."""
    wire = tensor
    if device is not None and wire.device != device:
        wire = wire.to(device)
    if wire.dtype not in _CORE_DTYPES:
        wire = wire.view(torch.uint8) if wire.dtype == torch.bool else wire  # same bytes
    if wire.dtype not in _CORE_DTYPES:
        raise TypeError(f"commsched.torch cannot broadcast {tensor.dtype} tensors")
    if not wire.is_contiguous():
        wire = wire.contiguous()
    work = commsched.broadcast_async(wire, root=root, name=name, **core)
    return Outgoing(tensor, wire, work)


def training_device(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """ "cuda" when the tensors live on GPUs, "cpu" when none does; ValueError naming one of each if mixed."""
    on_gpu: str | None = None
    on_cpu: str | None = None
    for name, tensor in named:
        if tensor.is_cuda:
            on_gpu = name if on_gpu is None else on_gpu
        else:
            on_cpu = name if on_cpu is None else on_cpu
    if on_gpu is not None and on_cpu is not None:
        raise ValueError(
            f"commsched.torch: parameter '{on_gpu}' is on a GPU but parameter '{on_cpu}' is on the CPU; "
            "commsched moves either GPU memory (NCCL) or host memory in one job, not both. Move the whole "
            "model to one device (model.to('cuda') or model.cpu()) before building the optimizer"
        )
    return "cuda" if on_gpu is not None else "cpu"


def _running_memory() -> str:
    """What the running transport moves: "cuda" (NCCL, CUDA-aware MPI), "cpu", or "auto" (not chosen yet)."""
    if not commsched._state.initialized_here():
        return "auto"  # between an elastic job's generations: the next init() chooses
    settings = commsched.config()
    transport = str(settings["transport"])
    if transport.startswith("auto"):
        return "auto"  # the first tensor submitted chooses the transport, so it will fit
    return "cuda" if transport == "nccl" or settings.get("device") == "cuda" else "cpu"


def check_transport(device: str, example: str) -> None:
    """Refuses gradients on `device` when the running transport cannot move them, naming `example`."""
    memory = _running_memory()
    if memory in ("auto", device):
        return
    transport = commsched.config()["transport"]
    if device == "cuda":
        raise TypeError(
            f"commsched.torch: parameter '{example}' is on a GPU, but commsched runs the {transport} "
            "transport on host memory; start commsched with init(device='cuda') (or let "
            "DistributedOptimizer start it: do not call commsched.init first), or train on the CPU"
        )
    raise TypeError(
        f"commsched.torch: parameter '{example}' is on the CPU, but commsched runs the {transport} transport "
        "on GPU memory; move the model to the GPU (model.to('cuda')) or start commsched with init(device='cpu')"
    )


def wire_device(tensors: Iterable[torch.Tensor]) -> torch.device:
    """Where collective bytes must live under the running transport: a GPU for GPU transports, else the CPU."""
    on_gpu = next((t.device for t in tensors if t.is_cuda), None)
    memory = _running_memory()
    if memory == "cuda":
        return on_gpu if on_gpu is not None else torch.device("cuda", torch.cuda.current_device())
    if memory == "auto":  # keep GPU tensors where they are: the first one makes the transport NCCL
        return on_gpu if on_gpu is not None else torch.device("cpu")
    return torch.device("cpu")


def ensure_initialized(process_group: object = None, device: str | None = None) -> None:
    """Starts commsched unless the user already did: with device="cuda:N" (NCCL on GPU N) for GPU tensors.

    `process_group` carries commsched's control messages (agreement, NCCL's unique id).
    """
    if commsched.is_initialized() or commsched._state.settings is not None:
        # Running, or stopped by a rank's failure: the submission raises that failure. Starting
        # again here would meet the lost rank and wait for it; shutdown() then init() restarts.
        return
    if device is not None and device.startswith("cuda"):
        commsched.init(process_group=process_group, device=device)
    else:
        commsched.init(process_group=process_group)


def cuda_device_name(tensors: Iterable[torch.Tensor]) -> str | None:
    """ "cuda:N" of the first tensor on a GPU (commsched's NCCL communicator goes there), else None."""
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor) and tensor.is_cuda:
            index = tensor.get_device()
            return f"cuda:{index}" if index >= 0 else "cuda"
    return None
