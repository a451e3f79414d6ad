"""Gloo over torch.distributed process groups: natively (commsched._gloo, torch's C++ Gloo backend
called from the core with no GIL) where that extension was built, otherwise through the core's
Python trampoline."""

from __future__ import annotations

import ctypes
import datetime
import logging
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from commsched import torch_release
from commsched.error_text import first_line
from commsched.launch import LaunchInfo
from commsched.start_wait import start_wait_s
from commsched.transports import gloo_rendezvous

log = logging.getLogger("commsched")

_TORCH_DTYPES = {
    "float16": "float16",
    "bfloat16": "bfloat16",
    "float32": "float32",
    "float64": "float64",
    "int32": "int32",
    "int64": "int64",
    "uint8": "uint8",
    "int8": "int8",
    "int16": "int16",
}

# Types Gloo does not reduce, and the wider type it reduces them in.
_WIDENED: dict[str, Any] = {}


def _movable(tensor: Any) -> Any:
    """The tensor as a type Gloo moves (int16 as float16 bits: nothing is computed on them)."""
    import torch

    return tensor.view(torch.float16) if tensor.dtype == torch.int16 else tensor


# Agreement reports are usually a few dozen bytes: one fixed slot per rank carries them.
_SLOT_BYTES = 1024
_LENGTH_BYTES = 8
# After a failure every rank that is still there sends every other one a probe; a rank that does not
# answer within this long is named as hung. The ranks that fail together enter the probe within a
# round of each other, so a few seconds tell a stopped rank from a live one.
_PROBE_WAIT_S = 3.0
_PROBE_TAG = 0x636D73  # keeps the probes apart from point-to-point messages of the user's own
# How long close() waits for Gloo's threads to finish the completion callbacks they have begun.
_CALLBACK_WAIT_S = 5.0


class GlooError(RuntimeError):
    """A Gloo collective or agreement exchange failed; the message names the ranks that stopped answering."""


def keep_forever(group: Any) -> None:
    """Keeps a process group alive until the process exits: one reference never given back, so
    neither dist.destroy_process_group() nor the garbage collector at exit runs its destructor, which
    would wait for a collective whose peer is gone (ProcessGroupGloo waits for its queue to drain)."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))


def _rank_list(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(map(str, ranks))


@dataclass
class Groups:
    """The process groups a Gloo transport runs on: data, agreement, and those it created itself."""

    data: Any
    control: Any
    ranks: list[int]
    owned: list[Any] = field(default_factory=list)

    def close(self) -> None:
        """Destroys the groups created for the transport, so none outlives commsched.shutdown()."""
        import torch.distributed as dist

        # Gloo groups left to the interpreter's exit get torn down while Python finalizes,
        # when their threads can no longer take the GIL.
        for group in reversed(self.owned):
            if dist.is_initialized():
                dist.destroy_process_group(group)
        self.owned.clear()

    def make_process_set(self, ranks: list[int]) -> Any:
        """A Gloo group of `ranks` (ranks of this transport); None on a rank outside it. Every rank calls it."""
        import torch.distributed as dist

        group = dist.new_group([self.ranks[r] for r in ranks], backend="gloo")
        if group is None or group is dist.GroupMember.NON_GROUP_MEMBER:
            return None
        self.owned.append(group)
        return group


def make_groups(launch: LaunchInfo, process_group: Any = None, settings: Any = None) -> Groups:
    """Initialises torch.distributed if needed and makes the data and agreement groups."""
    try:
        import torch.distributed as dist
    except ImportError:
        raise RuntimeError("COMMSCHED_TRANSPORT=gloo needs PyTorch: pip install torch") from None
    if not dist.is_initialized():
        if process_group is not None:
            raise ValueError("process_group= was given but torch.distributed is not initialised")
        if not launch.master_addr or not launch.master_port:
            raise ValueError(
                "COMMSCHED_TRANSPORT=gloo needs MASTER_ADDR and MASTER_PORT (torchrun sets them) "
                "or an initialised torch.distributed process group"
            )
        # Left in place at shutdown: a later init() finds it, and a new rendezvous on
        # torchrun's store would meet the old one's keys.
        gloo_rendezvous.init_default_group(launch, settings)
    group = process_group if process_group is not None else dist.group.WORLD
    ranks = dist.get_process_group_ranks(group)
    groups = Groups(data=group, control=None, ranks=ranks)
    # A starting elastic generation bounds each wait on the others (commsched.start_wait); the
    # groups get torch's default back once commsched runs.
    starting = start_wait_s()
    timeout = None if starting is None else datetime.timedelta(seconds=starting)
    # Data and agreement get groups of their own, so an agreement never queues behind a large reduction.
    if dist.get_backend(group) != "gloo":
        groups.data = dist.new_group(ranks, backend="gloo", timeout=timeout)
        groups.owned.append(groups.data)
    groups.control = dist.new_group(ranks, backend="gloo", timeout=timeout)
    groups.owned.append(groups.control)
    return groups


# Set by build(): "native", or "python (<why the native transport is not used>)"; with the native
# transport's seed, whose counters show what went over it. For diagnostics and tests.
last_path = ""
last_seed: Any = None


def build(launch: LaunchInfo, process_group: Any = None, settings: Any = None) -> tuple[str, Any]:
    """The (kind, argument) pair commsched._core.start() takes: the native transport where
    commsched._gloo imports and accepts the groups, otherwise the Python one (logged at info, with why)."""
    global last_path, last_seed
    groups = make_groups(launch, process_group, settings)
    seed, why = _native_seed(groups)
    last_seed = seed
    if seed is not None:
        from commsched import _gloo

        last_path = "native"
        log.info("COMMSCHED_TRANSPORT=gloo: native transport (commsched._gloo), no GIL on the data path")
        # The seed rides along so it lives as long as the argument: the core reads it during start().
        return "native", (_gloo.transport_factory(), seed.address(), seed)
    last_path = f"python ({why})"
    log.info("COMMSCHED_TRANSPORT=gloo: Python transport, because %s", why)
    return "python", GlooTransport(launch, process_group, groups)


def _native_seed(groups: Groups) -> tuple[Any, str]:
    """The native transport's seed over `groups`, or (None, why not)."""
    try:
        from commsched import _gloo
    except ImportError as error:
        return (
            None,
            f"commsched._gloo did not import ({error}); it is built when PyTorch is importable at install",
        )
    import torch

    if not torch_release.fits(_gloo.built_for_torch, torch.__version__):
        # c10d's C++ classes differ between releases: using them across versions could crash.
        return None, (
            f"commsched._gloo was built for torch {_gloo.built_for_torch}, but torch {torch.__version__} "
            "is installed; reinstall commsched to build it for this torch"
        )
    try:
        cpu = torch.device("cpu")
        data, control = groups.data._get_backend(cpu), groups.control._get_backend(cpu)

        def make_process_set(set_id: int, ranks: list[int]) -> Any:
            group = groups.make_process_set(ranks)
            return None if group is None else group._get_backend(cpu)

        return _gloo.Seed(data, control, groups.close, make_process_set), ""
    except (AttributeError, RuntimeError, ValueError, TypeError) as error:
        return None, f"commsched._gloo cannot use these process groups ({error})"


class _Pending:
    """A torch.distributed Work seen through the core's PendingOp interface."""

    def __init__(self, work: Any, transport: GlooTransport, finish: Callable[[], None] | None = None) -> None:
        self._work = work
        self._finish = finish  # copies a padded or whole result into the core's output, once done
        # The future is marked done before its callbacks run, while Work.is_completed() may
        # turn true only after them: asking the future keeps the doorbell's wake-up useful.
        self._future = work.get_future()
        self._transport = transport

    def test(self) -> bool:
        """True once the collective finished; raises GlooError if it failed or a rank is lost."""
        if not self._future.done():
            lost = self._transport.lost
            if lost:  # it waits for a rank that is gone: stopping need not wait for it too
                raise GlooError(f"gloo collective abandoned: {lost}")
            return False
        try:
            self._work.wait()  # surfaces the error of a failed collective
        except RuntimeError as error:
            raise GlooError(f"gloo collective failed: {self._transport.explain(error)}") from None
        if self._finish is not None:
            self._finish()
            self._finish = None
        return True

    def finished(self) -> bool:
        """True once Gloo is done with the collective's memory."""
        return bool(self._future.done())

    def on_done(self, callback: Any) -> None:
        """Calls callback() once the collective completes (or fails), from Gloo's thread."""
        self._transport.run_on_completion(self._future, callback)


class GlooTransport:
    """Runs agreement and data collectives on Gloo process groups (CPU memory)."""

    name = "gloo"
    # Completions ring the core's doorbell (see _Pending.on_done): polling is only a fallback.
    poll_interval_us = 5000

    def __init__(self, launch: LaunchInfo, process_group: Any = None, groups: Groups | None = None) -> None:
        if groups is None:
            groups = make_groups(launch, process_group)
        import torch
        import torch.distributed as dist

        self._torch = torch
        self._dist = dist
        _WIDENED.setdefault("int16", torch.int32)
        self._owned = groups.owned  # subgroups made for this transport
        self._groups = groups
        self._sets: dict[int, tuple[Any, list[int]]] = {}  # process set id -> (group, ranks); members only
        self._data = groups.data
        self._control = groups.control
        self._global_ranks = groups.ranks
        self.rank = dist.get_rank(self._data)
        self.size = dist.get_world_size(self._data)
        self._slot = torch.zeros(_SLOT_BYTES, dtype=torch.uint8)
        self._slots = [torch.zeros(_SLOT_BYTES, dtype=torch.uint8) for _ in range(self.size)]
        self.lost = ""  # why a rank is known to be gone; empty while every rank answers
        self._in_flight: weakref.WeakSet[_Pending] = weakref.WeakSet()
        self._callbacks = threading.Condition()
        self._callbacks_running = 0  # completion callbacks registered and not yet finished
        self._callbacks_begun = 0  # of those, the ones Gloo's thread has begun to run
        self._relays: dict[int, Any] = {}  # the relay futures of callbacks not yet begun, by number
        self._relay_count = 0

    def close(self) -> None:
        """Ends what waits for a lost rank and destroys the groups this transport created."""
        stuck = [op for op in self._in_flight if not op.finished()]
        with self._callbacks:  # a collective whose completion callback has not begun is still running
            unfinished = self._callbacks_running - self._callbacks_begun
        if self.lost or stuck or unfinished:
            # A work waiting for a rank that is gone (or stopped) holds its group's destructor (and
            # the process's exit) until Gloo's own timeout, 30 minutes by default, and
            # Backend.abort() does nothing for Gloo: the groups are kept for the life of the process.
            log.debug(
                "gloo: keeping the process groups (%d collectives in flight)", max(len(stuck), unfinished)
            )
            groups = [self._control, self._data] + [group for group, _ in self._sets.values()]
            for group in {id(g): g for g in groups}.values():
                self._abort(group)
                keep_forever(group)
            # A stuck work holds the memory it moves, of which a tensor over the caller's buffer is
            # freed taking the GIL: on Gloo's thread, once the work fails at the interpreter's exit.
            for op in stuck:
                keep_forever(op)
            self._release_relays()
        self._wait_for_callbacks(only_begun=bool(self.lost or stuck or unfinished))
        # Gloo groups left to the interpreter's exit get torn down while Python finalizes,
        # when their threads can no longer take the GIL.
        for group in reversed(self._owned):
            if self._dist.is_initialized():
                self._dist.destroy_process_group(group)
        self._owned.clear()

    def _abort(self, group: Any) -> None:
        try:
            group._get_backend(self._torch.device("cpu")).abort()
        except (AttributeError, RuntimeError) as error:  # a PyTorch without Backend.abort(): kept anyway
            log.debug("gloo: could not abort a process group (%s)", error)

    def run_on_completion(self, future: Any, callback: Any) -> None:
        """Calls callback() from Gloo's thread when `future` completes, counted so close() can wait for it."""
        # The callback hangs on a relay that C++ alone completes from `future`, never on `future`
        # itself, so close() can complete the relay of a stuck collective at once. A Python callback
        # left on a Gloo future whose collective fails while the interpreter exits (the stopped peer
        # killed then) makes Gloo's thread take the GIL there: std::terminate, not the chosen status.
        relay = self._torch.futures.collect_all([future])
        with self._callbacks:
            self._callbacks_running += 1
            self._relay_count += 1
            number = self._relay_count
            self._relays[number] = relay

        def fire(_future: Any) -> None:
            with self._callbacks:
                self._callbacks_begun += 1
                self._relays.pop(number, None)
            try:
                callback()
            finally:
                with self._callbacks:
                    self._callbacks_running -= 1
                    self._callbacks_begun -= 1
                    self._callbacks.notify_all()

        relay.add_done_callback(fire)

    def _release_relays(self) -> None:
        """Completes the relays of collectives still running: their callbacks run now, while Python
        can run them, and the collective's own failure later finds nothing of Python to call."""
        with self._callbacks:
            relays = list(self._relays.values())
        for relay in relays:
            # Kept: a completed relay holds a Python value, which its last owner frees taking the GIL,
            # and that owner would be the collective's callback, on Gloo's thread.
            keep_forever(relay)
            try:
                relay.set_result(None)
            except RuntimeError:
                pass  # its collective completed it meanwhile

    def _wait_for_callbacks(self, only_begun: bool = False) -> None:
        # A callback still to run when the interpreter finalizes would make Gloo's thread take the
        # GIL then, which ends the thread inside Gloo's code: "terminate called without an active
        # exception". A future is done before its callbacks run, so the core may be through first.
        # With a rank lost, collectives still waiting for it may never complete: only the callbacks
        # already running are waited for.
        def done() -> bool:
            return (self._callbacks_begun if only_begun else self._callbacks_running) == 0

        with self._callbacks:
            if not self._callbacks.wait_for(done, _CALLBACK_WAIT_S):
                log.warning(
                    "gloo: %d completion callbacks still pending after %.0fs at shutdown",
                    self._callbacks_running,
                    _CALLBACK_WAIT_S,
                )

    def explain(self, error: BaseException) -> str:
        """`error` with the ranks that stopped answering, found by probing every rank once."""
        if not self.lost:
            silent, dead = self._probe_peers()
            found = []
            if dead:
                found.append(f"{_rank_list(dead)} closed the connection (the process ended?)")
            if silent:
                found.append(
                    f"{_rank_list(silent)} did not answer within {_PROBE_WAIT_S:g}s (hung or stopped?)"
                )
            if not found:
                return f"{first_line(error)}; every rank answered a probe, so one of them was only slow"
            self.lost = "; ".join(found)
        return f"{self.lost} (Gloo: {first_line(error)})"

    def _probe_peers(self) -> tuple[list[int], list[int]]:
        """(ranks that did not answer, ranks whose connection failed): every rank sends every other its number.

        One thread per peer waits for its answer, so an answer is taken as it arrives even while another
        peer keeps this rank waiting; and a rank stays until its own probes were taken (or the wait is
        over), so a peer slower to start probing does not take it for dead once it has exited.
        """
        torch, dist = self._torch, self._dist
        mine = torch.tensor([self.rank], dtype=torch.int64)
        outcome: dict[int, str] = {}
        deadline = time.monotonic() + _PROBE_WAIT_S

        def left() -> datetime.timedelta:
            return datetime.timedelta(seconds=max(0.01, deadline - time.monotonic()))

        def await_peer(peer: int, sent: Any, received: Any, answer: Any) -> None:
            try:
                received.wait(left())
                outcome[peer] = "answered" if int(answer.item()) == peer else "dead"
            except RuntimeError as error:
                outcome[peer] = "silent" if "timed out" in str(error).lower() else "dead"
            try:
                sent.wait(left())
            except RuntimeError:
                pass  # the peer is gone or hangs: its outcome says so

        waiters = []
        for peer in range(self.size):
            if peer == self.rank:
                continue
            answer = torch.full((1,), -1, dtype=torch.int64)
            target = self._global_ranks[peer]
            try:
                sent = dist.isend(mine, target, group=self._control, tag=_PROBE_TAG)
                received = dist.irecv(answer, target, group=self._control, tag=_PROBE_TAG)
            except RuntimeError:
                outcome[peer] = "dead"
                continue
            waiter = threading.Thread(
                target=await_peer,
                args=(peer, sent, received, answer),
                name="commsched-gloo-probe",
                daemon=True,
            )
            waiter.start()
            waiters.append(waiter)
        for waiter in waiters:
            waiter.join(_PROBE_WAIT_S + 1.0)
        silent = [
            peer for peer in range(self.size) if peer != self.rank and outcome.get(peer, "silent") == "silent"
        ]
        dead = [peer for peer, what in sorted(outcome.items()) if what == "dead"]
        return silent, dead

    def _tensor_at(self, address: int, count: int, dtype: str) -> Any:
        torch_dtype = getattr(self._torch, _TORCH_DTYPES[dtype])
        if count == 0:
            return self._torch.empty(0, dtype=torch_dtype)
        itemsize = self._torch.empty(0, dtype=torch_dtype).element_size()
        memory = (ctypes.c_char * (count * itemsize)).from_address(address)
        return self._torch.frombuffer(memory, dtype=torch_dtype)

    def exchange(self, report: bytes, timeout_s: float) -> list[bytes]:
        """Allgathers one byte string per rank: one round trip when every report fits a slot."""
        if self.lost:
            raise GlooError(self.lost)
        try:
            return self._exchange(report, datetime.timedelta(seconds=timeout_s))
        except RuntimeError as error:
            raise GlooError(self.explain(error)) from None

    def _exchange(self, report: bytes, timeout: datetime.timedelta) -> list[bytes]:
        torch, dist = self._torch, self._dist
        # A slot holds the length and, when it fits, the report itself; only a long report
        # costs a second allgather, sized by the longest one.
        slot = self._slot
        slot[:_LENGTH_BYTES] = torch.tensor([len(report)], dtype=torch.int64).view(torch.uint8)
        if len(report) <= _SLOT_BYTES - _LENGTH_BYTES and report:
            slot[_LENGTH_BYTES : _LENGTH_BYTES + len(report)] = torch.frombuffer(
                bytearray(report), dtype=torch.uint8
            )
        dist.all_gather(self._slots, slot, group=self._control, async_op=True).wait(timeout)
        sizes = [int(s[:_LENGTH_BYTES].view(torch.int64).item()) for s in self._slots]
        width = max(sizes)
        if width <= _SLOT_BYTES - _LENGTH_BYTES:
            return [
                s[_LENGTH_BYTES : _LENGTH_BYTES + n].numpy().tobytes() for s, n in zip(self._slots, sizes)
            ]
        mine = torch.zeros(width, dtype=torch.uint8)
        if report:
            mine[: len(report)] = torch.frombuffer(bytearray(report), dtype=torch.uint8)
        gathered = [torch.empty(width, dtype=torch.uint8) for _ in range(self.size)]
        dist.all_gather(gathered, mine, group=self._control, async_op=True).wait(timeout)
        return [t[:n].numpy().tobytes() for t, n in zip(gathered, sizes)]

    def unsupported(self, kind: str, dtype: str, op: str) -> str:
        """Gloo runs every collective and op commsched has (see start_collective for how)."""
        return ""

    def add_process_set(self, set_id: int, ranks: list[int]) -> None:
        """Builds a Gloo group of the set's members (every rank calls it, in the same order)."""
        group = self._groups.make_process_set(list(ranks))
        if group is not None:
            self._sets[set_id] = (group, list(ranks))

    def remove_process_set(self, set_id: int) -> None:
        """Forgets a set's group; close() destroys it with the others."""
        self._sets.pop(set_id, None)

    def _on(self, process_set: int) -> tuple[Any, int, list[int]]:
        """(group, this rank's position in it, its ranks) for a collective of `process_set`."""
        if process_set == 0:
            return self._data, self.rank, list(range(self.size))
        group, ranks = self._sets[process_set]
        return group, ranks.index(self.rank), ranks

    def _reduce_op(self, op: str) -> Any:
        ops = self._dist.ReduceOp
        return {"min": ops.MIN, "max": ops.MAX, "product": ops.PRODUCT}.get(op, ops.SUM)

    def start(
        self,
        address: int,
        count: int,
        dtype: str,
        kind: str,
        root: int,
        op: str = "sum",
        process_set: int = 0,
    ) -> _Pending:
        """Starts an in-place allreduce (sum, min, max, product) or broadcast on raw memory; `root`
        is a position in `process_set`."""
        group, _, members = self._on(process_set)
        tensor = self._tensor_at(address, count, dtype)
        if kind == "allreduce" and dtype in _WIDENED:
            # Gloo reduces no int16: in int32, whose low 16 bits wrap as int16 arithmetic would.
            wide = tensor.to(_WIDENED[dtype])
            work = self._dist.all_reduce(wide, op=self._reduce_op(op), group=group, async_op=True)
            return self._track(_Pending(work, self, lambda: tensor.copy_(wide.to(tensor.dtype))))
        if kind == "allreduce":
            work = self._dist.all_reduce(tensor, op=self._reduce_op(op), group=group, async_op=True)
        else:
            tensor = _movable(tensor)
            source = self._global_ranks[members[root]]
            work = self._dist.broadcast(tensor, src=source, group=group, async_op=True)
        return self._track(_Pending(work, self))

    def _track(self, pending: _Pending) -> _Pending:
        """Keeps a collective in flight known to close(), which waits for it or aborts the groups."""
        self._in_flight.add(pending)
        return pending

    def start_collective(
        self,
        kind: str,
        dtype: str,
        op: str,
        address: int,
        count: int,
        output: int,
        recv_counts: list[int],
        send_counts: list[int],
        layout: list[int],
        process_set: int = 0,
    ) -> _Pending:
        """Allgather (all_gather of equal, padded parts), reducescatter (an allreduce of a copy, of
        which this rank keeps its part) or alltoall (all_to_all_single) into `output`."""
        torch, dist = self._torch, self._dist
        group, me, members = self._on(process_set)
        source = self._tensor_at(address, count, dtype)
        target = self._tensor_at(
            output, sum(recv_counts) if kind != "reducescatter" else recv_counts[me], dtype
        )
        if kind != "reducescatter":  # moving bytes only: any type of the same width does
            source, target = _movable(source), _movable(target)
        if kind == "allgather":
            width = max(recv_counts)
            padded = torch.zeros(width, dtype=source.dtype)
            padded[:count] = source
            parts = [torch.empty(width, dtype=source.dtype) for _ in range(len(members))]
            work = dist.all_gather(parts, padded, group=group, async_op=True)

            def gathered() -> None:
                offset = 0
                for part, received in zip(parts, recv_counts):
                    target[offset : offset + received] = part[:received]
                    offset += received

            return self._track(_Pending(work, self, gathered))
        if kind == "reducescatter":
            reduced = source.to(_WIDENED[dtype]) if dtype in _WIDENED else source.clone()
            work = dist.all_reduce(reduced, op=self._reduce_op(op), group=group, async_op=True)
            start = sum(recv_counts[:me])

            def kept() -> None:
                target[:] = reduced[start : start + recv_counts[me]].to(target.dtype)

            return self._track(_Pending(work, self, kept))
        work = dist.all_to_all_single(
            target,
            source,
            output_split_sizes=recv_counts,
            input_split_sizes=send_counts,
            group=group,
            async_op=True,
        )
        return self._track(_Pending(work, self))
