"""RL training of a policy with rollouts from rollout_service and scores from reward_service.

    torchrun --nproc_per_node N -m learner.train_ppo --pretrain PATH --prompt_data FILE ...
    python -m learner.train_ppo ...            # one learner process

Rank 0 is also the controller: it binds ``--controller_bind``, waits for the services, and
runs one of three schedules (``learner/rl/schedules/``): lockstep (the default)

    collect rollout_batch_size prompts x n_samples_per_prompt  (rollout + reward services)
    -> PPO/GRPO update on every rank                            (DeepSpeed)
    -> push the new weights to every rollout server             (torch.distributed)

colocated (``--train.colocate_all``: the same order, learner and engines taking turns on the
same GPUs; docs/colocated.md) or async (``--train.async_enable``: generation never stops, every
trained sample within ``--train.max_staleness`` versions; docs/async.md).

Flags follow OpenRLHF's ``train_ppo_ray``, in both spellings: 0.10's dotted names
(``--actor.adam.lr``) and the older flat ones (``--actor_learning_rate``), mixed freely;
``--help`` lists each flag once with both names, by section. The services are separate
processes: start them yourself (README's multi-terminal recipe) or with ``python -m launch.local``.
"""

from __future__ import annotations

import sys

from common.config import parse
from learner.rl.config import PPOConfig


def main(argv: list[str] | None = None) -> int:
    cfg = parse(PPOConfig, argv, description=__doc__.split("\n\n")[0], prog="learner.train_ppo")
    from learner.controller.controller import ServicesMissing  # heavy imports only after the flags parse
    from learner.rl.build import RunError
    from learner.rl.run import run

    try:
        return run(cfg)
    except (RunError, ServicesMissing) as e:
        print(f"learner: {e}", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
