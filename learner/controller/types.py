"""What goes into the controller and what comes out of it.

``PromptItem`` in (one prompt: its tokens, text for text rewards, label for rule rewards),
``CollectResult`` out: a ``Rollout`` of ``ScoredSample`` in complete groups, plus the ledger
entries they came from and how many groups scoring failed. Plain data: no sockets and no
torch.distributed, so the controller, the schedules and the tests share them freely.

Shape glossary: N samples, G samples per prompt (a group), T_i tokens of sample i's response.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class PromptItem:
    """One prompt as the controller hands it out."""

    tokens: list[int]
    text: str = ""  # for function rewards: OpenRLHF's `queries` are text + response
    label: Any = None  # for rule rewards (the dataset's --label_key)
    # vLLM samples this prompt with seed .. seed + n-1 on any server, on every retry (None: the
    # engine's generator). Set by ``PromptStream`` under --seed_sampling, from the prompt's place
    # in the run, so a resumed run draws the samples the uninterrupted one drew.
    seed: int | None = None
    # Evaluation prompts: the data source their metrics are reported under (never sent anywhere).
    source: str = ""


@dataclass
class ScoredSample:
    """One generated and scored response: what the learner trains on."""

    prompt_id: int
    sample_index: int
    prompt: list[int]  # shared by the samples of a group: never modified
    response: torch.Tensor  # (T_i,) int32 token ids (a view of one copy per prompt)
    rollout_logprobs: torch.Tensor  # (T_i,) float32, from vLLM
    ref_logprobs: torch.Tensor | None  # (T_i,) float32, from the reference model
    reward: float
    finish_reason: str = "stop"
    policy_version: int = 0  # the weights that sampled the first token
    # Agent episodes: (T_i,) bool, True on the tokens the policy sampled (False on environment
    # feedback, which is context only); None: every response token is the policy's.
    action_mask: torch.Tensor | None = None
    turns: int = 0  # the episode's actions (0: not an agent sample)
    # The ``extra_logs`` the reward function(s) and the agent returned for this sample, as they
    # named them (NaN: its source logged that name for other samples only). Rank 0 reports their
    # means (``learner.rl.metrics.extra_log_metrics``); they are not broadcast to other ranks.
    reward_logs: dict[str, float] = field(default_factory=dict)
    agent_logs: dict[str, float] = field(default_factory=dict)
    # (T_i,) float32, the teacher's log-probs of the response tokens (on-policy distillation,
    # --teacher_pretrain); None: no teacher scored it
    teacher_logprobs: torch.Tensor | None = None
    # (T_i, K) int32 / float32: the teacher's K most likely ids at each response position and
    # their log-probs (top-k distillation, --distill_topk K); None: not asked
    teacher_topk_ids: torch.Tensor | None = None
    teacher_topk_logprobs: torch.Tensor | None = None

    @property
    def action_len(self) -> int:
        """The policy's tokens in the response (an agent's environment feedback not counted)."""
        return len(self.response) if self.action_mask is None else int(self.action_mask.sum())


@dataclass
class Rollout:
    """One global batch: N samples in groups of ``group_size`` consecutive samples (one prompt each)."""

    samples: list[ScoredSample]
    group_size: int
    stats: dict[str, float] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.samples)

    def rewards(self) -> torch.Tensor:
        return torch.tensor([s.reward for s in self.samples], dtype=torch.float32)  # (N,)


@dataclass
class CollectResult:
    rollout: Rollout
    entries: list[Any]  # the ledger entries of the kept groups (``ledger.Entry``)
    failed_groups: int = 0  # groups dropped because scoring failed for a sample
    reasons: list[str] = field(default_factory=list)  # the first failure reason of each
