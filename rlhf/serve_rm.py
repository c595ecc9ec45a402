"""HTTP reward server:  python -m rlhf.serve_rm --reward_pretrain DIR [--port 5000] [--api_key KEY]

POST /get_reward  {"query": [str, ...], "prompts": [...]?, "labels": [...]?}
  -> 200 {"rewards": [float], "scores": [float], "extra_logs": {"rm_query_truncated": [0.0 | 1.0]}}
GET /health -> 200 {"status": "ok"}
``query`` is the key OpenRLHF's client sends and its serve_rm reads (openrlhf/utils/remote_rm_utils.py
``remote_rm_fn``; openrlhf/cli/serve_rm.py ``data.get("query")``); ``queries`` (this library's older clients) is
accepted too.

Served by uvicorn (an ASGI server, as OpenRLHF's serve_rm; here a bare ASGI app, no web framework) with bounds a
shared training job needs (issue 27 item 6):
- a listen backlog of 2048 (the stdlib server's 5 reset 17-31% of 100 clients connecting at once);
- ``--request_timeout_s``: a request's headers, then its body, must arrive within it, and an idle keep-alive
  connection is closed after it: a client that trickles bytes is dropped (408), it does not hold a connection;
- ``--max_queries_per_request`` (413 beyond), ``--max_pending_queries`` queued over all requests (503 beyond,
  with Retry-After: the clients retry 5xx) and ``--max_connections`` (uvicorn's 503 beyond);
- scoring in micro-batches of ``--batch_size`` on one model thread, taken in turn: each request queues one
  micro-batch at a time, so a small request waits for about one micro-batch per active request, not for a
  large request to finish;
- ``--request_deadline_s``: a request not scored by then gets 504 and its remaining micro-batches are dropped;
  a client that disconnects has its remaining micro-batches dropped at once;
- ``--api_key`` (or RLHF_RM_API_KEY): requests to /get_reward without ``Authorization: Bearer <key>`` get 401;
  for a server bound beyond localhost in a multi-node job.  The trainer's client sends RLHF_RM_API_KEY.

Flags: OpenRLHF's serve_rm flags (openrlhf/cli/serve_rm.py), flat (0.9-0.10: ``--reward_pretrain``,
``--normalize_reward``, ``--value_head_prefix``, ``--max_len``, ``--param_dtype``, ``--bf16``, ``--flash_attn``,
``--attn_implementation``, ``--packing_samples``, ``--disable_fast_tokenizer``) and dotted (0.11:
``--reward.model_name_or_path``, ``--reward.normalize_enable``, ``--ds.value_head_prefix``, ``--data.max_len``,
``--ds.param_dtype``, ``--ds.attn_implementation``, ``--ds.experts_implementation``, ``--ds.packing_samples``,
``--data.disable_fast_tokenizer``), with OpenRLHF's meaning: the model on every visible GPU (device_map "auto")
in bf16 by default, flash attention where it exists; the raw score unless ``--normalize_reward`` (then
(score - mean) / std with the mean/std saved with the model).  Differences: ``--host`` defaults to 127.0.0.1
(OpenRLHF 0.0.0.0), ``--batch_size`` to 16 (OpenRLHF: the whole request in one forward), the CPU is served in fp32
with sdpa (``--device``, ``--param_dtype auto``); ``--load_in_4bit`` and ``--use_ms`` are refused.

Bounds on one request's work (issue 42 items 8, 9): a body nested too deep for the JSON parser is a 400; bodies over
256 KiB are parsed on a worker thread; each query is cut to its last ``--max_len * 8`` characters (more only where
that leaves too few tokens) before tokenizing; a request that cannot be scored within ``--request_deadline_s`` at
the fastest rate this server has measured (on a warm-up micro-batch at start, then on requests) is refused up front
with 413, naming how many queries would fit.

Queries longer than ``--max_len`` tokens keep their last ``--max_len`` tokens (the response and the end of the
prompt; the score is read at the last token) and are flagged per row in ``extra_logs.rm_query_truncated`` (the
trainers log it as ``reward_rm_query_truncated``).  OpenRLHF's serve_rm truncates from the right (tokenizer
default), which cuts the response: every answer to one long prompt then gets the same reward.
"""
from __future__ import annotations

import os
import sys
from typing import Optional

import click
import torch

from rlhf.rm_server.app import API_KEY_ENV, Limits, RewardApp
from rlhf.rm_server.scoring import RewardScorer, resolve_placement
from rlhf.rm_server.server import PortUnavailable, RewardServer


def _loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


class Refused(click.ClickException):
    """A start-up refusal: one line ``Error: <what and the fix>``, exit status 2 (click's usage errors' status,
    without their usage lines)."""
    exit_code = 2


def _alias(flat: str, dotted: Optional[str], *more: str):
    """OpenRLHF's flat (0.10) and dotted (0.11, openrlhf/utils/config.py ``hierarchize``) spellings of one flag."""
    return tuple(x for x in (flat, dotted, *more) if x)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(*_alias("--reward_pretrain", "--reward.model_name_or_path"), "reward_pretrain", default=None,
              help="reward model dir (a *ForSequenceClassification save, this library's or OpenRLHF's)")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="address to listen on (OpenRLHF: 0.0.0.0; here localhost unless asked, see --api_key)")
@click.option("--port", default=5000, show_default=True, help="0 picks a free port and prints it")
@click.option("--batch_size", default=16, show_default=True,
              help="queries per forward (micro-batch); OpenRLHF's default (none) is a whole request at once")
@click.option(*_alias("--max_len", "--data.max_len"), "max_len", default=2048, show_default=True,
              help="tokens per query; longer ones keep their last max_len tokens")
@click.option(*_alias("--normalize_reward", "--reward.normalize_enable"), "normalize_reward", is_flag=True,
              help="serve (score - mean) / std with the mean/std saved with the model (OpenRLHF's meaning); "
                   "without it the raw score")
@click.option(*_alias("--value_head_prefix", "--ds.value_head_prefix"), "value_head_prefix", default=None,
              help="name of the reward head's weights (default: config.json's, else score)")
@click.option("--device", default="auto", show_default=True,
              help="auto (CUDA when there is one, else cpu), cuda (every visible GPU, device_map='auto' as "
                   "OpenRLHF), cuda:N (one GPU) or cpu")
@click.option(*_alias("--param_dtype", "--ds.param_dtype"), "param_dtype", default="auto", show_default=True,
              type=click.Choice(["auto", "bf16", "fp16", "fp32"]),
              help="weights' dtype; auto: bf16 on a GPU (OpenRLHF's default), fp32 on the CPU")
@click.option("--bf16", is_flag=True, help="= --param_dtype bf16 (OpenRLHF <= 0.9)")
@click.option(*_alias("--attn_implementation", "--ds.attn_implementation"), "attn_implementation", default="auto",
              show_default=True, help="auto: flash_attention_2 on a GPU with flash_attn installed, else sdpa; a "
                                      "flash implementation without them falls back to sdpa with a notice")
@click.option("--flash_attn", is_flag=True, help="= --attn_implementation flash_attention_2 (OpenRLHF <= 0.8)")
@click.option(*_alias("--experts_implementation", "--ds.experts_implementation"), "experts_implementation",
              default=None, type=click.Choice(["eager", "batched_mm", "grouped_mm", "deepgemm"]),
              help="MoE expert kernels, passed to from_pretrained (OpenRLHF's)")
@click.option(*_alias("--packing_samples", "--ds.packing_samples"), "packing_samples", is_flag=True,
              help="accepted (OpenRLHF's): scores are the same padded or packed; this server pads")
@click.option(*_alias("--disable_fast_tokenizer", "--data.disable_fast_tokenizer"), "disable_fast_tokenizer",
              is_flag=True, help="accepted (OpenRLHF's); the fast tokenizer is used (the same token ids)")
@click.option(*_alias("--load_in_4bit", "--ds.load_in_4bit"), "load_in_4bit", is_flag=True,
              help="refused: 4-bit loading (bitsandbytes) is not supported here")
@click.option("--use_ms", is_flag=True, help="refused: ModelScope's hub is not supported; give a local dir")
@click.option("--request_timeout_s", default=30.0, show_default=True,
              help="a request's headers, then its body, must arrive within this; idle connections are closed "
                   "after it")
@click.option("--request_deadline_s", default=300.0, show_default=True,
              help="a request not scored within this gets 504 and its remaining work is dropped; one that cannot "
                   "be scored within it at the measured rate gets 413 up front")
@click.option("--max_queries_per_request", default=4096, show_default=True, help="413 beyond")
@click.option("--max_pending_queries", default=65536, show_default=True,
              help="queries queued over all requests; 503 (retry) beyond")
@click.option("--max_connections", default=512, show_default=True, help="open connections; 503 beyond")
@click.option("--api_key", default=None, envvar=API_KEY_ENV, show_envvar=True,
              help="require 'Authorization: Bearer <key>' (the trainer sends $RLHF_RM_API_KEY)")
@click.option("--warmup/--no_warmup", default=True, show_default=True,
              help="score one micro-batch of --batch_size rows at start (512 tokens on a GPU, 128 on the CPU): a "
                   "model that does not fit fails now, and the rate the 413 check uses is known from the first "
                   "request")
def main(reward_pretrain, host, port, batch_size, max_len, normalize_reward, value_head_prefix, device, param_dtype,
         bf16, attn_implementation, flash_attn, experts_implementation, packing_samples, disable_fast_tokenizer,
         load_in_4bit, use_ms, request_timeout_s, request_deadline_s, max_queries_per_request, max_pending_queries,
         max_connections, api_key, warmup):
    """python -m rlhf.serve_rm --reward_pretrain DIR: serve a reward model over HTTP (OpenRLHF's serve_rm flags,
    flat and dotted, with OpenRLHF's meaning; see the module docstring)."""
    from rlhf.models.load import ModelKindError, check_model_dir

    if not reward_pretrain:
        raise click.UsageError("give the reward model: --reward_pretrain DIR (or --reward.model_name_or_path DIR)")
    if load_in_4bit:
        raise click.UsageError("--load_in_4bit: 4-bit loading (bitsandbytes) is not supported by rlhf.serve_rm; drop "
                               "it (--param_dtype bf16, the default on a GPU, halves fp32's memory)")
    if use_ms:
        raise click.UsageError("--use_ms: ModelScope's hub is not supported; download the model and give its local "
                               "dir as --reward_pretrain")
    if bf16:
        if param_dtype not in ("auto", "bf16"):
            raise click.UsageError(f"--bf16 and --param_dtype {param_dtype} disagree; give one of them")
        param_dtype = "bf16"
    if flash_attn:
        if attn_implementation not in ("auto", "flash_attention_2"):
            raise click.UsageError(f"--flash_attn and --attn_implementation {attn_implementation} disagree; give one")
        attn_implementation = "flash_attention_2"
    for name, v in (("--batch_size", batch_size), ("--max_len", max_len), ("--max_connections", max_connections),
                    ("--max_queries_per_request", max_queries_per_request),
                    ("--max_pending_queries", max_pending_queries)):
        if v < 1:
            raise click.UsageError(f"{name} must be >= 1, got {v}")
    if request_timeout_s <= 0 or request_deadline_s <= 0:
        raise click.UsageError("--request_timeout_s and --request_deadline_s must be > 0")
    try:
        check_model_dir(reward_pretrain, "reward", "reward_pretrain", need_tokenizer=True,
                        value_head_prefix=value_head_prefix)
        placement = resolve_placement(device, param_dtype, attn_implementation)
    except (ModelKindError, ValueError) as e:
        raise click.UsageError(str(e)) from None
    limits = Limits(request_timeout_s, request_deadline_s, max_queries_per_request, max_pending_queries,
                    max_connections, api_key=api_key or None)
    try:  # bind first: a port in use is said in one line before minutes of model loading
        server = RewardServer(RewardApp(None, limits), host, port)
    except (PortUnavailable, ImportError) as e:
        raise Refused(str(e)) from None
    for note in placement.notes:
        click.echo(note, err=True)
    torch.set_grad_enabled(False)
    extra = {"experts_implementation": experts_implementation} if experts_implementation else {}
    scorer = RewardScorer(reward_pretrain, batch_size, max_len, value_head_prefix, normalize=normalize_reward,
                          placement=placement, **extra)
    server.app.scorer = scorer
    if warmup:  # shorter rows on the CPU: the cost per token grows with length, so the rate errs fast (no false 413)
        server.app.record_rate(*scorer.warm_up(batch_size, min(max_len, 512 if scorer.device.type != "cpu" else 128)))
    if not api_key and not _loopback(host):
        click.echo(f"[serve_rm] warning: listening on {host} without --api_key: anyone who reaches this port can "
                   f"use it; set --api_key (or ${API_KEY_ENV}) here and {API_KEY_ENV} for the trainer", err=True)
    shown = f"[{host}]" if ":" in host else host
    dtype = str(placement.dtype).replace("torch.", "")
    click.echo(f"reward server on http://{shown}:{server.server_address[1]}/get_reward"
               + (" (API key required)" if api_key else "")
               + f" [{','.join(scorer.devices())}, {dtype}, "
                 f"{placement.attn_implementation}, max_len {max_len}, batch {batch_size}"
               + (", normalized" if scorer.stats != (0.0, 1.0) else "") + "]")
    sys.stdout.flush()
    os.environ.pop(API_KEY_ENV, None)  # not inherited by anything this process starts
    server.serve_forever()


if __name__ == "__main__":
    main()
