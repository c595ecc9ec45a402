"""A vLLM engine's memory: its sleep state (``EngineMemory``, the one caller of vLLM's sleep mode), PyTorch's cache
handed back before vLLM maps memory (``empty_device_cache``), and the process groups an in-process engine leaves
behind (``release_vllm_groups``)."""
from __future__ import annotations

from typing import List, Optional, Sequence


def empty_device_cache() -> None:
    """Give PyTorch's cached CUDA blocks back to the driver before vLLM maps memory with ``cuMemCreate`` (the
    actor's backward leaves them cached; vLLM's allocator cannot use them).  TRL (``torch.cuda.empty_cache()``
    before ``llm.wake_up``, trl/trainer/grpo_trainer.py), veRL (``torch.cuda.empty_cache()`` before
    ``wake_up(tags=["weights"])`` and again before ``wake_up(tags=["kv_cache"])``,
    verl/workers/sharding_manager/fsdp_vllm.py ``__enter__``) and SkyRL do the same.  No-op without CUDA."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


TAGS = ("weights", "kv_cache")  # vLLM's deferrable sleep tags, in waking order (vllm/device_allocator DEFERRABLE_TAGS)


class EngineMemory:
    """The one owner of a vLLM engine's sleep state and of every call into vLLM's sleep mode.

    States (``state``): ``full`` (weights and KV cache mapped), ``weights`` (weights only, for a weight sync),
    ``asleep``.  Transitions and the vLLM contract each one follows:

    * ``wake(tags)`` maps each missing tag of ``tags`` (None: all) once, ``weights`` before ``kv_cache``, each
      with its own ``wake_up(tags=[tag])``.  Never ``wake_up(None)`` after a partial wake: vLLM's allocator
      maps every allocation the call names again (``CuMemAllocator.wake_up``: ``if tags is None or data.tag in
      tags: create_and_map(handle)`` in vllm/device_allocator/cumem.py before the ``is_asleep`` guard of
      0.32), a CUDA error or a second copy; and ``wake_up(tags=[...])`` naming a tag that is awake warns and
      wakes nothing (vllm/v1/executor/abstract.py ``wake_up``: "Tag %s is not in sleeping tags").  TRL, veRL
      (``wake_up(tags=["weights"])`` ... sync ... ``wake_up(tags=["kv_cache"])``) and OpenRLHF do the same.
    * Before each ``wake_up``, ``empty_cache()`` (``empty_device_cache``): PyTorch's cached blocks would
      otherwise leave ``cuMemCreate`` short of memory (vLLM 0.32's allocator empties it too; earlier ones do not).
    * ``sleep()`` at level 2 (weights discarded, vllm/entrypoints/llm.py ``sleep``: "Good for ... update the
      model") when ``sync_follows()`` was called since the last wake, else level 1 (weights copied to pinned host
      memory and restored).  A partial engine first maps its KV cache: vLLM's allocator sleep unmaps every
      allocation it holds (cumem.py ``sleep`` before 0.32 has no ``is_asleep`` check).
    * After a level-2 sleep the weights are garbage until a weight sync completes (``weights_loaded``);
      ``check_generate`` raises on a generate before that, or on a generate with a tag still asleep.

    ``enabled=False`` (no sleep mode on the platform, e.g. CPU): no call into vLLM, nothing is released; ``state``
    still follows sleep and wake (the phase scheduler asks it, as it asks every role), and ``check_generate`` passes
    whatever it says."""

    def __init__(self, llm, level: int = 2, enabled: bool = True, empty_cache=None):
        if level not in (1, 2):
            raise ValueError(f"--vllm_sleep_level must be 1 or 2, got {level}")
        self.llm, self.level, self.enabled = llm, level, enabled
        self.empty_cache = empty_cache or empty_device_cache
        self.mapped = set(TAGS)        # vLLM starts with every allocation mapped
        self.weights_valid = True      # False from a level-2 sleep until a weight sync completes
        self._sync_follows = False
        self.calls: List[tuple] = []   # every call made into vLLM's sleep mode, in order

    @property
    def state(self) -> str:
        return "full" if self.mapped == set(TAGS) else ("weights" if self.mapped else "asleep")

    def sync_follows(self) -> None:
        """The next wake of this engine is for a weight sync: its next sleep may discard the weights."""
        self._sync_follows = True

    def sleep(self) -> None:
        if not self.mapped:
            return
        if not self.enabled:  # nothing to release: the state records that a wake comes before the next generate
            self.mapped.clear()
            self._sync_follows = False
            return
        # level 2 when a sync follows, or when the weights are garbage anyway (dummy start, or a level-2 sleep not
        # yet followed by a sync): a level-1 sleep would copy random values to pinned host memory and back
        level = self.level if (self._sync_follows or not self.weights_valid) else 1
        self.wake()  # a partial engine maps its KV cache first: vLLM's sleep releases every allocation
        self.calls.append(("sleep", level))
        self.llm.sleep(level=level)
        self.mapped.clear()
        self._sync_follows = False
        if level == 2:
            self.weights_valid = False

    def wake(self, tags: Optional[Sequence[str]] = None) -> None:
        want = TAGS if tags is None else tuple(tags)
        unknown = [t for t in want if t not in TAGS]
        if unknown:
            raise ValueError(f"vLLM sleep tags are {TAGS}, got {unknown}")
        if not self.enabled:
            self.mapped.update(want)
            self._sync_follows = False
            return
        for tag in TAGS:
            if tag in want and tag not in self.mapped:
                self.empty_cache()
                self.calls.append(("wake_up", tag))
                self.llm.wake_up(tags=[tag])
                self.mapped.add(tag)
        self._sync_follows = False

    def weights_loaded(self) -> None:
        """A weight sync completed: the weights are valid again (after a level-2 sleep they were not)."""
        self.weights_valid = True

    def check_generate(self) -> None:
        if self.enabled and self.state != "full":
            raise RuntimeError(f"vLLM engine asked to generate while {self.state} (tags awake: {sorted(self.mapped)}):"
                               f" wake it fully first (the phase scheduler does)")
        if not self.weights_valid:
            raise RuntimeError("vLLM engine asked to generate after a level-2 sleep discarded its weights, or on the "
                               "dummy weights it started on, before a weight sync loaded them: sync first (the "
                               "trainer's first_sync), call sync_follows() only where a sync comes before the next "
                               "generate, or use --vllm_sleep_level 1")


def release_vllm_groups() -> None:
    """Drop the process groups an in-process (colocated) vLLM engine made over the trainer's world.

    vLLM keeps them in module globals (vllm/distributed/parallel_state.py ``_WORLD``, ``_TP``, ``_PP``, ...); left
    there after the trainer's world is destroyed, the next engine made in this process reuses the stale world group
    and fails in ``ensure_model_parallel_initialized`` ("Process group ... is not initialized in the world group
    map").  vLLM's own ``destroy_distributed_environment`` would also destroy torch's default group, which belongs
    to the trainer here (external launcher), so the world coordinator is destroyed by hand: its device and CPU
    groups only (``GroupCoordinator.destroy``)."""
    import torch.distributed as tdist
    from vllm.distributed import parallel_state as ps

    if not tdist.is_initialized():  # the groups went with the world
        ps._WORLD = None
        return
    ps.destroy_model_parallel()
    if ps._WORLD is not None:
        ps._WORLD.destroy()
        ps._WORLD = None
