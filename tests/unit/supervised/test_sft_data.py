"""learner.supervised.sft_data / learner.supervised.rm_data / learner.runtime.models on the tiny model, in-process:
which tokens carry loss, packed rows keep attention within each sample, pair batches."""

from __future__ import annotations

import pytest
import torch

from learner.algorithms.sft_loss import IGNORE_INDEX, sft_loss
from learner.supervised.sft_data import (
    MaskedTokens,
    collate_packed,
    collate_padded,
    encode_conversation,
    encode_prompt_response,
    sft_sample,
)


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()


def learned_text(tok, sample: MaskedTokens) -> str:
    return tok.decode([t for t, m in zip(sample.input_ids, sample.loss_mask, strict=True) if m])


def test_loss_only_on_the_response_ending_in_eos(tok):
    row = {"q": "What is 2 + 3?", "a": "Answer: 5"}
    s = sft_sample(row, tok, input_key="q", output_key="a", apply_chat_template=True, input_template=None, max_len=64)
    assert learned_text(tok, s) == "Answer: 5<|im_end|>"
    s = sft_sample(
        row,
        tok,
        input_key="q",
        output_key="a",
        apply_chat_template=False,
        input_template="User: {}\nAssistant: ",
        max_len=64,
    )
    # The template's trailing space and "Answer" are one token (" Answer"): it overlaps the
    # response, so it is learned.
    assert learned_text(tok, s) == " Answer: 5<|im_end|>"
    assert tok.decode(s.input_ids).startswith("User: What is 2 + 3?\nAssistant: ")
    # Truncation that leaves no response token drops the sample (the caller counts it).
    assert (
        sft_sample(row, tok, input_key="q", output_key="a", apply_chat_template=True, input_template=None, max_len=5)
        is None
    )


def test_multi_turn_chat_learns_every_assistant_turn_and_nothing_else(tok):
    chat = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "5"},
        {"role": "user", "content": "And 7 * 8?"},
        {"role": "assistant", "content": "56"},
    ]
    s = encode_conversation(tok, chat)
    assert learned_text(tok, s) == "5<|im_end|>56<|im_end|>"
    assert tok.decode(s.input_ids) == tok.apply_chat_template(chat, tokenize=False)


def test_packed_row_equals_separate_samples(tok, model):
    """Attention stays within each packed sample (SDPA block-diagonal mask from position ids):
    logits and the loss of one packed row equal those of the samples run one by one."""
    samples = [
        encode_prompt_response(tok, p, r)
        for p, r in [
            ("What is 2 + 3?", " Answer: 5"),
            ("Reverse the string: hello.", " Answer: olleh"),
            ("Hi", " there"),
        ]
    ]
    packed = collate_packed(samples)
    assert packed["input_ids"].shape == (1, sum(len(s) for s in samples))
    with torch.no_grad():
        # use_cache=False matters: with a KV cache transformers does not look for packed rows.
        packed_logits = model(
            input_ids=packed["input_ids"], position_ids=packed["position_ids"], use_cache=False
        ).logits[0]
        alone = [model(input_ids=torch.tensor([s.input_ids])).logits[0] for s in samples]
        padded = collate_padded(samples, pad_id=tok.pad_token_id)
        padded_logits = model(input_ids=padded["input_ids"], attention_mask=padded["attention_mask"]).logits
    torch.testing.assert_close(packed_logits, torch.cat(alone), atol=1e-4, rtol=1e-4)
    n = int((packed["labels"] != IGNORE_INDEX).sum())
    assert n == int((padded["labels"] != IGNORE_INDEX).sum())
    loss_packed, _ = sft_loss(packed_logits[None], packed["labels"], global_tokens=n)
    loss_padded, _ = sft_loss(padded_logits, padded["labels"], global_tokens=n)
    assert loss_packed.item() == pytest.approx(loss_padded.item(), rel=1e-5)
    # No target crosses a sample boundary: each sample's last position is ignored.
    ends = torch.tensor([len(s) for s in samples]).cumsum(0) - 1
    assert (packed["labels"][0, ends] == IGNORE_INDEX).all()


def test_pairs_end_in_eos_even_when_cut_and_batch_chosen_first(tok):
    from learner.supervised.rm_data import collate_pairs, pair_sample

    row = {"p": "What is 2 + 3?", "c": "Answer: 5", "r": "banana fox " * 20, "m": 0.5}
    pair = pair_sample(
        row,
        tok,
        prompt_key="p",
        chosen_key="c",
        rejected_key="r",
        margin_key="m",
        apply_chat_template=True,
        max_len=24,
        force_eos=True,
    )
    assert len(pair.rejected) == 24 and pair.rejected.input_ids[-1] == tok.eos_token_id
    assert pair.chosen.input_ids[-1] == tok.eos_token_id and pair.margin == 0.5
    batch = collate_pairs([pair, pair], pad_id=tok.pad_token_id)
    assert batch["input_ids"].shape[0] == 4
    assert torch.equal(batch["input_ids"][0], batch["input_ids"][1])  # chosen, chosen, rejected, rejected
    assert batch["attention_mask"][0].sum() == len(pair.chosen)
    too_long_prompt = dict(row, p="What is 1 + 1? " * 20)
    assert (
        pair_sample(
            too_long_prompt, tok, prompt_key="p", chosen_key="c", rejected_key="r", apply_chat_template=True, max_len=24
        )
        is None
    )


def test_reward_model_reads_the_last_attended_token_with_any_padding(tiny_model_dir, tok):
    from learner.runtime.models import load_reward_model

    rm = load_reward_model(str(tiny_model_dir), tokenizer=tok).eval()
    ids = tok(["What is 2 + 3? Answer: 5<|im_end|>", "Hi<|im_end|>"], add_special_tokens=False)["input_ids"]
    width = max(map(len, ids))
    right = torch.tensor([x + [0] * (width - len(x)) for x in ids])
    left = torch.tensor([[0] * (width - len(x)) + x for x in ids])
    mask_r, mask_l = (right != 0).long(), (left != 0).long()
    with torch.no_grad():
        r_right, r_left = rm(right, mask_r), rm(left, mask_l)
        alone = torch.stack([rm(torch.tensor([x]), torch.ones(1, len(x), dtype=torch.long))[0] for x in ids])
    torch.testing.assert_close(r_right, alone, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(r_left, alone, atol=1e-5, rtol=1e-5)
    assert r_right.abs().max() < 1.0  # a fresh head starts near zero
