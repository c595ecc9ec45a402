"""GPU-only checks (skipped without CUDA): memory released by sleep, NCCL weight broadcast (vLLM: tests/test_vllm.py)."""
import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.fixture()
def single_rank_nccl(monkeypatch):
    import torch.distributed as dist
    from conftest import free_port

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("nccl", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_train_engine_sleep_frees_device_memory(tiny_kit, single_rank_nccl):
    from transformers import AutoModelForCausalLM

    from rlhf.backends.base import EngineSpec
    from rlhf.backends.fsdp2 import FSDP2Engine

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
