"""What each advantage estimator needs, apart from its formula: the registry the flags and the
trainer read (no torch here, so the config that derives ``--algo.advantage.estimator``'s choices
from it answers ``--help`` at once). Its formula is ``learner.algorithms.advantages``'s entry of
the same name (a test holds the two registries to the same names).

Adding an estimator is adding its formula there and one ``EstimatorSpec`` here: the flag's
choices, the group-size and gamma checks and whether a critic is built follow from it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EstimatorSpec:
    name: str
    summary: str  # one line for --help
    needs_critic: bool = False  # a value model is trained beside the policy (PPO with GAE)
    min_group: int = 1  # samples per prompt it compares (--rollout.n_samples_per_prompt at least)
    any_gamma: bool = False  # a discount other than 1 means something (else --algo.advantage.gamma must be 1)


ESTIMATORS: dict[str, EstimatorSpec] = {
    s.name: s
    for s in (
        EstimatorSpec("gae", "PPO with a critic (GAE)", needs_critic=True, any_gamma=True),
        EstimatorSpec("reinforce", "REINFORCE++: discounted returns, batch-whitened", any_gamma=True),
        EstimatorSpec("reinforce_baseline", "REINFORCE++-baseline: group mean removed, batch-whitened", min_group=2),
        EstimatorSpec("rloo", "RLOO: leave-one-out group baseline", min_group=2),
        EstimatorSpec("group_norm", "GRPO: group mean and std", min_group=2),
        EstimatorSpec("dr_grpo", "Dr. GRPO: group mean, no std, no length normalisation", min_group=2),
    )
}


def estimator_help() -> str:
    return "; ".join(f"{s.name}: {s.summary}" for s in ESTIMATORS.values())
