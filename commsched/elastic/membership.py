"""The membership service of an elastic job: a small TCP rendezvous server in commsched-run that
re-forms the ranks after a failure, and the client the ranks ask it with.

The protocol is one JSON line each way. A rank whose collectives failed in generation G sends
{"id": ID, "generation": G}; once every live rank has asked (or the join window has passed: a rank
that did not ask by then is stopped or hung, and the launcher kills it), each gets
{"rank", "size", "port", "generation"} of generation G + 1, or {"error": why} when fewer than
--min-np ranks are left. Ranks keep their order, so the lowest surviving rank becomes rank 0 and the
state is synchronised from it.

Growth: the launcher calls grow() with new worker ids and tells the ranks through the notice file;
they raise HostsUpdatedInterrupt at the same commit and ask as after a failure. The new generation is
the survivors followed by the new workers, which the launcher starts with their assignment (`spawn`).

Check-in: before a generation's rendezvous each rank sends {"id": ID, "generation": G, "ready": true}
and waits. Once every member of G has checked in, each gets {"go": true} and the rendezvous starts
with every rank there; if a member's process ends first (it died before it reached init()), the
ranks that checked in are re-formed at once, as if they had asked after a failure, instead of
waiting in the rendezvous for a rank that will never come.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from commsched import start_wait

log = logging.getLogger("commsched")

# Environment of an elastic rank: where the service listens, and which worker this process is.
ADDRESS_VARIABLE = "COMMSCHED_ELASTIC_ADDRESS"
ID_VARIABLE = "COMMSCHED_ELASTIC_ID"
# A worker started to join: the generation it joins (it asks nothing, its place is in its environment).
GENERATION_VARIABLE = "COMMSCHED_ELASTIC_GENERATION"
# A file the launcher rewrites ("TIMESTAMP REMOVED") when hosts changed; ranks read it at each commit.
NOTICE_VARIABLE = "COMMSCHED_ELASTIC_NOTICES"
# Seconds the ranks get to ask after the first asks (--elastic-timeout): a start waits less than that.
WINDOW_VARIABLE = start_wait.WINDOW_VARIABLE
# How long a rank waits for the new membership before giving up (the join window plus slack).
_CLIENT_WAIT_S = 120.0


class MembershipError(RuntimeError):
    """The job cannot go on at a smaller size: fewer ranks are left than --min-np allows."""


@dataclass(frozen=True)
class Assignment:
    """One rank's place in a generation of the job."""

    rank: int
    size: int
    port: int
    generation: int


@dataclass
class _Round:
    """A re-forming in progress: who asked, and until when the others may."""

    generation: int  # the generation that failed (or grows)
    deadline: float | None  # None: a growth nobody has asked for yet (the ranks ask at their next commit)
    asked: dict[int, socket.socket] = field(default_factory=dict)
    joiners: list[int] = field(default_factory=list)  # new workers the next generation adds


class MembershipServer:
    """Keeps the ranks of one elastic job and forms each new generation after a failure.

    `alive()` returns the ids of rank processes still running; `evict(ids)` ends the ones left out
    of a new generation (stopped or hung: they did not ask in time); `pick_port()` gives the new
    generation's rendezvous port; `spawn(id, assignment)` starts a new worker at its place; `ended()`
    returns the ids whose process has ended (by default every member not alive).
    """

    def __init__(
        self,
        members: list[int],
        port: int,
        min_np: int,
        max_np: int,
        join_window_s: float,
        alive: Callable[[], set[int]],
        evict: Callable[[list[int], str], None],
        pick_port: Callable[[], int],
        host: str = "127.0.0.1",
        spawn: Callable[[int, Assignment], None] | None = None,
        ended: Callable[[], set[int]] | None = None,
    ) -> None:
        self.members = list(members)  # ids in rank order, generation `generation`
        self.generation = 0
        self.port = port
        self.min_np = min_np
        self.max_np = max_np
        self.failure = ""  # set once the job cannot go on: the launcher ends it with this error
        self._window_s = join_window_s
        self._alive = alive
        self._evict = evict
        self._pick_port = pick_port
        self._spawn = spawn
        # Ids whose process has ended; a joiner not started yet is neither alive nor ended.
        self._ended = ended or (lambda: set(self.members) - self._alive())
        self._lock = threading.Lock()
        self._round: _Round | None = None
        self._ready: dict[int, socket.socket] = {}  # members of this generation checked in for its start
        self._listener = socket.create_server((host, 0))
        self._listener.settimeout(0.2)
        self.address = f"{host}:{self._listener.getsockname()[1]}"
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="commsched-membership", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stops listening; ranks still waiting get their connection closed."""
        self._closed.set()
        self._thread.join(timeout=2.0)
        self._listener.close()
        with self._lock:
            if self._round is not None:
                for connection in self._round.asked.values():
                    connection.close()
                self._round = None
            for connection in self._ready.values():
                connection.close()
            self._ready = {}

    @property
    def settled(self) -> bool:
        """True when no re-forming or growth is pending."""
        with self._lock:
            return self._round is None

    def grow(self, joiners: list[int]) -> bool:
        """Plans a generation with `joiners` added, formed once the ranks ask (after the notice).

        Returns False when a re-forming is pending or ranks are checking in to start a generation
        (the caller tries again later).
        """
        with self._lock:
            if self._round is not None or self._ready:  # re-forming, or a generation still starting
                return False
            self._round = _Round(self.generation, deadline=None, joiners=list(joiners))
            return True

    def poll(self) -> None:
        """Forms the pending generation once every live member asked or the window has passed; lets
        a generation's rendezvous start once every member checked in."""
        with self._lock:
            if self._round is None:
                self._release_or_reform()
            current = self._round
            if current is None:
                return
            alive = self._alive()
            waiting = [member for member in self.members if member in alive and member not in current.asked]
            if not current.asked:
                if not waiting:  # the ranks ended before they saw the notice: nothing left to grow
                    self._round = None
                return
            assert current.deadline is not None
            if waiting and time.monotonic() < current.deadline:
                return
            self._form(current, waiting)
            self._round = None

    def _release_or_reform(self) -> None:
        """Every member checked in: all may rendezvous. A member's process ended before it did: the
        generation cannot start, so the ranks that checked in re-form without it."""
        if not self._ready:
            return
        ended = self._ended()
        if not any(member in ended for member in self.members):
            if all(member in self._ready for member in self.members):
                for connection in self._ready.values():
                    _answer(connection, {"go": True})
                self._ready = {}
            return
        for member in ended & set(self._ready):  # checked in, then died: not a survivor
            self._ready.pop(member).close()
        self._start_round(_Round(self.generation, time.monotonic() + self._window_s))

    def _start_round(self, current: _Round) -> None:
        """Makes `current` the pending re-forming; ranks waiting at check-in wait for it instead."""
        current.asked.update(self._ready)
        self._ready = {}
        self._round = current

    def _form(self, current: _Round, unanswered: list[int]) -> None:
        """Answers every rank that asked with its place in the next generation (or the job's end)."""
        if unanswered:
            self._evict(unanswered, f"did not rejoin within {self._window_s:g}s (stopped or hung)")
        survivors = [member for member in self.members if member in current.asked]
        lost = [member for member in self.members if member not in current.asked]
        joiners = current.joiners[: max(0, self.max_np - len(survivors))]
        replies: dict[int, dict[str, Any]] = {}
        if not survivors or len(survivors) + len(joiners) < self.min_np:  # a joiner needs a survivor's state
            self.failure = (
                f"{ranks_text(lost)} (numbered as at launch) failed; {len(survivors)} "
                f"{'rank is' if len(survivors) == 1 else 'ranks are'} left, below --min-np {self.min_np}"
            )
            replies = {member: {"error": self.failure} for member in survivors}
        else:
            self.generation = current.generation + 1
            self.port = self._pick_port()
            self.members = survivors + joiners
            replies = {
                member: {
                    "rank": rank,
                    "size": len(self.members),
                    "port": self.port,
                    "generation": self.generation,
                }
                for rank, member in enumerate(self.members)
            }
            log.warning(
                "commsched-run: generation %d: %d ranks (%s, numbered as at launch, lost%s)",
                self.generation,
                len(self.members),
                ranks_text(lost),
                f"; {ranks_text(joiners)} joining" if joiners else "",
            )
            for member in joiners:
                if self._spawn is not None:
                    reply = replies[member]
                    self._spawn(
                        member, Assignment(reply["rank"], reply["size"], reply["port"], reply["generation"])
                    )
        for member, connection in current.asked.items():
            _answer(connection, replies[member])

    def _serve(self) -> None:
        while not self._closed.is_set():
            try:
                connection, _ = self._listener.accept()
            except TimeoutError:
                self.poll()
                continue
            except OSError:
                return
            threading.Thread(target=self._handle, args=(connection,), daemon=True).start()

    def _handle(self, connection: socket.socket) -> None:
        try:
            connection.settimeout(10.0)
            request = json.loads(_read_line(connection))
            member, generation = int(request["id"]), int(request["generation"])
            ready = bool(request.get("ready", False))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
            log.warning("commsched-run: a malformed membership request (%s)", error)
            connection.close()
            return
        connection.settimeout(None)
        with self._lock:
            if member not in self.members or generation != self.generation:
                why = (
                    f"rank process {member} is not in generation {self.generation} of this job "
                    f"(it asked after generation {generation}); it was left out after not answering in time"
                )
                _answer(connection, {"error": why})
                return
            if ready and self._round is None:
                earlier = self._ready.pop(member, None)  # a rank checking in again after it gave up
                if earlier is not None:
                    earlier.close()
                self._ready[member] = connection
            else:  # an ask, or a check-in while a re-forming is pending: it takes part in that
                if self._round is None:
                    self._start_round(_Round(generation, time.monotonic() + self._window_s))
                elif self._round.deadline is None:  # a growth: the others get the window from the first ask
                    self._round.deadline = time.monotonic() + self._window_s
                assert self._round is not None
                self._round.asked[member] = connection
        self.poll()


def request(address: str, member: int, generation: int, wait_s: float = _CLIENT_WAIT_S) -> Assignment:
    """Asks the membership service at `address` for this rank's place after `generation` failed."""
    try:
        answer = _exchange(address, {"id": member, "generation": generation}, wait_s)
    except TimeoutError as error:  # the service forms within its window: past this, it is stuck
        raise MembershipError(f"the membership service of commsched-run did not answer: {error}") from None
    return Assignment(
        int(answer["rank"]), int(answer["size"]), int(answer["port"]), int(answer["generation"])
    )


def check_in(address: str, member: int, generation: int, wait_s: float) -> Assignment | None:
    """Tells the service this rank is ready to start `generation`; returns None once every member is,
    or this rank's place in a new generation when a member was lost before it got there.

    Raises TimeoutError when the others have not all checked in within `wait_s`.
    """
    answer = _exchange(address, {"id": member, "generation": generation, "ready": True}, wait_s)
    if answer.get("go"):
        return None
    return Assignment(
        int(answer["rank"]), int(answer["size"]), int(answer["port"]), int(answer["generation"])
    )


def _exchange(address: str, message: dict[str, Any], wait_s: float) -> dict[str, Any]:
    """Sends `message` to the service and returns its answer (MembershipError for an error answer)."""
    host, _, port = address.rpartition(":")
    waited_out = False
    try:
        with socket.create_connection((host, int(port)), timeout=10.0) as connection:
            connection.sendall((json.dumps(message) + "\n").encode())
            connection.settimeout(wait_s)
            waited_out = True  # from here a timeout is the others not coming, not the service
            answer = json.loads(_read_line(connection))
    except TimeoutError:
        if not waited_out:
            raise MembershipError(
                f"the membership service of commsched-run at {address} did not answer; "
                "the launcher has ended or the job is over"
            ) from None
        raise TimeoutError(
            f"not every rank of generation {message['generation']} reached commsched.init() or asked to "
            f"re-form within {wait_s:g}s; the ranks that did re-form without the others"
        ) from None
    except (OSError, ValueError) as error:
        raise MembershipError(
            f"the membership service of commsched-run at {address} did not answer ({error}); "
            "the launcher has ended or the job is over"
        ) from None
    if "error" in answer:
        raise MembershipError(str(answer["error"]))
    return answer


def _answer(connection: socket.socket, reply: dict[str, Any]) -> None:
    """Sends `reply` and closes; a rank that died while waiting is left to the next generation."""
    try:
        connection.sendall((json.dumps(reply) + "\n").encode())
    except OSError:
        pass
    finally:
        connection.close()


def _read_line(connection: socket.socket) -> str:
    data = b""
    while not data.endswith(b"\n"):
        chunk = connection.recv(4096)
        if not chunk:
            raise ConnectionError("the connection closed before a whole message came")
        data += chunk
    return data.decode()


def ranks_text(ids: list[int]) -> str:
    """Names worker ids for a message: "rank 3", "ranks 1, 2" or "no rank"."""
    return ("rank " if len(ids) == 1 else "ranks ") + ", ".join(map(str, ids)) if ids else "no rank"
