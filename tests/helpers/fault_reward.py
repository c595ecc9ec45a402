"""A reward function that misbehaves on one rank, for the fault tests (driven by environment variables).

RLHF_FAULT=raise|kill|block|wrong_len, RLHF_FAULT_RANK (default 1), RLHF_FAULT_CALL (the call that faults,
default 2), RLHF_FAULT_MARK (a file: the time of the fault is written there first).
"""
import os
import signal
import time

_calls = {"n": 0}


def reward_func(queries, prompts, labels, **kwargs):
    _calls["n"] += 1
    mode = os.environ.get("RLHF_FAULT", "")
    if (mode and int(os.environ.get("RANK", "0")) == int(os.environ.get("RLHF_FAULT_RANK", "1"))
            and _calls["n"] >= int(os.environ.get("RLHF_FAULT_CALL", "2"))):
        mark = os.environ.get("RLHF_FAULT_MARK")
        if mark:
            with open(mark, "w") as fh:
                fh.write(str(time.time()))
        if mode == "raise":
            raise ValueError("injected reward failure on this rank only")
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if mode == "block":
            time.sleep(10 ** 6)
        if mode == "wrong_len":
            return {"rewards": [0.0] * (len(queries) + 1)}
    return {"rewards": [float(len(q) % 3) / 2 for q in queries]}
