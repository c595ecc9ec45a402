"""Code reward: run the response's python code with the label's asserts in a subprocess with a timeout.

The response's first ```python block (or the whole response) is written to a temp
dir with the tests appended, and run with ``python -I`` (isolated), no stdin, a
CPU-time and memory rlimit, and a wall-clock timeout.  Reward 1 if it exits 0.
"""
import os
import re
import resource
import subprocess
import sys
import tempfile

import torch

TIMEOUT_S = 5


def _limits():
    resource.setrlimit(resource.RLIMIT_CPU, (TIMEOUT_S, TIMEOUT_S))
    resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))


def _code(text: str) -> str:
    m = re.search(r"```(?:python)?\n(.*?)```", text, re.S)
    return m.group(1) if m else text


def run_one(code: str, tests: str) -> float:
    with tempfile.TemporaryDirectory() as d:
        f = os.path.join(d, "prog.py")
        with open(f, "w") as fh:
            fh.write(code + "\n\n" + tests + "\n")
        try:
            r = subprocess.run([sys.executable, "-I", f], cwd=d, stdin=subprocess.DEVNULL, capture_output=True,
                               timeout=TIMEOUT_S, preexec_fn=_limits, env={"PATH": "/usr/bin:/bin"})
        except subprocess.TimeoutExpired:
            return 0.0
        return 1.0 if r.returncode == 0 else 0.0


def reward_func(queries, prompts, labels, **kwargs):
    r = torch.tensor([run_one(_code(q[len(p):]), str(lab)) for q, p, lab in zip(queries, prompts, labels)])
    return {"rewards": r, "scores": r, "extra_logs": {"pass_rate": r}}
