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


def test_smollm2_task_first_integer_reward():
    from launch import demo_task_smollm2 as t

    train, held = t.problems(0)
    assert len(train) == 240 and len(held) == 60 and train[0]["input"].startswith(t.SHOTS)
    assert not {r["input"] for r in train} & {r["input"] for r in held}
    p = t.SHOTS + "12+7="
    out = t.reward_func([p + "19\n3+4=7", p + " 19", p + "18", p + "x"], [p] * 4, ["19"] * 4)
    # the first integer counts (the model goes on with the next shot); a wrong or missing one does not
    assert out["rewards"].tolist() == [1.0, 1.0, 0.0, 0.0]


def test_agent_task_rewards_a_first_try_fully_and_a_second_try_by_half():
    import asyncio

    from launch.demo_agent_task import SECOND_TRY_REWARD, AgentInstance

    async def episode(*answers):
        env = AgentInstance()
        await env.reset({"observation": "4721>", "label": "1274"})
        return [await env.step({"action_text": a, "label": "1274"}) for a in answers]

    (right,) = asyncio.run(episode("1274"))
    assert (right["rewards"], right["done"], right["environment_feedback"]) == (1.0, True, "")
    wrong, second = asyncio.run(episode("1247", " 1274"))
    assert (wrong["rewards"], wrong["done"], wrong["environment_feedback"]) == (0.0, False, " no 4721>")
    assert (second["rewards"], second["done"]) == (SECOND_TRY_REWARD, True) and second["extra_logs"]["accuracy"] == 1.0
    _, last = asyncio.run(episode("1", "2"))
    assert (last["rewards"], last["done"], last["extra_logs"]) == (0.0, True, {"accuracy": 0.0, "first_try": 0.0})
