"""Resume verification in shares (rlhf/checkpoint/resume.py ``resume_path``): every rank hashes part of the
checkpoint, as the save already does, and every rank learns which file is damaged.

Before, rank 0 hashed the whole checkpoint while the other ranks waited in a broadcast bounded by
--dist_timeout_s (1800 s): a 70B PPO checkpoint (~1960 GB at ~1 GB/s) would time out.  The contract is
torch.distributed's (torch/distributed/distributed_c10d.py ``broadcast_object_list`` / ``all_gather_object``):
every rank of the group makes the same collective calls in the same order, or the job hangs.  Ranks run here as
threads over a fake ``comm`` (rlhf/distributed/comm.py's object collectives, nothing else), in process."""
import os
import threading
from collections import defaultdict

from rlhf import checkpoint as ckpt
from rlhf.checkpoint import manifest, resume

# a model folder of shards of unequal sizes, as a sharded engine checkpoint has
SHARDS = {"model/shard_0.bin": 96 << 10, "model/shard_1.bin": 64 << 10, "model/shard_2.bin": 48 << 10,
          "model/shard_3.bin": 32 << 10, "model/extra_state.pt": 8 << 10}


class ThreadWorld:
    """``world`` ranks as threads: rank / world_size / broadcast_object / all_gather_object / barrier with
    rlhf.distributed.comm's signatures; every collective each rank issues is logged, in order."""

    def __init__(self, world: int):
        self.world = world
        self.local = threading.local()
        self.gate = threading.Barrier(world, timeout=30)
        self.slots = [None] * world
        self.calls = defaultdict(list)

    def rank(self, group=None) -> int:
        return self.local.rank

    def world_size(self, group=None) -> int:
        return self.world

    def _exchange(self, name, obj):
        r = self.rank()
        self.calls[r].append(name)
        self.slots[r] = obj
        self.gate.wait()  # a rank that skips a collective leaves the others here: BrokenBarrierError, not a hang
        out = list(self.slots)
        self.gate.wait()
        return out

    def broadcast_object(self, obj, src, group=None):
        return self._exchange("broadcast_object", obj)[src]

    def all_gather_object(self, obj, group=None):
        return self._exchange("all_gather_object", obj)

    def barrier(self, group=None):
        self._exchange("barrier", None)

    def run(self, fn):
        """fn() on every rank; {rank: ("ok", value) or ("error", exception)}."""
        out = {}

        def body(r):
            self.local.rank = r
            try:
                out[r] = ("ok", fn())
            except Exception as e:  # noqa: BLE001 - reported per rank
                out[r] = ("error", e)

        threads = [threading.Thread(target=body, args=(r,)) for r in range(self.world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        return out


def _save(root, step):
    def write(tmp):
        for rel, size in SHARDS.items():
            os.makedirs(os.path.dirname(os.path.join(tmp, rel)), exist_ok=True)
            with open(os.path.join(tmp, rel), "wb") as fh:
                fh.write(os.urandom(size))

    return ckpt.save_checkpoint(str(root), step, write, {"step": step}, max_keep=5)


def _count_reads(monkeypatch, world):
    """Record, per rank, the files hashed and their bytes (every hash goes through ``file_digest``)."""
    read = defaultdict(dict)
    real = ckpt.file_digest

    def counting(path, *a, **kw):
        read[world.rank()][path] = os.path.getsize(path)
        return real(path, *a, **kw)

    monkeypatch.setattr(manifest, "file_digest", counting)
    return read


def test_each_rank_hashes_only_its_share_and_every_rank_names_a_damaged_file(tmp_path, monkeypatch, capsys):
    """2 ranks: each hashes about half of the checkpoint's bytes, every file exactly once; then a file that rank 1
    hashed (not rank 0) gets 4 KiB overwritten: every rank falls back to the previous checkpoint, rank 0 names the
    file, and --strict_resume raises the same error, naming it, on every rank."""
    root = tmp_path / "ck"
    p1, p2 = _save(root, 1), _save(root, 2)  # one rank, no process group
    files = ckpt.read_manifest(p2)["files"]
    total = sum(f["size"] for f in files.values())
    world = ThreadWorld(2)
    monkeypatch.setattr(resume, "comm", world)
    read = _count_reads(monkeypatch, world)

    got = world.run(lambda: ckpt.resume_path(str(root)))
    assert got == {0: ("ok", p2), 1: ("ok", p2)}, got
    per_rank = {r: sum(read[r].values()) for r in range(2)}
    assert per_rank[1] > 0, f"rank 1 hashed nothing: rank 0 read all {per_rank[0]} bytes of the checkpoint alone"
    hashed = [os.path.relpath(p, p2).replace(os.sep, "/") for r in range(2) for p in read[r]]
    assert sorted(hashed) == sorted(files), f"every file hashed exactly once over the ranks: {sorted(hashed)}"
    biggest = max(f["size"] for f in files.values())
    assert max(per_rank.values()) <= total / 2 + biggest, f"unbalanced shares {per_rank} of {total} bytes"
    assert world.calls[0] == world.calls[1], f"ranks issued different collectives: {dict(world.calls)}"

    victim = max((p for p in read[1]), key=lambda p: read[1][p])  # rank 1's share, never read by rank 0
    rel = os.path.relpath(victim, p2).replace(os.sep, "/")
    with open(victim, "r+b") as fh:
        fh.seek(1024)
        fh.write(b"\xff" * 4096)
    capsys.readouterr()
    world.calls.clear()
    read.clear()
    got = world.run(lambda: ckpt.resume_path(str(root)))
    assert got == {0: ("ok", p1), 1: ("ok", p1)}, f"rank 1's damaged {rel} not seen by every rank: {got}"
    assert victim not in read[0], "rank 0 read a file of rank 1's share"
    out = capsys.readouterr().out
    assert f"checkpoint {p2} is damaged ({rel} does not match its checksum" in out, out
    assert out.count(f"falling back to {p1}") == 1, f"rank 0 alone prints the fallback: {out}"
    assert world.calls[0] == world.calls[1], f"ranks issued different collectives: {dict(world.calls)}"

    world.calls.clear()
    got = world.run(lambda: ckpt.resume_path(str(root), strict=True))
    for r in range(2):
        kind, err = got[r]
        assert kind == "error" and isinstance(err, ckpt.CheckpointError), f"rank {r}: {got[r]}"
        assert rel in str(err) and "--strict_resume refuses" in str(err), f"rank {r}: {err}"
    assert world.calls[0] == world.calls[1], f"ranks issued different collectives: {dict(world.calls)}"


def test_shares_balance_bytes_and_a_size_damage_is_found_before_hashing(tmp_path, monkeypatch, capsys):
    """3 ranks: shares by bytes (not by file count) are the same on every rank; a truncated file (rank 0's size
    check) needs no hashing: every rank gets the verdict, the intact older checkpoint is hashed in shares."""
    shares = ckpt.hash_shares({k: {"size": v} for k, v in SHARDS.items()}, 3)
    loads = sorted(sum(SHARDS[f] for f in s) for s in shares)
    # the largest file alone (96 KiB) bounds the largest share; a split by file count (the save's new[rank::3])
    # would give rank 0 shard_0 + shard_3 = 128 KiB
    assert loads == [72 << 10, 80 << 10, 96 << 10], (shares, loads)
    root = tmp_path / "ck"
    p1, p2 = _save(root, 1), _save(root, 2)
    with open(os.path.join(p2, "model/shard_3.bin"), "r+b") as fh:
        fh.truncate(100)
    world = ThreadWorld(3)
    monkeypatch.setattr(resume, "comm", world)
    read = _count_reads(monkeypatch, world)
    got = world.run(lambda: ckpt.resume_path(str(root)))
    assert got == {r: ("ok", p1) for r in range(3)}, got
    assert not any(p.startswith(p2) for r in read for p in read[r]), "the damaged checkpoint was hashed"
    assert all(read[r] for r in range(3)), f"every rank hashes a share of {p1}: {dict(read)}"
    assert "model/shard_3.bin has 100 bytes" in capsys.readouterr().out
    assert world.calls[0] == world.calls[1] == world.calls[2], dict(world.calls)


def test_one_rank_resume_still_hashes_everything(tmp_path):
    """Without a process group (one rank) the single rank's share is the whole checkpoint."""
    root = tmp_path / "ck"
    p1, p2 = _save(root, 1), _save(root, 2)
    with open(os.path.join(p2, "model/shard_0.bin"), "r+b") as fh:
        fh.write(b"\0" * 16)
    assert ckpt.resume_path(str(root)) == p1


def test_rl_resume_verification_runs_under_the_load_deadline(monkeypatch):
    """PPO / GRPO: ``resume_path`` (every rank hashing its share) runs inside the watchdog's "load" phase, whose
    deadline scales with the checkpoint's bytes (rl_trainer.io_deadlines) -- before, it ran outside any phase."""
    import types

    from rlhf.distributed.abort import AbortBoard
    from rlhf.distributed.watchdog import Watchdog
    from rlhf.rl.trainer import RLTrainer

    wd = Watchdog(default_s=60, deadlines={"load": 4900.0}, slow_s=60, board_=AbortBoard(None), start=False)
    seen = []
    monkeypatch.setattr(ckpt, "resume_path", lambda *a, **kw: seen.append(wd.current()))  # None: no checkpoint
    fake = types.SimpleNamespace(watchdog=wd, cfg=types.SimpleNamespace(
        checkpoint=types.SimpleNamespace(ckpt_path="unused", strict_resume=False)))
    assert RLTrainer.resume(fake) is False
    assert seen == [("load", 4900.0)], f"resume_path ran in {seen} instead of the 'load' phase"
