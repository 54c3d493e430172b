"""launch.local's colocated placement: the learner's engine flags reach the rollout servers, and
on a GPU host the learner ranks and the servers share the same GPUs."""

from __future__ import annotations

import pytest

from launch.local import TORCHRUN_LOOPBACK_ENV, LocalConfig, build_roles


def _roles(tmp_path, learner_args: str, **kw):
    cfg = LocalConfig(run_dir=str(tmp_path), pretrain="/m", learner_args=f"--prompt_data p {learner_args}", **kw)
    return {r.name: r for r in build_roles(cfg)}


def test_engine_flags_of_the_learner_reach_every_rollout_server(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # a CPU host
    roles = _roles(
        tmp_path,
        "--colocate_all_models --vllm_enable_sleep --deepspeed_enable_sleep --vllm_gpu_memory_utilization 0.5 "
        "--enforce_eager",
        rollout_servers=2,
        rollout_args="--gpu_memory_utilization 0.4",
    )
    for name in ("rollout-0", "rollout-1"):
        cmd = roles[name].cmd
        assert "--enable_sleep" in cmd and "--enforce_eager" in cmd
        # the learner's share first, the user's --rollout_args after it (theirs win in argparse)
        shares = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--gpu_memory_utilization"]
        assert shares == ["0.5", "0.4"]
        assert roles[name].env == {}  # no GPUs: nothing to place
    assert "--colocate_all_models" in roles["learner"].cmd  # passes through


def test_sleep_mode_only_with_colocation(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    cmd = _roles(tmp_path, "--vllm_enable_sleep")["rollout-0"].cmd
    assert "--enable_sleep" not in cmd


def test_on_gpus_learner_ranks_and_rollout_servers_share_the_devices(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    roles = _roles(
        tmp_path, "--colocate_all_models", learner_nproc=4, rollout_servers=2, rollout_args="--tensor_parallel_size 2"
    )
    # (4 ranks under torchrun: also its loopback rendezvous, test_launch_local.py)
    assert roles["learner"].env == {"CUDA_VISIBLE_DEVICES": "4,5,6,7", **TORCHRUN_LOOPBACK_ENV}
    assert roles["rollout-0"].env == {"CUDA_VISIBLE_DEVICES": "4,5"}
    assert roles["rollout-1"].env == {"CUDA_VISIBLE_DEVICES": "6,7"}
    # Not colocated: every role keeps the environment it was given.
    assert _roles(tmp_path, "", rollout_servers=2)["rollout-1"].env == {}


def test_too_few_gpus_for_the_colocated_layout_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with pytest.raises(ValueError, match="need 2 GPUs, 1 visible"):
        _roles(tmp_path, "--colocate_all_models", learner_nproc=2)


def test_the_learners_environment_worker_flags_reach_every_rollout_server(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    agent = tmp_path / "env.py"
    agent.write_text("")
    flags = f"--agent_func_path {agent} --agent_env_workers 3 --agent.episode_timeout_s 90 --agent_env_worker_memory_mb 2000"
    cmd = _roles(tmp_path, flags, rollout_servers=2)["rollout-1"].cmd
    for flag, value in (
        ("--agent_env_workers", "3"),
        ("--agent_episode_timeout_s", "90.0"),
        ("--agent_env_worker_memory_mb", "2000.0"),
    ):
        assert cmd[cmd.index(flag) + 1] == value
    # none given: the servers' own default (episodes in their process)
    assert "--agent_env_workers" not in _roles(tmp_path, f"--agent_func_path {agent}")["rollout-0"].cmd
