"""learner.rl.prompts.PromptStream: which prompt each step and refill draws, and the sampling
seed each carries under --seed_sampling (by place in the run, not by controller prompt id)."""

import hashlib
import itertools

import pytest

from common.protocol import SEED_LIMIT
from learner.controller.types import PromptItem
from learner.rl.prompts import PromptStream, sampling_seed


def items(n):
    return [PromptItem(tokens=[i + 1], text=f"p{i}") for i in range(n)]


def test_sampling_seed_by_hand():
    # blake2b-64 of repr((7, 12)), little-endian, reduced mod 2**62
    digest = hashlib.blake2b(b"(7, 12)", digest_size=8).digest()
    assert sampling_seed(7, 12) == int.from_bytes(digest, "little") % 2**62
    assert sampling_seed(7, "refill", 3, 0) != sampling_seed(7, 3)
    assert 0 <= sampling_seed(0, 0) < SEED_LIMIT


def test_steps_draw_consecutive_slices_and_refills_follow_them_cycling():
    s = PromptStream(items(5), 2)  # 2 steps per episode: prompt 4 is never a batch
    assert [[it.text for it in s.batch(k)] for k in (1, 2, 3)] == [["p0", "p1"], ["p2", "p3"], ["p0", "p1"]]
    assert [s.at(p).text for p in range(6)] == ["p0", "p1", "p2", "p3", "p0", "p1"]
    more = s.refills(2)
    assert [it.text for it in more(2)] + [it.text for it in more(2)] == ["p4", "p0", "p1", "p2"]
    assert all(it.seed is None for it in s.batch(1) + more(3)), "unseeded unless asked"


def test_seeds_follow_the_place_in_the_run_not_the_prompt():
    s = PromptStream(items(4), 2, seed=11)
    b1, b3 = s.batch(1), s.batch(3)  # the same prompts, one episode apart
    assert [it.text for it in b1] == [it.text for it in b3]
    assert [it.seed for it in b1] == [sampling_seed(11, 0), sampling_seed(11, 1)]
    assert [it.seed for it in b3] == [sampling_seed(11, 4), sampling_seed(11, 5)]
    assert [s.at(p).seed for p in (4, 5)] == [it.seed for it in b3], "async's positions = lockstep's slices"
    assert [it.seed for it in s.refills(3)(3)] == [sampling_seed(11, "refill", 3, j) for j in range(3)]
    assert s.items[0].seed is None, "the data's own items are not changed"
    # a restarted learner's stream (a new object, as after a resume) gives the same seeds
    again = PromptStream(items(4), 2, seed=11)
    assert [it.seed for it in again.batch(3)] == [it.seed for it in b3]
    assert [it.seed for it in PromptStream(items(4), 2, seed=12).batch(1)] != [it.seed for it in b1]


@pytest.mark.parametrize("n_places", [10_000])
def test_seeds_of_a_run_leave_room_for_n_samples_each(n_places):
    """vLLM samples a seeded prompt's n samples with seed .. seed + n-1: no two places' ranges
    may meet (with consecutive seeds, prompt p's second sample would be prompt p+1's first)."""
    seeds = sorted(sampling_seed(0, p) for p in range(n_places))
    assert min(b - a for a, b in itertools.pairwise(seeds)) > 64
