"""learner.runtime.checkpoint, the one checkpoint manager, and its manifest: what proves a
checkpoint complete, how the hashing is shared over ranks, explicit registration (a part that
does not implement its interface is refused when registered, not at the first save), and on two
real ranks: a damaged shard of one rank makes both resume the older checkpoint, and a part that
only rank 0 holds refusing the checkpoint stops both ranks with the reason, none left waiting.

The RL parts over it: tests/unit/rl/test_checkpoint.py; the supervised trainers killed and
resumed: tests/unit/supervised/test_sft.py."""

from __future__ import annotations

import json
import subprocess
import zlib

import pytest
import torch

from helpers.procs import ROOT, python_cmd, worker_env
from learner.runtime import checkpoint as R
from learner.runtime import checkpoint_manifest as M


def test_a_manifest_lists_every_file_with_its_size_and_crc32(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x.bin").write_bytes(b"hello")
    (tmp_path / "state.json").write_text("{}")
    M.write_for(tmp_path)
    files = M.read(tmp_path)
    assert files == {
        "a/x.bin": {"size": 5, "crc32": f"{zlib.crc32(b'hello'):08x}"},
        "state.json": {"size": 2, "crc32": f"{zlib.crc32(b'{}'):08x}"},
    }
    assert M.problem(tmp_path, "a/x.bin", files["a/x.bin"], checksum=True) is None
    (tmp_path / "a" / "x.bin").write_bytes(b"jello")  # same size, other bytes
    assert M.problem(tmp_path, "a/x.bin", files["a/x.bin"], checksum=False) is None
    assert "a/x.bin fails its checksum" in M.problem(tmp_path, "a/x.bin", files["a/x.bin"], checksum=True)
    (tmp_path / "manifest.json").write_text('{"format": 1, "files": {"a/x.bin": {"size": "5"}}}')
    with pytest.raises(M.ManifestError, match="the entry of a/x.bin is"):
        M.read(tmp_path)
    (tmp_path / "manifest.json").write_text('{"format": 1, "files": {')  # cut
    with pytest.raises(M.ManifestError, match="manifest.json is unreadable"):
        M.read(tmp_path)


def test_a_crc_read_in_chunks_equals_the_crc_of_the_whole(tmp_path):
    data = torch.randint(0, 256, (3 * (8 << 20) + 17,), dtype=torch.uint8).numpy().tobytes()
    (tmp_path / "big").write_bytes(data)
    assert M.crc32(tmp_path / "big") == f"{zlib.crc32(data):08x}"


def test_shares_balance_bytes_and_cover_every_file_once():
    sizes = {"a": 100, "b": 60, "c": 50, "d": 10, "e": 0}
    got = M.shares(sizes, 2)
    # largest first, each to the lighter rank (ties to the lower): a -> 0 (100, 0), b -> 1 (100, 60),
    # c -> 1 (100, 110), d -> 0 (110, 110), e -> 0
    assert got == [["a", "d", "e"], ["b", "c"]]
    assert sorted(sum(got, [])) == sorted(sizes) and M.shares(sizes, 1) == [sorted(sizes, key=lambda k: -sizes[k])]


def test_a_location_names_the_directory_or_one_checkpoint(tmp_path):
    assert R.locate(tmp_path / "ckpt") == (tmp_path / "ckpt", None)
    one = tmp_path / "ckpt" / "step_00000012"
    assert R.locate(one) == (tmp_path / "ckpt", one)
    with pytest.raises(R.CheckpointError, match="step_00000012: no such checkpoint"):
        R.find(one)


class Counter:
    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, state: dict) -> None:
        self.n = state["n"]


def test_parts_are_registered_with_their_interface(tmp_path):
    ckpt = R.Checkpointer(tmp_path)
    with pytest.raises(TypeError, match="'kl': object has no state_dict/load_state_dict"):
        ckpt.add_state("kl", object())
    with pytest.raises(TypeError, match="engine 'policy': Counter has no save/load_checkpoint"):
        ckpt.add_engine("policy", Counter())
    with pytest.raises(TypeError, match="generator 'g': int is not a torch.Generator"):
        ckpt.add_generator("g", 1)
    ckpt.add_state("progress", Counter())
    for name in ("progress", "step", "match"):
        with pytest.raises(ValueError, match=f"name '{name}' is taken"):
            ckpt.add_state(name, Counter())
    with pytest.raises(ValueError, match="name 'rng' is taken"):
        ckpt.add_export("rng", lambda d: None)
    with pytest.raises(ValueError, match="--max_ckpt_num must be >= 1"):
        R.Checkpointer(tmp_path, max_keep=0)


def test_parts_generators_and_rng_come_back_and_a_missing_part_is_named(tmp_path):
    progress, gen = Counter(), torch.Generator().manual_seed(3)
    ckpt = R.Checkpointer(tmp_path, match={"seed": 1})
    ckpt.add_state("progress", progress)
    ckpt.add_generator("shuffle", gen)
    progress.n = 7
    torch.rand(3, generator=gen)
    torch.manual_seed(11)
    path = ckpt.save(5)
    state = json.loads((path / "state.json").read_text())
    assert state == {"format": R.FORMAT, "step": 5, "match": {"seed": 1, "world_size": 1}, "progress": {"n": 7}}
    expected = (torch.rand(2, generator=gen), torch.rand(2))

    again, gen2 = Counter(), torch.Generator().manual_seed(0)
    ckpt = R.Checkpointer(tmp_path, match={"seed": 1})
    ckpt.add_state("progress", again)
    ckpt.add_generator("shuffle", gen2)
    torch.manual_seed(0)
    assert ckpt.resume().step == 5 and again.n == 7
    assert torch.equal(torch.rand(2, generator=gen2), expected[0]) and torch.equal(torch.rand(2), expected[1])

    more = R.Checkpointer(tmp_path, match={"seed": 1})
    more.add_state("sampler", Counter())
    with pytest.raises(R.CheckpointMismatch, match="step_00000005: it holds no state for 'sampler'"):
        more.resume()


def test_a_checkpoint_in_the_old_layouts_is_refused_not_ignored(tmp_path):
    (tmp_path / "global_step8").mkdir()
    (tmp_path / "latest").write_text("global_step8")
    with pytest.raises(R.CheckpointError, match="old layout \\('latest' names 'global_step8'\\)"):
        R.Checkpointer(tmp_path).resume()
    old_rl = tmp_path / "rl" / "step_00000003"  # format 1: a state.json and no manifest
    old_rl.mkdir(parents=True)
    (old_rl / "state.json").write_text(json.dumps({"format": 1, "step": 3}))
    with pytest.raises(R.DamagedCheckpoint, match="step_00000003: no manifest.json"):
        R.Checkpointer(tmp_path / "rl").resume()


@pytest.mark.slow
def test_two_ranks_agree_on_a_damaged_shard_and_on_a_refusal(tmp_path):
    """Rank 1's shard of the newest checkpoint truncated: both ranks resume the same, older
    checkpoint; a refusal by a part only rank 0 holds stops both, each naming the reason."""
    cmd = python_cmd([str(ROOT / "tests" / "helpers" / "checkpoint_ranks.py"), str(tmp_path)], nproc=2)
    proc = subprocess.run(cmd, cwd=ROOT, env=worker_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [json.loads((tmp_path / f"result_rank{r}.json").read_text()) for r in (0, 1)]
    by_rank = {r["rank"]: r for r in lines}
    for r in by_rank.values():
        assert r["resumed_step"] == 2 and r["engine_value"] == 2.0 and r["kl_value"] == 2
    shard = "policy/ds/zero_pp_rank_1_mp_rank_00_optim_states.pt"
    assert by_rank[0]["manifest"][shard] == ["crc32", "size"] and "rng/rank_1.pt" in by_rank[0]["manifest"]
    assert "skipping checkpoint" in proc.stderr and f"{shard} has 100 bytes" in proc.stderr
    assert by_rank[0]["refused"].endswith("step_00000002: driver: the data changed")
    assert by_rank[1]["refused"] == "rank 0: " + by_rank[0]["refused"]
