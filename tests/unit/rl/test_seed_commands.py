"""The seed's PPO commands (workflows 1 and 2, tests/helpers/seed_commands.py) parse with only
the module name swapped, and their flags mean what they mean in OpenRLHF. Running them on the
tiny model: tests/e2e/test_e2e_seed_commands.py."""

from __future__ import annotations

import json
import logging

import pytest

from common.config import parse, to_json
from helpers.seed_commands import OPENRLHF_MODULE, SEED_PPO_COMMANDS, argv, ported
from learner.rl.config import PPOConfig
from learner.rl.schedules import schedule_name
from learner.rl.schedules.colocated import check_colocated_push


@pytest.mark.parametrize("workflow", sorted(SEED_PPO_COMMANDS))
def test_the_seed_command_parses_with_only_the_module_swapped(workflow, caplog):
    command = ported(SEED_PPO_COMMANDS[workflow])
    assert OPENRLHF_MODULE not in command
    with caplog.at_level(logging.WARNING):
        cfg = parse(PPOConfig, argv(command))
    # PPO with a critic, one sample per prompt: OpenRLHF's default estimator.
    assert cfg.algo.advantage.estimator == "gae" and cfg.rollout.n_samples_per_prompt == 1
    assert cfg.critic.adam.lr == 9e-6 and cfg.ds.zero_stage == 3 and cfg.ds.bf16
    # The hybrid engine: the colocated schedule, both halves asked to sleep.
    assert schedule_name(cfg.train) == "colocated"
    assert cfg.vllm.enable_sleep and cfg.ds.enable_sleep and cfg.vllm.gpu_memory_utilization == 0.5
    assert cfg.ds.packing_samples and cfg.actor.gradient_checkpointing_enable and cfg.data.apply_chat_template
    assert cfg.vllm.sync_backend == "nccl"  # --vllm_sync_backend
    assert cfg.vllm.enforce_eager and cfg.ckpt.save_hf and cfg.data.max_samples == 100000
    # Ray placement flags are accepted and explained at start-up, not silently used.
    said = " ".join(cfg.notices)
    assert all(f"--{name} " in said for name in ("actor.num_nodes", "ref.num_gpus_per_node")), said
    assert dict(cfg.engine_flags_used()) == {
        "vllm.enforce_eager": "--enforce_eager",
        "vllm.tensor_parallel_size": "--tensor_parallel_size",
    }
    if workflow == "workflow1":
        assert cfg.reward.model_name_or_path == "OpenRLHF/Llama-3-8b-rm-700k" and cfg.reward.normalize_enable
    else:
        assert (
            cfg.reward.remote_url == "/path/to/reward_func.py"
            and cfg.data.label_key == "answer"
            and not cfg.reward.model_name_or_path
        )
        assert any("--normalize_reward normalises a reward model's scores" in n for n in cfg.notices)


def test_the_wandb_line_parses_too_and_its_token_is_not_logged():
    """The README's command lacks a backslash before --use_wandb; joined, it parses as well, wandb
    is on, and the token is in neither the config's repr nor its logged JSON."""
    cfg = parse(PPOConfig, [*argv(ported(SEED_PPO_COMMANDS["workflow1"])), "--use_wandb", "secret-token"])
    assert cfg.logger.wandb.enabled and cfg.logger.wandb.api_key() == "secret-token"
    assert "secret-token" not in repr(cfg) and "secret-token" not in to_json(cfg)
    assert json.loads(to_json(cfg))["logger"]["wandb"]["key"] == "<redacted>"


def test_an_openrlhf_command_with_its_wandb_and_eval_flags_parses_with_only_the_module_swapped():
    """OpenRLHF's tracking and evaluation flags, as its scripts pass them (train_ppo_ray names)."""
    extra = [
        *("--use_wandb", "True", "--wandb_org", "my-team", "--wandb_group", "llama3-8b"),
        *("--wandb_project", "openrlhf_train_ppo", "--wandb_run_name", "ppo_0101T00:00"),
        *("--use_tensorboard", "/openrlhf/tb", "--eval_dataset", "OpenRLHF/prompt-collection-v0.1"),
        *("--eval_split", "test", "--eval_steps", "10", "--eval_temperature", "0.6"),
        *("--eval_n_samples_per_prompt", "4", "--save_steps", "10", "--best_metric_key", "eval_default_pass1"),
        "--disable_ds_ckpt",
    ]
    cfg = parse(PPOConfig, [*argv(ported(SEED_PPO_COMMANDS["workflow2"])), *extra])
    assert (
        cfg.logger.wandb.enabled and cfg.logger.wandb.api_key() is None
    )  # the key comes from WANDB_API_KEY / wandb login
    assert (cfg.logger.wandb.org, cfg.logger.wandb.group, cfg.logger.wandb.project) == (
        "my-team",
        "llama3-8b",
        "openrlhf_train_ppo",
    )
    assert cfg.logger.wandb.names("train_ppo") == ("openrlhf_train_ppo", "ppo_0101T00:00")
    assert cfg.logger.tensorboard_dir == "/openrlhf/tb"
    assert (cfg.eval.dataset, cfg.eval.split, cfg.eval.steps) == ("OpenRLHF/prompt-collection-v0.1", "test", 10)
    assert (cfg.eval.temperature, cfg.eval.n_samples_per_prompt) == (0.6, 4)
    assert cfg.ckpt.disable_ds and cfg.ckpt.save_hf and cfg.ckpt.best_metric_key == "eval_default_pass1"
    # rayless's older alias of --eval_dataset still works.
    assert parse(PPOConfig, [*argv(ported(SEED_PPO_COMMANDS["workflow2"])), "--eval_data", "e.jsonl"]).eval.dataset == (
        "e.jsonl"
    )


def test_colocated_nccl_push_is_refused_with_the_way_out():
    """OpenRLHF moves colocated weights by CUDA IPC under --vllm_sync_backend nccl; rayless has no
    CUDA IPC backend yet, and NCCL cannot join two processes of one GPU: a clear refusal."""
    cfg = parse(PPOConfig, argv(ported(SEED_PPO_COMMANDS["workflow1"])))
    with pytest.raises(ValueError, match="--vllm_sync_backend gloo"):
        check_colocated_push(cfg)


def test_one_sample_per_prompt_is_still_refused_for_group_estimators(capsys):
    args = [*argv(ported(SEED_PPO_COMMANDS["workflow2"])), "--advantage_estimator", "group_norm"]
    with pytest.raises(SystemExit):
        parse(PPOConfig, args)
    assert "--advantage_estimator group_norm compares samples of one prompt" in capsys.readouterr().err
