"""commsched-run's side of an elastic job (--min-np/--max-np): a failed rank is left out and the
others re-form through the membership service instead of the job ending. With
--host-discovery-script the launcher polls the script: when slots appear (up to --max-np, or a lost
rank left room) it starts new ranks, which join at the survivors' next commit; when slots go, ranks
are stopped and the others go on without them."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from commsched.elastic import discovery
from commsched.elastic.membership import (
    ADDRESS_VARIABLE,
    GENERATION_VARIABLE,
    ID_VARIABLE,
    NOTICE_VARIABLE,
    WINDOW_VARIABLE,
    Assignment,
    MembershipServer,
    ranks_text,
)
from commsched.run import _how_it_ended, _Job, _say, _start_rank, free_port

_POLL_S = 0.05


class ElasticJob(_Job):
    """The local ranks of an elastic job: supervised, re-formed after failures, ended together at the end."""

    def __init__(
        self,
        *args: Any,
        min_np: int,
        max_np: int,
        join_window_s: float,
        discovery_script: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self._min_np = min_np
        self._max_np = max_np
        self._window_s = join_window_s
        self._script = discovery_script
        self._exits: dict[int, int] = {}
        self._slots = self._size  # what the script last gave (without one: -n, so nothing is added)
        self._discovered_at = 0.0
        self._script_error = ""
        self._spawns: list[tuple[int, Assignment]] = []  # handed over by the server's thread
        self._notices = Path(tempfile.mkdtemp(prefix="commsched-elastic-")) / "notices"
        self.server: MembershipServer | None = None

    def run(self) -> int:
        """Starts the membership service, then the ranks; returns the job's exit status."""
        self.server = MembershipServer(
            members=list(range(self._size)),
            port=int(self._environment["MASTER_PORT"]),
            min_np=self._min_np,
            max_np=self._max_np,
            join_window_s=self._window_s,
            alive=self._alive,
            evict=self._evict,
            pick_port=lambda: free_port(self._environment["MASTER_ADDR"]),
            spawn=lambda member, assignment: self._spawns.append((member, assignment)),
            ended=self._ended,
        )
        extra = {ADDRESS_VARIABLE: self.server.address, WINDOW_VARIABLE: f"{self._window_s:g}"}
        if self._script is not None:
            extra[NOTICE_VARIABLE] = str(self._notices)
        self._environment = dict(self._environment, **extra)
        try:
            return super().run()
        finally:
            self.server.close()
            self._notices.unlink(missing_ok=True)
            self._notices.parent.rmdir()

    def _rank_environment(self, rank: int) -> dict[str, str]:
        return dict(super()._rank_environment(rank), **{ID_VARIABLE: str(rank)})

    def _start_joiner(self, member: int, assignment: Assignment) -> None:
        """Starts worker `member` at its place in the new generation; it synchronises from rank 0."""
        environment = dict(
            self._environment,
            RANK=str(assignment.rank),
            LOCAL_RANK=str(assignment.rank),
            WORLD_SIZE=str(assignment.size),
            MASTER_PORT=str(assignment.port),
            **{ID_VARIABLE: str(member), GENERATION_VARIABLE: str(assignment.generation)},
        )
        self._processes[member] = subprocess.Popen(
            self._command,
            env=environment,
            start_new_session=True,
            preexec_fn=functools.partial(_start_rank, None),  # noqa: PLW1509 - called from the main thread
        )
        _say(
            f"rank {member} (numbered as at launch) started to join as rank {assignment.rank} of {assignment.size}"
        )

    def _discover(self) -> None:
        """Runs the discovery script at most once per poll period; grows or shrinks the job to its slots."""
        assert self.server is not None
        now = time.monotonic()
        if self._script is None or now - self._discovered_at < discovery.POLL_S:
            return
        self._discovered_at = now
        try:
            self._slots = discovery.discover(self._script)
            self._script_error = ""
        except discovery.DiscoveryError as error:
            if str(error) != self._script_error:  # said once per distinct error; the ranks go on as they are
                _say(f"{error}; the job goes on with its current ranks")
            self._script_error = str(error)
            return
        if not self.server.settled:
            return
        target = min(self._slots, self._max_np)
        alive = self._alive()
        members = list(self.server.members)
        if target < len(members):
            removed = members[target:]  # the newest go first; rank 0 stays, the state lives on
            self._evict(removed, f"is past the {self._slots} slots the discovery script gives now")
        elif target > len(members) and all(member in alive for member in members):
            first = max(self._processes) + 1
            if self.server.grow(list(range(first, first + target - len(members)))):
                self._notify(removed=False)

    def _notify(self, removed: bool) -> None:
        """Tells the ranks the hosts changed: they raise HostsUpdatedInterrupt at their next commit."""
        partial = self._notices.with_suffix(".new")
        partial.write_text(f"{time.time():.6f} {int(removed)}\n")
        partial.replace(self._notices)  # whole or not at all, for the ranks reading it

    def _too_few_left(self) -> str:
        """Why the job cannot go on when failed ranks left fewer running than --min-np (else ""):
        the rest cannot re-form, and one that is stopped would otherwise hold the job forever."""
        assert self.server is not None
        members = self.server.members
        if any(self._exits.get(member) == 0 for member in members):
            return ""  # the job is ending well: ranks finish one by one
        failed = [member for member in members if self._exits.get(member, 0) != 0]
        running = len(members) - len(failed)
        if not failed or running >= self._min_np:
            return ""
        return (
            f"{ranks_text(failed)} (numbered as at launch) failed; {running} "
            f"{'rank is' if running == 1 else 'ranks are'} left, below --min-np {self._min_np}"
        )

    def _ended(self) -> set[int]:
        return {rank for rank, process in list(self._processes.items()) if process.poll() is not None}

    def _alive(self) -> set[int]:
        return {rank for rank, process in list(self._processes.items()) if process.poll() is None}

    def _evict(self, ranks: list[int], why: str) -> None:
        for rank in ranks:
            _say(f"rank {rank} (numbered as at launch) {why}: SIGKILL, the others go on without it")
            try:
                os.killpg(self._processes[rank].pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def _supervise(self) -> int:
        """Waits for every rank; a failure is reported and left to the membership service."""
        assert self.server is not None
        while any(rank not in self._exits for rank in self._processes):
            while self._spawns:
                self._start_joiner(*self._spawns.pop(0))
            for rank, process in list(self._processes.items()):
                if rank in self._exits:
                    continue
                code = process.poll()
                if code is None:
                    continue
                self._exits[rank] = code
                if code != 0:
                    _say(
                        f"rank {rank} (numbered as at launch, pid {process.pid}) {_how_it_ended(code)}; "
                        f"the others re-form without it (--min-np {self._min_np})"
                    )
            if not self.server.failure:
                self.server.failure = self._too_few_left()
            if self.server.failure:
                _say(f"the job ends: {self.server.failure}")
                self._end(signal.SIGKILL)
                return 1
            if self._signals:
                number = self._signals[0]
                _say(f"got {signal.Signals(number).name}; passing it on to every rank")
                self._end(number)
                return 128 + number
            self.server.poll()
            self._discover()
            time.sleep(_POLL_S)
        if self.server.failure:
            _say(f"the job ends: {self.server.failure}")
            return 1
        # The job succeeded when every rank of the last generation did.
        failed = [rank for rank in self.server.members if self._exits.get(rank, 1) != 0]
        if failed:
            _say(
                f"ranks of the last generation failed (numbered as at launch): {', '.join(map(str, failed))}"
            )
            return 1
        return 0
