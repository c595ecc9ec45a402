"""The base of the tests' stand-in rollout engines: the real contract (rlhf.engines.rollout.RolloutEngine), so a stand-in
answers every capability the trainer asks for with the library's documented defaults.  A stand-in overrides what its
test exercises; a call its test does not expect fails loudly instead of passing silently."""
from rlhf.engines.rollout import RolloutEngine


class StandInEngine(RolloutEngine):
    """Always resident in memory terms (sleep / wake only change ``memory_state``, as on CPU); weights and
    generation raise unless the stand-in defines them."""

    _asleep = False

    def generate(self, prompt_ids, params):
        raise AssertionError(f"{type(self).__name__} does not generate in this test")

    def load_weights(self, named_tensors) -> None:
        raise AssertionError(f"{type(self).__name__} does not load weights in this test")

    def reset_prefix_cache(self) -> None:
        raise AssertionError(f"{type(self).__name__} does not load weights in this test")

    def sleep(self) -> None:
        self._asleep = True

    def wake(self, tags=None) -> None:
        self._asleep = False

    def memory_state(self) -> str:
        return "asleep" if self._asleep else "full"
