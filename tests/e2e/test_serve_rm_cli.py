"""The reward server as users start it: python -m rlhf.serve_rm in its own process, then the train-time client."""
import json
import os
import urllib.error
import urllib.request

import pytest
import torch

from rlhf.rewards.result import RewardError
from rlhf.rewards.reward_func import make_reward_source


def test_serve_rm_cli_end_to_end(tiny_kit, monkeypatch):
    """python -m rlhf.serve_rm as users start it, its API key from RLHF_RM_API_KEY; then train-time client calls
    against it, without the key (401, named) and with it."""
    import re
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "rlhf.serve_rm", "--reward_pretrain", os.path.join(tiny_kit, "reward"),
                             "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, HF_HUB_OFFLINE="1", RLHF_RM_API_KEY="k-123"))
    try:
        url = None
        for line in proc.stdout:
            m = re.search(r"(http://127\.0\.0\.1:\d+/get_reward)", line)
            if m:
                url = m.group(1)
                break
        assert url, "server did not report its address"
        assert "(API key required)" in line, line
        monkeypatch.delenv("RLHF_RM_API_KEY", raising=False)
        with pytest.raises(RewardError, match=r"\(401\).*RLHF_RM_API_KEY"):
            make_reward_source(url)(["1+2=3"], ["1+2="], ["3"])
        monkeypatch.setenv("RLHF_RM_API_KEY", "k-123")
        src = make_reward_source(url)
        out = src(["1+2=3", "1+2=4"], ["1+2=", "1+2="], ["3", "3"])
        assert out["rewards"].shape == (2,) and torch.isfinite(out["rewards"]).all()
        with urllib.request.urlopen(url.replace("/get_reward", "/health"), timeout=10) as r:
            assert json.loads(r.read()) == {"status": "ok"}
    finally:
        proc.terminate()
        proc.wait(timeout=30)


# ---- issue 40 item 10, issue 41 item 14, issue 42 items 8, 9, 15 -------------------------------------------------
# OpenRLHF's examples/scripts/serve_remote_rm.sh, 0.11 (dotted) and 0.10.1 (flat), as written but for the model path
# and the port (0: a free one).  Read at OpenRLHF main (version.txt 0.11.0) and tag v0.10.1.
