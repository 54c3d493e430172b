"""The demo task: disjoint splits, and the exact-match reward on hand-made cases."""

import json

import pytest

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


def test_calculator_task_questions_need_the_tool_and_its_warm_start_is_what_the_endpoint_serves(tiny_model_dir):
    """make demo TASK=agent-openai: disjoint splits of 4-digit products; each warm-start
    conversation, rendered by the tiny model's template, is the episode the endpoint stitches from
    the same calls (the tool call as sampled, the tool's value, the answer), and its tool call is
    one vLLM's hermes parser reads as the calculator on the question's expression."""
    from transformers import AutoTokenizer

    from launch import demo_calculator_task as t
    from rollout_service.trace import Trace

    train, held = t.problems(0)
    assert len(train) == 2000 and len(held) == 200 and t.problems(0) == (train, held)
    assert not {r["input"] for r in train} & {r["input"] for r in held}
    assert all(len(r["label"]) == 4 and r["label"].isdigit() for r in train + held)
    row = train[0]
    expression = row["input"].removeprefix("What is ").removesuffix("?")
    a, b = (int(x) for x in expression.split(" * "))
    assert str(a * b) == row["label"]

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    conv = t.sft_rows([row])[0]["messages"]
    call_text, answer = conv[2]["content"], conv[4]["content"]
    assert answer == row["label"] and conv[3] == {"role": "tool", "content": row["label"]}
    # The agent's two calls: its reply comes back as the openai client dumps it (no content).
    trace = Trace(tok)
    c1 = trace.chat_prompt(conv[:2], t.TOOLS)
    trace.record(c1, tok(call_text + "<|im_end|>", add_special_tokens=False)["input_ids"], "stop")
    reply = {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "calculator"}}]}
    c2 = trace.chat_prompt([*conv[:2], reply, {"role": "tool", "tool_call_id": "c", "content": row["label"]}], t.TOOLS)
    trace.record(c2, tok(answer + "<|im_end|>", add_special_tokens=False)["input_ids"], "stop")
    seq, _ = trace.stitch()
    assert tok.decode(seq) == tok.apply_chat_template(conv, tokenize=False).rstrip("\n")

    pytest.importorskip("vllm")
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    from rollout_service.openai_api import tool_parser_class

    request = ChatCompletionRequest(model="m", messages=[], tools=t.TOOLS)
    info = tool_parser_class("hermes")(tok, request.tools).extract_tool_calls(call_text, request)
    assert info.tools_called and info.tool_calls[0].function.name == "calculator"
    assert json.loads(info.tool_calls[0].function.arguments) == {"expression": expression}
