"""--experts_implementation reaches every MoE model of an RL run (issue 45 item 3): besides the actor and reference
(``build.set_routing``), the critic (a ``CriticModel`` wrapper around the backbone), the reward model and the HF
rollout engine's own copy of the policy (``build.set_expert_kernels``).  transformers dispatches each experts
forward on ``self.config._experts_implementation`` (transformers/integrations/moe.py ``use_experts_implementation``),
so that is what is checked, with the values the kernel gives."""
from types import SimpleNamespace

import torch
from helpers.models import tiny_moe

from rlhf.engines.hf_engine import HFEngine
from rlhf.models.critic import CriticModel
from rlhf.roles.build import set_expert_kernels


def _role(model):
    return SimpleNamespace(engine=SimpleNamespace(model=model))


def _rm(policy):
    from transformers import AutoModelForSequenceClassification

    cfg = policy.config.__class__(**{**policy.config.to_dict(), "num_labels": 1, "id2label": {0: "score"},
                                     "label2id": {"score": 0}, "pad_token_id": 0})
    torch.manual_seed(5)
    rm = AutoModelForSequenceClassification.from_config(cfg)
    rm.model.load_state_dict(policy.model.state_dict())
    return rm.eval()


def test_critic_reward_model_and_hf_engine_take_the_expert_kernels():
    policy = tiny_moe(layers=1, experts_implementation="eager", seed=3, expert_std=0.3)
    critic = CriticModel(tiny_moe(layers=1, experts_implementation="eager", seed=3, expert_std=0.3).model, 32).eval()
    rm = _rm(policy)
    engine = HFEngine(tiny_moe(layers=1, experts_implementation="eager", seed=3, expert_std=0.3), tokenizer=None)
    ids = torch.randint(3, 96, (3, 13), generator=torch.Generator().manual_seed(0))
    att = torch.ones_like(ids)
    with torch.no_grad():
        before = (critic.backbone(input_ids=ids, attention_mask=att).last_hidden_state,
                  rm(input_ids=ids, attention_mask=att).logits, engine.model(input_ids=ids).logits)
    set_expert_kernels("grouped_mm", _role(critic), _role(rm), SimpleNamespace(engine=engine))
    for what, m in (("critic", critic.backbone), ("reward model", rm), ("HF rollout engine", engine.model)):
        impl = m.config._experts_implementation
        assert impl == "grouped_mm", f"the {what} still runs its experts with {impl!r}, not --experts_implementation"
    with torch.no_grad():
        after = (critic.backbone(input_ids=ids, attention_mask=att).last_hidden_state,
                 rm(input_ids=ids, attention_mask=att).logits, engine.model(input_ids=ids).logits)
    for what, a, b in zip(("critic", "reward model", "engine"), before, after):
        assert torch.allclose(a, b, atol=1e-5), f"{what}: grouped_mm differs from eager by {(a - b).abs().max()}"
    set_expert_kernels("auto", _role(critic), _role(rm), SimpleNamespace(engine=engine))  # auto: left as it is
    assert rm.config._experts_implementation == "grouped_mm"


def test_dense_roles_are_left_alone():
    dense = torch.nn.Linear(4, 4)  # no router: nothing to set, no error
    set_expert_kernels("grouped_mm", _role(dense), None, SimpleNamespace(engine=None))
    assert not hasattr(dense, "config")
