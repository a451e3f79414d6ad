"""commsched-run's side of an elastic job (--min-np/--max-np): a failed rank is left out and the
others re-form through the membership service instead of the job ending."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

from commsched.elastic.membership import ADDRESS_VARIABLE, ID_VARIABLE, MembershipServer
from commsched.run import _how_it_ended, _Job, _say, free_port

_POLL_S = 0.05


class ElasticJob(_Job):
    """The local ranks of an elastic job: supervised, re-formed after failures, ended together at the end."""

    def __init__(self, *args: Any, min_np: int, max_np: int, join_window_s: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._min_np = min_np
        self._max_np = max_np
        self._window_s = join_window_s
        self._exits: dict[int, int] = {}
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
        )
        self._environment = dict(self._environment, **{ADDRESS_VARIABLE: self.server.address})
        try:
            return super().run()
        finally:
            self.server.close()

    def _rank_environment(self, rank: int) -> dict[str, str]:
        return dict(super()._rank_environment(rank), **{ID_VARIABLE: str(rank)})

    def _alive(self) -> set[int]:
        return {rank for rank, process in self._processes.items() if process.poll() is None}

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
        running = dict(self._processes)
        while running:
            for rank, process in list(running.items()):
                code = process.poll()
                if code is None:
                    continue
                del running[rank]
                self._exits[rank] = code
                if code != 0:
                    _say(
                        f"rank {rank} (numbered as at launch, pid {process.pid}) {_how_it_ended(code)}; "
                        f"the others re-form without it (--min-np {self._min_np})"
                    )
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
