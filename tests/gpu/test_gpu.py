"""GPU-only checks (skipped without CUDA): memory released by sleep; a supervised step's batches on the device and
fp32 master weights under --bf16; FSDP2 load memory against the model's bytes (vLLM: tests/vllm_cpu/test_vllm.py; the 1- and
2-rank trainer runs, cuda:gloo and the summary table: bench/gpu.sh)."""
import os

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.fixture()
def single_rank_nccl(monkeypatch):
    import torch.distributed as dist
    from helpers.net import free_port

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("nccl", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_train_engine_sleep_frees_device_memory(tiny_kit, single_rank_nccl):
    from transformers import AutoModelForCausalLM

    from rlhf.engines.fsdp2 import FSDP2Engine
    from rlhf.engines.train import EngineSpec

    eng = FSDP2Engine(AutoModelForCausalLM.from_pretrained(tiny_kit),
                      EngineSpec(lr=1e-3, train_batch_size=2, micro_batch_size=2, total_steps=4, bf16=True),
                      device=torch.device("cuda"))
    x = torch.randint(3, 100, (2, 16), device="cuda")
    eng.backward(eng.model(input_ids=x, labels=x).loss, 0)
    eng.step()
    before = [p.detach().to_local().clone() for p in eng.model.parameters()]
    used = torch.cuda.memory_allocated()
    eng.sleep()
    assert torch.cuda.memory_allocated() < 0.2 * used
    eng.wake()
    assert all(torch.equal(a, p.detach().to_local()) for a, p in zip(before, eng.model.parameters()))


def _optimizer_dtypes(engine):
    params = {p.dtype for g in engine.optimizer.param_groups for p in g["params"]}
    state = {v.dtype for st in engine.optimizer.state.values() for v in st.values() if torch.is_tensor(v) and v.dim()}
    return params, state


def test_supervised_step_batches_on_device_and_fp32_masters_under_bf16(tiny_kit, single_rank_nccl, tmp_path):
    """One SFT step as the CLI builds it (--bf16): every tensor the model's forward receives is on the GPU (a
    batch left on the CPU would run, slowly, on NCCL's CPU side or fail in a collective), and the optimizer
    updates fp32 master weights with fp32 Adam state (bf16 is the compute dtype only)."""
    from rlhf.config import parse
    from rlhf.supervised.tasks import SFTTask
    from rlhf.supervised.trainer import SupervisedTrainer
    from rlhf.train_sft import DEFAULTS

    argv = ["--pretrain", tiny_kit, "--dataset", os.path.join(tiny_kit, "data", "sft_train.jsonl"), "--bf16",
            "--max_global_steps", "1", "--train_batch_size", "4", "--micro_train_batch_size", "2", "--max_samples",
            "32", "--eval_split", "0", "--save_path", str(tmp_path / "m"), "--log_dir", str(tmp_path / "logs"),
            "--no_progress_bar"]
    tr = SupervisedTrainer(parse("sft", argv, DEFAULTS), SFTTask, "sft")
    seen = set()
    tr.engine.model.register_forward_pre_hook(
        lambda m, a, kw: seen.update(str(t.device.type) for t in list(a) + list(kw.values()) if torch.is_tensor(t)),
        with_kwargs=True)
    for i, mb in enumerate(tr.batches_for(0)):
        loss, _ = tr.task.loss(tr.engine.model, mb)
        assert loss.device.type == "cuda", f"the loss of a supervised micro-batch is on {loss.device}"
        tr.engine.backward(loss, i)
    tr.engine.step()
    tr.watchdog.stop()
    assert seen == {"cuda"}, f"the model's forward received tensors on {seen}: a batch was not moved to the GPU"
    params, state = _optimizer_dtypes(tr.engine)
    assert params == {torch.float32}, f"master weights are {params} under --bf16 (must stay fp32)"
    assert state == {torch.float32}, f"Adam state is {state} under --bf16 (must be fp32)"


@pytest.mark.parametrize("load_on_first", [False, True])
def test_fsdp2_load_peak_memory_vs_model_bytes(single_rank_nccl, load_on_first):
    """Loading a ~50M-parameter model into FSDP2 (--bf16, one rank) peaks at about its fp32 bytes on the device:
    the shards are allocated once (no full copy plus shards, no bf16 copy kept), and the optimizer state is not
    allocated before the first step.  The bound 1.6x leaves room for the allocator's rounding and one staged
    tensor (the 32000 x 512 embedding is 35% of this model); 2x would mean a second full copy."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from rlhf.engines.fsdp2 import FSDP2Engine
    from rlhf.engines.train import EngineSpec

    cfg = Qwen2Config(vocab_size=32000, hidden_size=512, intermediate_size=2048, num_hidden_layers=8,
                      num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)  # load_on_first: the path of a rank-0-only checkpoint read
    model_bytes = sum(p.numel() for p in model.parameters()) * 4
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    eng = FSDP2Engine(model, EngineSpec(lr=1e-4, train_batch_size=2, micro_batch_size=2, total_steps=2, bf16=True),
                      device=torch.device("cuda"), load_on_first=load_on_first)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    assert 0.9 * model_bytes <= peak <= 1.6 * model_bytes, \
        f"FSDP2 load peaked at {peak / 1e6:.1f} MB for a {model_bytes / 1e6:.1f} MB fp32 model ({peak / model_bytes:.2f}x)"
    params, _ = _optimizer_dtypes(eng)
    assert params == {torch.float32}
