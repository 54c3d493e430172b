"""Reward files shipped with the reward service, chosen by name (``--reward_func math``).

Each is an ordinary ``reward_func`` file (docs/reward.md), run in the function workers like a
user's file; ``reward_service.config.BUILTIN_REWARDS`` maps names to them.
"""
