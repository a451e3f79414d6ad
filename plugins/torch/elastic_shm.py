"""A sharded commit's shards in shared memory, so ranks on one host need not send them to each other.

A rank lost to SIGKILL takes its private memory with it, but not a shared mapping that another
process holds. So each rank captures its shard of a commit straight into a file in /dev/shm; at the
first commit of a layout the ranks exchange their host's identity and their file's name (one small
allgather), and where every rank runs on one host each maps every other rank's file. A commit then
moves no shard bytes between ranks, and no collective says it is complete: each rank marks its slot's
header once its capture finished, and every rank reads the others' marks in its mappings. After a
failure the survivors read the lost rank's shard from their own mapping. Each rank unlinks its file
once its first commit here is marked by every rank (a rank maps every file before it marks), so the
memory goes with the last process that maps it, however the job ends. Until then the owner holds an
flock on it: a file whose lock is free belongs to a process that died before unlinking it, and the
next rank to make a file removes it (a process id would not do: ranks in other PID namespaces may
share /dev/shm). Ranks on several hosts (or without /dev/shm) send the shards by broadcasts instead
(elastic_commit).

A file holds three slots, one per commit number modulo 3, each headed by the number of the commit it
holds and whether its capture finished; the ranks agree on the numbers when they share the files. A
rank writes commit N + 3 over commit N only once every rank marked N + 2, which each starts only after
it saw every rank's mark of N + 1: so no rank still counts N as its last complete commit, and a
restore never reads a slot being overwritten.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import secrets
import socket
import time
import weakref
from collections.abc import Callable
from typing import Any

import commsched
import torch

DIRECTORY = "/dev/shm"
SLOTS = 3
# Between checks for the other ranks' parts of a commit: they finish about when this rank's does, and
# the next commit that needs to know is many steps away, so the pauses grow to keep wake-ups few.
_FIRST_PAUSE_S = 0.0005
_LAST_PAUSE_S = 0.008
_HEADER = 64  # bytes: per slot the commit number and 1 once its capture finished (int64 each)
_ALIGN = 64


def host_key() -> int:
    """An identity shared by the processes that see the same /dev/shm on the same running kernel (0: none)."""
    try:
        info = os.stat(DIRECTORY)
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as boot:
            boot_id = boot.read().strip()
    except OSError:
        return 0
    text = f"{socket.gethostname()} {boot_id} {info.st_dev} {info.st_ino}"
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=7).digest(), "little") or 1


class Region:
    """This rank's file of three commit slots, and once shared, every other rank's file mapped."""

    def __init__(self, totals: dict[torch.dtype, int]) -> None:
        self.totals = dict(totals)
        self._places: dict[torch.dtype, tuple[int, int]] = {}  # dtype -> (byte offset in a slot, numel)
        size = 0
        for dtype, numel in self.totals.items():
            self._places[dtype] = (size, numel)
            size += -(-numel * dtype.itemsize // _ALIGN) * _ALIGN
        self.slot_bytes = size
        self.total_bytes = _HEADER + SLOTS * size
        self.token = secrets.randbits(62)
        _remove_stale()
        self.path: str | None = os.path.join(DIRECTORY, f"commsched-commit-{os.getpid()}-{self.token:x}")
        self.key = host_key()
        self._descriptor = -1  # holds the flock while the file has its name
        self.own = self._create() if self.key else None
        if self.own is None:  # no shared memory here: private slots, sent by broadcasts
            self.path, self.key = None, 0
            self.own = torch.zeros(self.total_bytes, dtype=torch.uint8)
        # Through numpy: a torch index assignment of two numbers cost about 0.1 ms in each commit().
        self._headers = self.own[:_HEADER].view(torch.int64).numpy()
        self._slots = [self._views(self.own, index) for index in range(SLOTS)]
        self.peers: dict[int, torch.Tensor] | None = None  # rank -> its file; None: not shared (yet)
        self._peer_headers: dict[int, Any] = {}  # rank -> its file's slot headers (numpy int64)
        self.decided = False
        self.first = 0  # once shared: the number of the first commit written here, the same on every rank
        self.names: dict[int, str] = {}  # rank -> its file's path, for unlinking a lost rank's
        self.pids: dict[int, int] = {}  # rank -> its process (all ranks run on this host)
        self._unlink = weakref.finalize(self, _unlink, self.path, self._descriptor) if self.path else None

    def _create(self) -> torch.Tensor | None:
        assert self.path is not None
        # Locked under a name the stale-file sweep skips, then renamed: a named file is always locked
        # by a live owner. O_EXCL: the name is this process's alone; 0600: no other user reads the state.
        making = os.path.join(DIRECTORY, "." + os.path.basename(self.path))
        try:
            descriptor = os.open(making, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError:
            return None
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.ftruncate(descriptor, self.total_bytes)
            mapped = torch.from_file(making, shared=True, size=self.total_bytes, dtype=torch.uint8)
            os.rename(making, self.path)
        except (OSError, RuntimeError):
            _unlink(making, descriptor)
            return None
        self._descriptor = descriptor
        return mapped

    def slot(self, number: int) -> dict[torch.dtype, torch.Tensor]:
        """This rank's flat tensors of commit `number`, one per dtype (marked as being written)."""
        index = number % SLOTS
        self._headers[2 * index : 2 * index + 2] = (number, 0)
        return self._slots[index]

    def finished(self, number: int) -> None:
        """Marks this rank's capture of commit `number` complete."""
        self._headers[2 * (number % SLOTS) + 1] = 1

    def _views(self, mapped: torch.Tensor, index: int) -> dict[torch.dtype, torch.Tensor]:
        start = _HEADER + index * self.slot_bytes
        return {
            dtype: mapped[start + offset : start + offset + numel * dtype.itemsize].view(dtype)
            for dtype, (offset, numel) in self._places.items()
        }

    def share(self, name: str, number: int) -> bool:
        """Maps every rank's file when all run on one host (a collective, once); True if they do.

        `number` is the commit this rank is about to write; `first` becomes the highest over the ranks,
        the number every rank gives that commit. Ranks count their commits apart (a worker that joined
        started again from 1), and the slots hold numbers every rank must read alike."""
        if self.decided:
            return self.peers is not None
        mine = torch.tensor([self.key, os.getpid(), self.token, number], dtype=torch.int64)
        handle = commsched.allgather_async(mine, name=name, priority=2**31 - 1)
        found = handle.wait()
        everyone = torch.as_tensor(found).reshape(-1, 4).tolist()
        self.decided = True
        self.first = max(proposed for _, _, _, proposed in everyone)
        everyone = [row[:3] for row in everyone]
        if any(key != self.key or key == 0 for key, _, _ in everyone):
            self.release()  # another host (or no /dev/shm somewhere): nobody maps this file
            return False
        me = commsched.rank()
        self.names = {
            r: os.path.join(DIRECTORY, f"commsched-commit-{pid}-{token:x}")
            for r, (_, pid, token) in enumerate(everyone)
        }
        self.pids = {r: int(pid) for r, (_, pid, _) in enumerate(everyone)}
        self.peers = {r: self.own if r == me else self._map(path) for r, path in self.names.items()}
        self._peer_headers = {
            r: mapped[:_HEADER].view(torch.int64).numpy() for r, mapped in self.peers.items()
        }
        return True

    def _map(self, path: str) -> torch.Tensor:
        try:
            size = os.stat(path).st_size
        except OSError as error:
            raise RuntimeError(
                f"commit: another rank's shared-memory file {path} cannot be opened ({error}); "
                f"check that {DIRECTORY} is shared by every rank on this host"
            ) from None
        if size != self.total_bytes:
            raise RuntimeError(
                f"commit: the shared-memory file {path} holds {size} bytes, not {self.total_bytes}: "
                "the ranks disagree on the optimizer's shards"
            )
        return torch.from_file(path, shared=True, size=size, dtype=torch.uint8)

    def release(self) -> None:
        """Unlinks this rank's file (every rank that needs it has it mapped; the memory stays while mapped)."""
        if self._unlink is not None:
            self._unlink()

    def release_all(self) -> None:
        """Unlinks every rank's file, a lost rank's too (after a restore read them)."""
        self.release()
        for path in self.names.values():
            _unlink(path)

    def shards(self, number: int) -> dict[int, dict[torch.dtype, torch.Tensor]]:
        """Every rank's flat tensors of commit `number`, as mapped here; raises if a slot holds another."""
        assert self.peers is not None
        index = number % SLOTS
        found = {}
        for rank, mapped in self.peers.items():
            held, complete = self._header(rank, index)
            if held != number or complete != 1:
                raise RuntimeError(
                    f"commit {number}: rank {rank}'s shared-memory slot holds commit {held}"
                    f"{'' if complete else ' (incomplete)'}; the commit cannot be restored"
                )
            found[rank] = self._views(mapped, index)
        return found

    def await_every_part(self, number: int, still_running: Callable[[], bool]) -> None:
        """Returns once every rank marked its part of commit `number` copied; raises once `still_running()`
        says no (commsched stopped: a rank failed, and restore() decides from the marks) or when a rank
        started a later commit without marking this one (its capture failed).

        Ranks on one host need no collective to learn this: each marks its own slot header when its last
        copy is done, and every rank maps every file. The 4-byte allreduce this replaced cost the commit
        thread 0.27 ms of CPU per commit at 2 ranks, besides the core's work to agree on it and run it;
        waiting on the marks costs 0.03 ms."""
        assert self.peers is not None
        index, later = number % SLOTS, (number + 1) % SLOTS
        pause = _FIRST_PAUSE_S
        suspects: set[int] = set()
        while True:
            missing = []
            for rank in self.peers:
                # The later slot first: a rank marks this commit before it starts the next one, so a
                # later commit seen there with this one still unmarked means it never will be. Seen on
                # two passes, a pause apart, before it counts: a CPU that orders memory weakly may
                # show the later header before the mark written ahead of it.
                later_held, _ = self._header(rank, later)
                held, complete = self._header(rank, index)
                if held == number and complete == 1:
                    continue
                went_on = later_held > number or held > number
                if went_on and rank in suspects:
                    raise RuntimeError(
                        f"commit {number}: rank {rank} went on to a later commit without finishing its part "
                        "of this one (its capture failed there)"
                    )
                if went_on:
                    suspects.add(rank)
                missing.append(rank)
            if not missing:
                return
            if not still_running():
                raise RuntimeError(
                    f"commit {number}: commsched stopped before rank {missing[0]} finished its part"
                )
            time.sleep(pause)
            pause = min(2 * pause, _LAST_PAUSE_S)

    def copying(self, number: int) -> list[int]:
        """Ranks that started commit `number` (their slot holds it, not yet complete) and still run: their
        part is coming."""
        assert self.peers is not None
        index = number % SLOTS
        started = [rank for rank in self.peers if self._header(rank, index) == (number, 0)]
        return [rank for rank in started if _running(self.pids.get(rank, 0))]

    def _header(self, rank: int, index: int) -> tuple[int, int]:
        """(commit number, 1 if complete else 0) of slot `index` in `rank`'s mapped file."""
        header = self._peer_headers[rank]
        return int(header[2 * index]), int(header[2 * index + 1])


def _running(pid: int) -> bool:
    """True while process `pid` runs: not a zombie (killed, not yet reaped), not stopped (SIGSTOP: a
    rank the job is about to lose makes no progress)."""
    if pid <= 0:
        return False
    try:
        with open(f"/proc/{pid}/stat") as stat:
            state = stat.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X", "T", "t")


def _unlink(path: str | None, descriptor: int = -1) -> None:
    """Removes the name (the memory stays while mapped), then lets go of its lock."""
    if path is not None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    if descriptor >= 0:
        os.close(descriptor)


def _remove_stale() -> None:
    """Unlinks the files whose owner died before unlinking them (killed before sharing): their lock is free."""
    try:
        names = [name for name in os.listdir(DIRECTORY) if name.startswith("commsched-commit-")]
    except OSError:
        return
    for name in names:
        path = os.path.join(DIRECTORY, name)
        try:
            descriptor = os.open(path, os.O_RDONLY)
        except OSError:
            continue  # gone already, or another user's
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(descriptor)  # its owner is alive
            continue
        _unlink(path, descriptor)
