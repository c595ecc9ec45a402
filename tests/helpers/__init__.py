"""Shared test helpers, imported as ``from helpers.<module> import ...`` (pytest.ini puts tests/ on sys.path).

- ``net``: ``free_port``, ``post_json``; ``models``: ``tiny_llama``
- ``e2e``: the real CLIs under torchrun (``torchrun``, ``flags_argv``, ``rl_args``, ``ROOT``)
- ``mp``: N gloo ranks in spawned processes (``spawn``, ``train_side_by_side``)
- ``fsdp_checks``, ``batching_checks``: checks run inside tests/multiprocess/test_distributed.py's FSDP2 launch
- ``vllm_fake``: a fake of ``vllm.LLM`` that keeps vLLM's sleep contract
- scripts run by path: ``sweep.py`` (torchrun), reward functions for --remote_rm_url (``fault_reward.py``,
  ``varied_scores.py``, ``stop_reward.py``)
"""
