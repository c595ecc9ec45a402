"""The reward server on a GPU (marked gpu: skipped without CUDA)."""
import json
import os

import pytest
import torch

from rlhf.rm_server.app import Limits, RewardApp


@pytest.mark.gpu
def test_serve_rm_scores_on_cuda_in_bf16(tiny_kit):
    """On a GPU (issue 40 item 10): --device auto puts the model on CUDA (device_map="auto", OpenRLHF's serve_rm) in
    bf16; its scores match the CPU fp32 ones to bf16 rounding, and the app answers through its ASGI contract (no
    uvicorn needed: the GPU image has none)."""
    import asyncio

    from rlhf.rm_server.scoring import RewardScorer, resolve_placement

    texts = ["1+2=3", "1+2=4", "5+5=10" * 20]
    gpu = RewardScorer(os.path.join(tiny_kit, "reward"), batch_size=2, placement=resolve_placement("auto"))
    assert all(d.startswith("cuda") for d in gpu.devices()), gpu.devices()
    assert {p.dtype for p in gpu.model.parameters()} == {torch.bfloat16}
    cpu = RewardScorer(os.path.join(tiny_kit, "reward"), batch_size=2)
    assert gpu(texts) == pytest.approx(cpu(texts), abs=0.05)
    app = RewardApp(gpu, Limits())
    sent, calls = [], []

    async def receive():  # the body once, then a client that stays connected
        calls.append(1)
        if len(calls) > 1:
            await asyncio.sleep(3600)
        return {"type": "http.request", "body": json.dumps({"query": texts}).encode(), "more_body": False}

    async def send(msg):
        sent.append(msg)

    scope = {"type": "http", "path": "/get_reward", "method": "POST",
             "headers": [(b"content-length", b"%d" % len(json.dumps({"query": texts})))]}
    asyncio.run(app(scope, receive, send))
    assert sent[0]["status"] == 200, sent
    assert json.loads(sent[1]["body"])["rewards"] == pytest.approx(gpu(texts), abs=1e-3)
