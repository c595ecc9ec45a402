"""A reward function that stops its own rank with SIGTERM on one call and then keeps computing (a long reward call
that outlives the signal), for the stop tests.  RLHF_STOP_CALL: the call (default 2); RLHF_STOP_AFTER_S: how long
the call goes on after the signal (default 3)."""
import os
import signal
import sys
import time

_calls = {"n": 0}


def reward_func(queries, prompts, labels, **kwargs):
    _calls["n"] += 1
    if _calls["n"] == int(os.environ.get("RLHF_STOP_CALL", "2")):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(float(os.environ.get("RLHF_STOP_AFTER_S", "3")))
        print(f"[stop_reward] call {_calls['n']} returned", file=sys.stderr, flush=True)
    return {"rewards": [float(len(q) % 3) / 2 for q in queries]}
