"""bench/structure.py's counting rules on small source strings (the gate on the real tree is not run here)."""
import ast
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench"))
import structure as S  # noqa: E402


def _scan(**files):
    return S.scan({p.replace("__", "/") + ".py": src for p, src in files.items()})


def test_cfg_functions_skip_the_config_package_and_entry_points():
    src = "def a(cfg): pass\ndef b(x, *, cfg=None): pass\nclass K:\n    def __init__(self, cfg): pass\ndef c(conf): pass\n"
    hits = S.cfg_functions("rlhf/trainers/x.py", ast.parse(src))
    assert hits == ["rlhf/trainers/x.py:a", "rlhf/trainers/x.py:b", "rlhf/trainers/x.py:__init__"]
    assert S.cfg_functions("rlhf/config/cli.py", ast.parse(src)) == []
    assert S.cfg_functions("rlhf/train_grpo.py", ast.parse(src)) == []
    serve = "def main(cfg): pass\ndef build(cfg): pass\n"
    assert S.cfg_functions("rlhf/serve_rm.py", ast.parse(serve)) == ["rlhf/serve_rm.py:build"], "only main exempt"


def test_stage_functions_taking_the_trainer_and_the_attributes_they_read():
    src = ("def roll(tr, state):\n    tr.cfg.x; tr.roles.actor; state.y\n"
           "def adv(batch, roles): pass\n"
           "def helper(tr): pass\n"
           "STAGES = [Stage('rollout', roll), Stage('adv', run=adv)]\n")
    c = _scan(rlhf__rl__stages=src)
    assert c.hits["stage functions taking the trainer"] == ["rlhf/rl/stages.py:roll"], "helper is no stage"
    assert c.notes["trainer attributes the stages read"] == ["cfg", "roles"]


def test_record_types_need_two_tensor_fields():
    src = ("from dataclasses import dataclass\nfrom typing import NamedTuple, Optional\nimport torch\n"
           "@dataclass\nclass Batch:\n    ids: torch.Tensor\n    mask: Optional[torch.Tensor] = None\n"
           "@dataclass(frozen=True)\nclass Cfg:\n    lr: float\n    t: torch.Tensor\n"
           "class Pair(NamedTuple):\n    a: Tensor\n    b: Tensor\n"
           "class Plain:\n    a: Tensor\n    b: Tensor\n"
           "@dataclass\nclass Sample:\n    tokens: list\n")
    c = _scan(rlhf__rl__batch=src)
    assert c.hits["record types for one step"] == ["rlhf/rl/batch.py:Batch", "rlhf/rl/batch.py:Pair"]
    assert c.notes["async records (not gated)"] == ["rlhf/rl/batch.py:Sample"]


def test_engine_probes_by_the_first_argument():
    src = ("getattr(engine, 'a', None)\nhasattr(self.engine, 'b')\ngetattr(eng, 'c')\ngetattr(llm, 'd')\n"
           "getattr(rollout_engine, 'e')\ngetattr(type(engine), 'f')\n"
           "getattr(torch, 'float32')\ngetattr(model, 'engine')\ngetattr(self.engine.model, 'g')\n")
    hits = S.engine_probes("rlhf/x/y.py", ast.parse(src))
    assert [h.split(" ", 1)[1].split(",")[0] for h in hits] == [
        "getattr(engine", "hasattr(self.engine", "getattr(eng", "getattr(llm", "getattr(rollout_engine",
        "getattr(type(engine)"]


def test_long_files_skip_vendored_compat():
    long = "x = 1\n" * 401
    c = _scan(rlhf__rl__big=long, rlhf__compat__vendored=long, rlhf__rl__ok="x = 1\n" * 400)
    assert c.hits["library files over 400 lines"] == ["rlhf/rl/big.py (401)"]


def test_imports_up_a_layer_and_circles_across_folders():
    c = _scan(
        rlhf__utils__log="from rlhf.models import load\n",              # utils -> models: up
        rlhf__models__load="import rlhf.utils.log\n",                    # down; closes a circle across folders
        rlhf__models__forward="def f():\n    from ..rewards.rm import head\n",   # up, from inside a function
        rlhf__rewards__rm="from rlhf.models.forward import f\n",         # down; circle across folders
        rlhf__data__a="from . import b\n",                               # a circle inside data/
        rlhf__data__b="from rlhf.data.a import x\nif TYPE_CHECKING:\n    from rlhf.trainers import t\n",
        rlhf__trainers__t="",
    )
    assert c.hits["imports up a layer"] == ["rlhf/models/forward.py -> rlhf/rewards/rm.py",
                                            "rlhf/utils/log.py -> rlhf/models/load.py"]
    assert c.notes["import circles"] == ["rlhf/data/a.py <-> rlhf/data/b.py",
                                         "rlhf/models/forward.py <-> rlhf/rewards/rm.py",
                                         "rlhf/models/load.py <-> rlhf/utils/log.py"]
    assert len(c.hits["import circles across folders"]) == 2


def test_from_package_import_name_resolves_to_the_package_or_the_submodule():
    mods = {"rlhf.rl": "rlhf/rl/__init__.py", "rlhf.rl.batch": "rlhf/rl/batch.py", "rlhf.roles": "rlhf/roles/__init__.py"}
    src = "from rlhf.rl import batch\nfrom rlhf.roles import Actor\nimport numpy\n"
    assert S.import_targets("rlhf/trainers/t.py", ast.parse(src), mods) == {"rlhf/rl/batch.py", "rlhf/roles/__init__.py"}


def test_unknown_folder_is_an_error_naming_the_table():
    """The layers come from docs/ARCHITECTURE.md's table (one declaration, also read by test_architecture_doc)."""
    with pytest.raises(KeyError, match="LAYERS"):
        S.rank("rlhf/newthing/x.py")
    with pytest.raises(KeyError, match="'newmodule'"):
        S.rank("rlhf/newmodule.py")  # a library file directly in rlhf/ is no entry point: it needs a row
    assert S.rank("rlhf/errors.py") == S.rank("rlhf/batch.py") == S.rank("rlhf/algorithms/kl.py") == 0
    assert S.rank("rlhf/train_sft.py") == S.rank("rlhf/__init__.py") == S.rank("rlhf/tools/flags_md.py")


def test_check_flags_only_counts_over_target():
    c = _scan(rlhf__rl__a="def a(cfg): pass\n")
    assert S.over_target(c) == []
    many = "".join(f"def f{i}(cfg): pass\n" for i in range(11))
    assert S.over_target(_scan(rlhf__rl__a=many)) == ["cfg functions"]
    assert "OVER" in S.render(_scan(rlhf__rl__a=many), verbose=False)
