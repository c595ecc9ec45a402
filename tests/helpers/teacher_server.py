"""A teacher server that answers as vLLM's OpenAI-compatible server does for prompt log-probs, backed by an HF
causal LM (CPU), for rlhf.rl.teacher_client.

Follows vLLM vllm/entrypoints/openai/completion/protocol.py: ``CompletionRequest`` with ``prompt`` a list of
token-id lists and the extension ``prompt_logprobs: int`` (refused when ``stream`` is set with prompt_logprobs > 0
or -1, and when < 0 but not -1: "`prompt_logprobs` must be a positive value or -1."; with ``echo`` and no
prompt_logprobs, ``logprobs`` is used); each ``CompletionResponseChoice`` has ``index``, ``text``,
``prompt_token_ids`` and ``prompt_logprobs``: None for the first token, then {token id: {logprob, rank,
decoded_token}} with the prompt token and the top ``prompt_logprobs`` tokens (vllm/logprobs.py ``Logprob``; rank
1-based); ``/v1/models`` lists ``{"id": served name}``.  Prompt log-probs are from the raw logits (temperature 1).
"""
import threading
import time

import torch


def make_app(model, name: str = "teacher"):
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    app = FastAPI()

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [{"id": name, "object": "model"}]}

    @app.post("/v1/completions")
    def completions(body: dict):
        k = body.get("prompt_logprobs")
        if k is None and body.get("echo"):
            k = body.get("logprobs")
        if k is not None and (k < -1 or (body.get("stream") and (k > 0 or k == -1))):
            return JSONResponse({"error": {"message": "`prompt_logprobs` must be a positive value or -1.",
                                           "type": "BadRequestError", "code": 400}}, status_code=400)
        if body.get("model") != name:
            return JSONResponse({"error": {"message": f"The model `{body.get('model')}` does not exist.",
                                           "type": "NotFoundError", "code": 404}}, status_code=404)
        prompts = body["prompt"]
        choices = []
        for i, ids in enumerate(prompts):
            with torch.no_grad():
                lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
            entries = [None]
            for j in range(1, len(ids)):
                row = lp[j - 1]
                rank = int((row > row[ids[j]]).sum()) + 1
                e = {str(ids[j]): {"logprob": float(row[ids[j]]), "rank": rank, "decoded_token": str(ids[j])}}
                for r, v in enumerate(torch.topk(row, max(k or 0, 0)).indices.tolist()):
                    e.setdefault(str(v), {"logprob": float(row[v]), "rank": r + 1, "decoded_token": str(v)})
                entries.append(e)
            choices.append({"index": i, "text": "", "finish_reason": "length", "prompt_token_ids": ids,
                            "prompt_logprobs": entries if k is not None else None})
        return {"id": "cmpl-test", "object": "text_completion", "created": 0, "model": name, "choices": choices,
                "usage": {"prompt_tokens": sum(map(len, prompts)), "completion_tokens": len(prompts),
                          "total_tokens": sum(map(len, prompts)) + len(prompts)}}

    return app


class Served:
    """``with Served(model) as url:`` the app on a free local port, in a thread."""

    def __init__(self, model, name: str = "teacher"):
        import uvicorn

        from helpers.net import free_port

        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(make_app(model, name), host="127.0.0.1", port=self.port,
                                                    log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        for _ in range(200):
            if self.server.started:
                return f"http://127.0.0.1:{self.port}"
            time.sleep(0.05)
        raise RuntimeError("the teacher server did not start")

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(10)
