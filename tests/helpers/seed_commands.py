"""The seed's PPO commands of workflows 1 and 2, as OpenRLHF's README writes them.

The seed asks that users' OpenRLHF scripts port by swapping the module
(``openrlhf.cli.train_ppo_ray`` -> ``learner.train_ppo``). Its workflow-1 PPO hop is the README's
"PPO/REINFORCE++ with Ray and vLLM" (hybrid engine) command; workflow 2 is the README's
"Reinforced Fine-tuning": the same command scored by a ``reward_func`` file
(``--remote_rm_url /path/to/reward_func.py --label_key answer``) instead of a reward model.
The text is kept as the README prints it, including its missing ``\\`` after
``--deepspeed_enable_sleep``: a shell ends the command there, so ``--use_wandb {wandb_token}``
is a line of its own (``argv`` below does what the shell does).
"""

from __future__ import annotations

import shlex

OPENRLHF_MODULE = "openrlhf.cli.train_ppo_ray"
RAYLESS_MODULE = "learner.train_ppo"

_PPO_HYBRID_ENGINE = r"""ray job submit --address="http://127.0.0.1:8265" \
   --runtime-env-json='{"working_dir": "/openrlhf"}' \
   -- python3 -m openrlhf.cli.train_ppo_ray \
   --ref_num_nodes 1 \
   --ref_num_gpus_per_node 8 \
   --reward_num_nodes 1 \
   --reward_num_gpus_per_node 8 \
   --critic_num_nodes 1 \
   --critic_num_gpus_per_node 8 \
   --actor_num_nodes 1 \
   --actor_num_gpus_per_node 8 \
   --vllm_num_engines 4 \
   --vllm_tensor_parallel_size 2 \
   --colocate_all_models \
   --vllm_gpu_memory_utilization 0.5 \
   --pretrain OpenRLHF/Llama-3-8b-sft-mixture \
   --reward_pretrain OpenRLHF/Llama-3-8b-rm-700k \
   --save_path /openrlhf/examples/test_scripts/final/llama3-8b-rlhf \
   --ckpt_path /openrlhf/examples/test_scripts/ckpt/llama3-8b-rlhf \
   --save_hf_ckpt \
   --micro_train_batch_size 8 \
   --train_batch_size 128 \
   --micro_rollout_batch_size 16 \
   --rollout_batch_size 1024 \
   --n_samples_per_prompt 1 \
   --max_epochs 1 \
   --prompt_max_len 1024 \
   --max_samples 100000 \
   --generate_max_len 1024 \
   --zero_stage 3 \
   --bf16 \
   --actor_learning_rate 5e-7 \
   --critic_learning_rate 9e-6 \
   --init_kl_coef 0.01 \
   --prompt_data OpenRLHF/prompt-collection-v0.1 \
   --input_key context_messages \
   --apply_chat_template \
   --normalize_reward \
   --gradient_checkpointing \
   --packing_samples \
   --vllm_sync_backend nccl \
   --enforce_eager \
   --vllm_enable_sleep \
   --deepspeed_enable_sleep
   --use_wandb {wandb_token}
"""

WORKFLOW_1 = _PPO_HYBRID_ENGINE
WORKFLOW_2 = _PPO_HYBRID_ENGINE.replace(
    "   --reward_pretrain OpenRLHF/Llama-3-8b-rm-700k \\\n",
    "   --remote_rm_url /path/to/reward_func.py \\\n   --label_key answer \\\n",
)
SEED_PPO_COMMANDS = {"workflow1": WORKFLOW_1, "workflow2": WORKFLOW_2}


def ported(command: str) -> str:
    """The one edit the seed allows: the module name."""
    return command.replace(OPENRLHF_MODULE, RAYLESS_MODULE)


def argv(command: str, module: str = RAYLESS_MODULE) -> list[str]:
    """The flags a shell hands ``python -m module``: lines joined at a trailing backslash, the
    command ending at the first line without one, everything before the module dropped."""
    first = []
    for line in command.splitlines():
        first.append(line.rstrip().removesuffix("\\"))
        if not line.rstrip().endswith("\\"):
            break
    words = shlex.split(" ".join(first))
    return words[words.index(module) + 1 :]
