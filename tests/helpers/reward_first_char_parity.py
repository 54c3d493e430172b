"""A reward a random tiny model can learn in a few GRPO steps: about half of its first
tokens are rewarded (even code point of the response's first character), so every group
has signal, and the policy only has to move mass at one position."""

import torch


def reward_func(queries, prompts, labels, responses=None, **kwargs):
    responses = responses if responses is not None else [q[len(p) :] for q, p in zip(queries, prompts, strict=True)]
    r = [1.0 if text and ord(text[0]) % 2 == 0 else 0.0 for text in responses]
    return torch.tensor(r)
