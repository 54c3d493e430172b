"""A reward function that misbehaves on request, for the reward-service fault tests.

The mode comes from a marker in the prompt text, so one batch can mix modes across calls:
``[raise]`` raises, ``[sleep]`` hangs for a minute, ``[short]`` returns one reward too few,
``[nan]`` returns NaN for that sample, ``[exit]`` kills its own process. Otherwise each
sample scores 0.0 (so next to another reward function it adds nothing).
"""

import math
import os
import time


def reward_func(queries, prompts, labels):
    joined = " ".join(prompts)
    if "[raise]" in joined:
        raise ZeroDivisionError("deliberate failure in the test reward")
    if "[sleep]" in joined:
        time.sleep(60)
    if "[exit]" in joined:
        os._exit(3)
    rewards = [math.nan if "[nan]" in p else 0.0 for p in prompts]
    if "[short]" in joined:
        rewards = rewards[:-1]
    return rewards
