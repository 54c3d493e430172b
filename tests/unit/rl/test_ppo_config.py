"""PPOConfig refuses contradictory algorithm flags at parse time, with the flag in the message."""

from __future__ import annotations

import logging

import pytest

from common.config import build, parse
from learner.controller.scoring import EpisodeScoring, ServiceScoring
from learner.rl.build import sample_scoring
from learner.rl.config import PPOConfig

BASE = dict(
    pretrain="m",
    prompt_data="p",
    rollout_batch_size=4,
    n_samples_per_prompt=2,
    train_batch_size=8,
    micro_train_batch_size=2,
)


def cfg(**kw) -> PPOConfig:
    return build(PPOConfig, **{**BASE, **kw})


def test_defaults_are_valid():
    c = cfg()
    assert c.actor.clip_low_high == (0.2, 0.2)
    assert c.critic_path == "m"


def test_the_default_estimator_is_openrlhfs_gae_and_group_estimators_need_a_group():
    """OpenRLHF's train_ppo_ray defaults to PPO with a critic and one sample per prompt."""
    c = build(PPOConfig, pretrain="m", prompt_data="p")
    assert c.algo.advantage.estimator == "gae" and c.rollout.n_samples_per_prompt == 1
    for name in ("group_norm", "dr_grpo", "rloo", "reinforce_baseline"):
        with pytest.raises(ValueError, match=f"--advantage_estimator {name} compares samples of one prompt"):
            build(PPOConfig, pretrain="m", prompt_data="p", advantage_estimator=name)


@pytest.mark.parametrize(
    "kw, needle",
    [
        (dict(eps_clip_low_high=[0.2]), "--eps_clip_low_high takes two numbers"),
        (dict(eps_clip_low_high=[0.2, 0.28, 0.3]), "--eps_clip_low_high takes two numbers"),
        (dict(eps_clip_low_high=[1.2, 0.28]), "0 <= low < 1"),
        (dict(eps_clip=1.5), "--eps_clip"),
        (dict(dual_clip=0.5), "--dual_clip must be > 1"),
        (dict(is_correction="tis", is_correction_low_high=[0.5]), "--is_correction_low_high takes two"),
        (dict(is_correction="icepop", is_correction_low_high=[1.5, 2.0]), "0 <= low < 1 < high"),
        (dict(is_correction="tis", is_correction_low_high=[0.0, 0.9]), "0 <= low < 1 < high"),
        (
            dict(policy_loss_type="gspo", loss_agg_mode="seq_mean_token_sum"),
            "needs --loss_agg_mode seq_mean_token_mean",
        ),
        (dict(reward_clip_range=[1.0, -1.0]), "--reward_clip_range"),
        (
            dict(dynamic_filtering=True, n_samples_per_prompt=1, advantage_estimator="reinforce", train_batch_size=4),
            "--dynamic_filtering",
        ),
        (dict(dynamic_filtering=True, dynamic_filtering_reward_range=[1.0, 0.0]), "--dynamic_filtering_reward_range"),
        (dict(advantage_estimator="group_norm", freezing_actor_steps=2), "only with --advantage_estimator gae"),
        (dict(advantage_estimator="group_norm", freezing_actor_steps=0), "only with --advantage_estimator gae"),
        (dict(stop_properly_penalty_coef=1.5), "--stop_properly_penalty_coef must be in"),
        (dict(num_episodes=0), "--num_episodes must be >= 1"),
        (dict(max_samples=0), "--max_samples must be >= 1"),
        (dict(advantage_estimator="group_norm", save_value_network=True), "--save_value_network saves the critic"),
        (dict(advantage_estimator="gae", gamma=1.5), "--gamma"),
        (dict(advantage_estimator="gae", critic_learning_rate=0.0), "--critic_learning_rate"),
        (dict(advantage_estimator="group_norm", gamma=0.9), "--gamma must be 1"),
        (dict(advantage_estimator="rloo", n_samples_per_prompt=1, train_batch_size=4), "--n_samples_per_prompt >= 2"),
        (dict(train_batch_size=6), "multiple of --train_batch_size"),
        (dict(eval_steps=0), "--eval_steps must be -1"),
        (dict(eval_n_samples_per_prompt=0), "--eval_n_samples_per_prompt must be >= 1"),
        (dict(eval_temperature=-1.0), "--eval_temperature must be >= 0"),
        (dict(log_samples_steps=-2), "--log_samples_steps must be >= 0"),
        (dict(disable_ds_ckpt=True), "add --save_hf_ckpt"),
        (dict(best_metric_key="eval/accuracy"), "it needs --eval_dataset"),
    ],
)
def test_rejected(kw, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace("+", r"\+")):
        cfg(**kw)


def test_lora_flags_of_the_rl_learner_are_checked():
    """--lora_rank is OptimizerFlags' (shared with the supervised trainers), checked the same
    way; --lora_sync adapter without --lora_rank says it does nothing."""
    c = cfg(lora_rank=8, lora_alpha=32)
    assert (c.ds.lora.rank, c.ds.lora.alpha, c.services.lora_sync, c.ds.lora.target_modules) == (
        8,
        32,
        "merged",
        ["all-linear"],
    )
    assert cfg(lora_rank=8, zero_stage=3).ds.zero_stage == 3  # the push gathers each weight with its adapter
    with pytest.raises(ValueError, match=r"\(--lora_alpha\) must be > 0, got 0"):
        cfg(lora_rank=8, lora_alpha=0)
    assert cfg(lora_rank=8, lora_sync="adapter").notices == []
    assert cfg(lora_sync="adapter").notices == ["--lora_sync adapter has no effect without --lora_rank"]
    assert cfg().ds.lora.rank == 0  # the default is off


def test_gspo_switches_the_default_aggregation_with_a_notice(caplog):
    with caplog.at_level(logging.WARNING):
        c = cfg(policy_loss_type="gspo")
    assert c.actor.loss_agg_mode == "seq_mean_token_mean"
    # Said once the run has set up logging, on rank 0 (learner.rl.run.init_process), not while parsing.
    assert any("seq_mean_token_mean" in n for n in c.notices) and not caplog.records
    assert (
        cfg(policy_loss_type="gspo", loss_agg_mode="seq_mean_token_mean").actor.loss_agg_mode == "seq_mean_token_mean"
    )


def test_evaluation_flags_that_cannot_do_what_they_say_are_explained():
    greedy = cfg(eval_dataset="e", eval_temperature=0.0, eval_n_samples_per_prompt=4)
    assert any("pass@n equals pass@1" in n for n in greedy.notices)
    unranked = cfg(eval_dataset="e", best_metric_key="eval/accuracy", save_steps=4, eval_steps=6)
    assert any("make --eval_steps a multiple of --save_steps" in n for n in unranked.notices)
    ranked = cfg(eval_dataset="e", best_metric_key="eval/accuracy", save_steps=4, eval_steps=8)
    assert not ranked.notices
    assert cfg(disable_ds_ckpt=True, save_hf_ckpt=True).ckpt.disable_ds


def test_accepted_algorithm_flags():
    c = cfg(
        advantage_estimator="gae",
        n_samples_per_prompt=1,
        rollout_batch_size=8,
        freezing_actor_steps=2,
        gamma=0.99,
        lambd=0.95,
        reward_pretrain="rm",
    )
    assert c.critic_path == "rm"
    assert cfg(advantage_estimator="gae", critic_pretrain="c", reward_pretrain="rm").critic_path == "c"
    assert cfg(eps_clip_low_high=[0.2, 0.28]).actor.clip_low_high == (0.2, 0.28)
    assert cfg(is_correction="icepop", is_correction_low_high=[0.5, 2.0]).algo.advantage.is_correction == "icepop"
    assert cfg(dynamic_filtering=True, dynamic_filtering_reward_range=[0.0, 1.0]).algo.dynamic_filtering_enable


def test_world_size_checks():
    c = cfg(rollout_batch_size=6, train_batch_size=12, micro_train_batch_size=2)
    c.check_world_size(2)
    with pytest.raises(ValueError, match="divisible by the 4 learner ranks"):
        cfg(rollout_batch_size=6, train_batch_size=12, micro_train_batch_size=1).check_world_size(4)
    with pytest.raises(ValueError, match="x 4 learner ranks"):
        c.check_world_size(4)


def test_cli_errors_name_the_flag(capsys):
    with pytest.raises(SystemExit):
        parse(
            PPOConfig,
            [
                "--pretrain",
                "m",
                "--prompt_data",
                "p",
                "--n_samples_per_prompt",
                "2",
                "--rollout_batch_size",
                "64",
                "--eps_clip_low_high",
                "0.2",
            ],
        )
    assert "--eps_clip_low_high takes two numbers" in capsys.readouterr().err
    c = parse(
        PPOConfig,
        [
            "--pretrain",
            "m",
            "--prompt_data",
            "p",
            "--eps_clip_low_high",
            "0.2",
            "0.28",
            "--n_samples_per_prompt",
            "2",
            "--rollout_batch_size",
            "64",
        ],
    )
    assert c.actor.clip_low_high == (0.2, 0.28)


def test_agent_flags_are_checked_and_name_the_agent_by_content(tmp_path):
    """--agent_func_path is read at the flags' check: the identity every prompt batch carries is
    the file's name and content hash; without KL no reward service is waited for (the agent
    scores) unless a reward model or function is given (it scores the episodes that return reward
    None), and the run scores by its episodes (learner.rl.build.sample_scoring)."""
    with pytest.raises(ValueError, match=r"--agent_func_path .*nope.py: cannot read the agent file"):
        cfg(agent_func_path=str(tmp_path / "nope.py"))
    with pytest.raises(ValueError, match="an agent is a Python file"):
        cfg(agent_func_path=str(tmp_path / "env.txt"))
    env = tmp_path / "env.py"
    env.write_text("class AgentExecutor: ...\n")
    c = cfg(agent_func_path=str(env), agent_max_turns=3, max_len=96, init_kl_coef=0.0)
    params = c.agent_params()
    assert params.agent.startswith("env.py:") and len(params.agent.split(":")[1]) == 12
    assert (params.max_len, params.max_turns, params.step_timeout_s) == (96, 3, 60.0)
    assert c.services.min_reward_services == 0 and any("no reward service is waited for" in n for n in c.notices)
    env.write_text("class AgentExecutor: pass\n")  # another version of the file: another identity
    assert cfg(agent_func_path=str(env)).agent_params().agent != params.agent
    assert cfg(agent_func_path=str(env), init_kl_coef=0.01).services.min_reward_services == 1  # the reference scores
    with_rm = cfg(agent_func_path=str(env), reward_pretrain="rm", init_kl_coef=0.0)
    assert with_rm.services.min_reward_services == 1  # the reward model scores episodes that leave it None
    scoring = sample_scoring(with_rm)
    assert isinstance(scoring, EpisodeScoring) and scoring.service_rewards and not scoring.reference
    assert isinstance(sample_scoring(cfg()), ServiceScoring)
    assert (
        cfg().data.max_len == cfg().data.prompt_max_len + cfg().rollout.max_new_tokens and cfg().agent_params() is None
    )


def test_rollout_admission_refuses_another_agent_or_too_short_a_server_by_name(tmp_path):
    """The pool's check of a Hello in an agent run (learner.rl.build.rollout_admission): the same
    file (by content) and room for a whole episode; reward services and plain runs pass."""
    from common import protocol as P
    from learner.rl.build import rollout_admission

    env = tmp_path / "env.py"
    env.write_text("class AgentExecutor: ...\n")
    c = cfg(agent_func_path=str(env), max_len=96, init_kl_coef=0.0)
    admit = rollout_admission(c)
    want = c.agent_params().agent

    def hello(agent: str, max_model_len: int = 128, role: str = "rollout") -> P.Hello:
        caps = P.RolloutCapabilities(agent=agent, max_model_len=max_model_len) if role == "rollout" else None
        return P.Hello(role=role, name="r0", capabilities=caps or P.RewardCapabilities())

    assert admit(hello(want)) is None and admit(hello("", role="reward")) is None
    assert "r0 runs agent none; this run's --agent_func_path" in admit(hello("")).message
    assert "r0 runs agent env.py:000000000000" in admit(hello("env.py:000000000000")).message
    assert "--max_model_len 64, below this run's --max_len 96" in admit(hello(want, 64)).message
    assert rollout_admission(cfg())(hello("")) is None  # no agent: any rollout server will do


def test_rollout_admission_under_lora_sync_adapter_wants_servers_that_serve_the_rank():
    from common import protocol as P
    from learner.rl.build import rollout_admission

    def hello(rank: int) -> P.Hello:
        return P.Hello(role="rollout", name="r1", capabilities=P.RolloutCapabilities(max_lora_rank=rank))

    admit = rollout_admission(cfg(lora_rank=8, lora_sync="adapter"))
    assert admit(hello(8)) is None and admit(hello(16)) is None
    assert admit(P.Hello(role="reward", name="rw", capabilities=P.RewardCapabilities())) is None
    assert admit(hello(4)).message.startswith("r1 serves LoRA adapters up to rank 4 (0: started without --enable_lora)")
    assert "start it with --enable_lora --max_lora_rank 8, or push merged weights" in admit(hello(0)).message
    assert rollout_admission(cfg(lora_rank=8))(hello(0)) is None  # merged: the servers need nothing
