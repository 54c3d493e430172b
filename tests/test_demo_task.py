"""The demo task: disjoint splits, and the exact-match reward on hand-made cases."""

from launch.demo_task import DIGITS, N_EVAL, N_TRAIN, problems, reward_func


def test_splits_are_disjoint_and_deterministic():
    train, held = problems(0)
    assert len(train) == N_TRAIN and len(held) == N_EVAL
    assert not {r["input"] for r in train} & {r["input"] for r in held}
    assert problems(0) == (train, held) and problems(1) != (train, held)
    r = train[0]
    assert len(r["label"]) == DIGITS and r["input"] == r["label"][::-1] + ">"


def test_reward_is_exact_match_of_the_response():
    prompts = ["1234>", "1234>", "1234>", "0070>", "1234>"]
    queries = ["1234>4321", "1234> 4321\n", "1234>43210", "0070>0700", "1234>"]
    labels = ["4321", "4321", "4321", "0700", "4321"]
    out = reward_func(queries, prompts, labels)
    # exact; surrounding whitespace ignored; one digit too many is wrong; leading zeros kept; empty is wrong
    assert out["rewards"].tolist() == [1.0, 1.0, 0.0, 1.0, 0.0]
    assert out["extra_logs"]["accuracy"].tolist() == out["rewards"].tolist()
