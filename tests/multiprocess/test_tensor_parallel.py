"""Tensor parallelism (--tp_size) and hybrid sharding (--fsdp_shard_size) on 4 gloo ranks, one launch: each layout's
loss, gradients, clipped gradient norm and AdamW-updated weights equal one process's (tests/helpers/tp_checks.py):
TP 2 x FSDP 2 for tiny Llama (GQA), Qwen2 (q/k/v biases, tied embeddings) and Qwen3 (per-head q/k norms, whose
gradients are all-reduced over TP); TP 2 x SP 2 (Ulysses over the local heads); HSDP 2 x 2; TP 2 with HSDP; a
Qwen2 critic (backbone split over TP, value head replicated); the Qwen3 engine's checkpoint round trip."""
from helpers.mp import spawn

CASES = [
    ("llama tp2 x fsdp2", "llama", 2, 1, 0),
    ("qwen2 tp2 x fsdp2, tied head", "qwen2", 2, 1, 0, True),
    ("qwen3 tp2 x fsdp2", "qwen3", 2, 1, 0),
    ("llama tp2 x sp2", "llama", 2, 2, 0, False, True, 4),
    ("qwen2 hsdp (replicate 2 x shard 2)", "qwen2", 1, 1, 2),
    ("llama tp2 x hsdp (replicate 2 x shard 1)", "llama", 2, 1, 1),
    ("qwen2 critic tp2 x fsdp2", "qwen2", 2, 1, 0, False, True, 2, True),
]


def _cases(rank, world, path):
    from helpers.tp_checks import checkpoint_roundtrip, run_case

    for case in CASES:
        eng = run_case(rank, *case)
        if case[0].startswith("qwen3"):
            checkpoint_roundtrip(rank, eng, path)


def test_tp_sp_hsdp_equal_one_process(tmp_path):
    spawn(_cases, 4, str(tmp_path / "ckpt"))
