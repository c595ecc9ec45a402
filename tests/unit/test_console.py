"""rlhf.console: the one rank-0 check and print, used by data/, config/, models/ and the trainers."""
import sys


def test_print0_says_once_per_job(monkeypatch, capsys):
    """Before any process group the rank is torchrun's RANK: rank 0 prints (stdout, or the file given), others not."""
    from rlhf.console import is_rank0, print0, process_rank

    monkeypatch.setenv("RANK", "1")
    assert process_rank() == 1 and not is_rank0()
    print0("hidden")
    print0("hidden too", file=sys.stderr)
    assert capsys.readouterr() == ("", "")
    monkeypatch.setenv("RANK", "0")
    print0("out")
    print0("err", file=sys.stderr)
    assert capsys.readouterr() == ("out\n", "err\n")
    monkeypatch.delenv("RANK")
    assert is_rank0(), "outside torchrun (no RANK) the process is rank 0"


def test_the_library_checks_rank_0_in_one_place():
    """No module of the library reads RANK to decide whether to print: it calls rlhf.console."""
    import os
    import re

    root = os.path.join(os.path.dirname(__file__), "..", "..", "rlhf")
    pat = re.compile(r"environ\.get\(\"RANK\", \"0\"\) == \"0\"|comm\.rank\(\) == 0")
    bad = [f"{d}/{f}" for d, _, fs in os.walk(root) for f in fs if f.endswith(".py")
           and pat.search(open(os.path.join(d, f)).read())]
    assert not bad, bad
