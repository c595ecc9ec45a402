"""Phase scheduler for colocated roles: wake role -> work -> (next phase sleeps it), ordered by barriers.

Every memory-heavy role on a rank is ``Sleepable``.  ``phase(name)`` first waits for all ranks of the group to
finish the previous phase, then puts every other awake role on this rank to sleep, then wakes ``name``.  A phase
may ``share`` a role that stays awake beside it (weight sync: actor parameters and the engine's weights, not its
KV cache).  The ledger records each transition so tests can assert the protocol.

What a role holds (``memory_state``: ``full``, ``weights`` for a vLLM engine whose KV cache sleeps, ``asleep``) is
the role's own answer, backed by its engine (vLLM: ``rlhf.engines.vllm_memory.EngineMemory``; the HF engine and
the train engines: resident or offloaded).  The scheduler keeps no copy: "awake" means a state other than
``asleep``, asked each time.  ``sync_follows(role)`` passes on that a weight sync comes before the role's next
generate, so its next sleep may discard its weights (vLLM sleep level 2).  veRL's rollout contract names the same
moves ``resume(tags)`` / ``release`` (verl/workers/rollout/base.py ``BaseRollout``).
"""
from __future__ import annotations

import contextlib
import threading
from typing import Dict, Iterable, List, Optional, Protocol, Tuple

from rlhf.distributed import comm

MEMORY_STATES = ("full", "weights", "asleep")


class Sleepable(Protocol):
    """A role holding memory (rlhf.roles.base.Role)."""

    def sleep(self) -> None: ...

    def wake(self, tags: Optional[List[str]] = None) -> None: ...

    def memory_state(self) -> str:
        """One of ``MEMORY_STATES``."""

    def sync_follows(self) -> None:
        """A weight sync comes before the next use (a role that keeps its weights ignores it)."""


class Ledger:
    """Append-only record of (seq, rank, event, role, awake-after) per transition."""

    def __init__(self, rank: int):
        self.rank = rank
        self.events: List[Tuple[int, int, str, str, Tuple[str, ...]]] = []
        self._lock = threading.Lock()

    def record(self, event: str, role: str, awake: Iterable[str]) -> None:
        with self._lock:
            self.events.append((len(self.events), self.rank, event, role, tuple(sorted(awake))))

    def max_awake(self, allowed_pairs: Iterable[Tuple[str, str]] = ()) -> int:
        """Most roles awake at once from the first phase on, not counting declared shared pairs
        (loading puts every role in memory once, before the scheduler first sends them to sleep)."""
        allowed = {tuple(sorted(p)) for p in allowed_pairs}
        worst = 0
        first = next((i for i, e in enumerate(self.events) if e[2] == "begin"), len(self.events))
        for *_, awake in self.events[first:]:
            n = len(awake)
            if n == 2 and tuple(sorted(awake)) in allowed:
                n = 1
            worst = max(worst, n)
        return worst


class PhaseScheduler:
    def __init__(self, rank: int, roles: Dict[str, Sleepable], group=None, enabled: bool = True,
                 ledger: Optional[Ledger] = None, barrier: bool = True):
        self.rank = rank
        self.roles = roles            # role name -> object on this rank
        self.group = group            # barrier group (all ranks sharing these roles)
        self.enabled = enabled        # False: roles stay resident (no offload)
        self.use_barrier = barrier    # separate-role placement: phases on different ranks must not wait on each other
        self.ledger = ledger or Ledger(rank)
        for r in roles:
            self.ledger.record("init", r, self.awake)

    @property
    def awake(self) -> List[str]:
        """The roles holding memory on this rank, in the roles' order, asked of each role (everything starts
        resident)."""
        return [r for r, obj in self.roles.items() if obj.memory_state() != "asleep"]

    def _barrier(self):
        if self.use_barrier:
            comm.barrier(self.group)

    def sleep(self, role: str) -> None:
        if role in self.roles and self.memory_state(role) != "asleep":
            self.roles[role].sleep()
            self.ledger.record("sleep", role, self.awake)

    def memory_state(self, role: str) -> str:
        """The role's own answer: one of ``MEMORY_STATES``."""
        state = self.roles[role].memory_state()
        if state not in MEMORY_STATES:
            raise ValueError(f"role {role!r} reports memory state {state!r}; one of {MEMORY_STATES}")
        return state

    def wake(self, role: str, tags: Optional[List[str]] = None) -> None:
        """Wake fully (tags None) or only the given parts; the role maps what is missing, each part once (a
        partial role woken with None maps the rest)."""
        if role not in self.roles or self.memory_state(role) == "full":
            return
        self.roles[role].wake(tags)
        self.ledger.record("wake" if not tags else f"wake:{','.join(tags)}", role, self.awake)

    def sync_follows(self, role: str) -> None:
        """A weight sync comes before ``role``'s next generate (the step's rollout is done): its next sleep may
        discard its weights.  No-op while the scheduler is off or the role is not on this rank."""
        if self.enabled and role in self.roles:
            self.roles[role].sync_follows()

    def put_all_to_sleep(self) -> None:
        if self.enabled:
            for r in self.awake:
                self.sleep(r)

    @contextlib.contextmanager
    def phase(self, name: str, role: Optional[str] = None, share: Optional[str] = None,
              tags: Optional[List[str]] = None):
        """Run one phase of work for ``role`` (default: ``name``) on this rank."""
        role = role or name
        self._barrier()
        if self.enabled:
            for other in self.awake:
                if other not in (role, share):
                    self.sleep(other)
            self.wake(role, tags)
            if share is not None and share not in self.awake:
                self.wake(share)
        self.ledger.record("begin", name, self.awake)
        try:
            yield
        finally:
            self.ledger.record("end", name, self.awake)
