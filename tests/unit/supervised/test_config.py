"""The supervised trainers' config (``learner.supervised.config``): OpenRLHF 0.10's dotted names
and the older flat ones are one set of flags, mixed freely; every flat flag the trainers had
before the config had sections still works; each trainer's defaults; what each section checks,
what the root configs say at start-up (``notices``), and the checkpoint's matched fields."""

from __future__ import annotations

import pytest

from common.config import ConfigError, build, flag_names, get, parse
from learner.train_dpo import DPOConfig
from learner.train_rm import RMConfig
from learner.train_sft import SFTConfig

CONFIGS = {"sft": SFTConfig, "rm": RMConfig, "dpo": DPOConfig}
NEEDED = ["--pretrain", "m", "--dataset", "d.jsonl"]

# The flat flags each trainer took before its config had sections (rayless's first trainers,
# OpenRLHF's names before 0.10): scripts written for them must run unchanged.
FLAT_BEFORE = """
    pretrain save_path tokenizer_chat_template dataset dataset_probs dataset_split train_split eval_dataset
    eval_split max_samples max_len input_template apply_chat_template skip_bad_rows max_epochs train_batch_size
    micro_train_batch_size learning_rate lr_scheduler lr_warmup_ratio local_rank logging_steps eval_steps
    eval_at_start use_tensorboard l2 adam_betas max_norm seed zero_stage bf16 adam_offload gradient_checkpointing
    host_malloc coalesce_grad_reduction flash_attn lora_rank lora_alpha target_modules lora_dropout save_steps
    ckpt_path max_ckpt_num load_checkpoint save_hf_ckpt use_wandb wandb_org wandb_group wandb_project wandb_run_name
""".split()
FLAT_OWN = {
    "sft": ["input_key", "output_key", "pretrain_mode", "packing_samples"],
    "rm": ["prompt_key", "chosen_key", "rejected_key", "margin_key", "loss", "margin_loss", "value_head_prefix"],
    "dpo": [
        "ref_pretrain",
        "ref_offload",
        "prompt_key",
        "chosen_key",
        "rejected_key",
        "beta",
        "label_smoothing",
        "ipo",
        "nll_loss_coef",
    ],
}


@pytest.mark.parametrize("trainer", sorted(CONFIGS))
def test_every_flat_flag_of_before_the_sections_is_still_accepted(trainer):
    accepted = flag_names(CONFIGS[trainer])
    missing = [name for name in FLAT_BEFORE + FLAT_OWN[trainer] if name not in accepted]
    assert missing == [], f"train_{trainer} lost flat flags"


def test_both_spellings_mixed_give_the_same_config():
    flat = [
        *NEEDED,
        *["--learning_rate", "3e-3", "--train_batch_size", "16", "--micro_train_batch_size", "8", "--l2", "0.1"],
        *["--max_len", "64", "--save_path", "out", "--eval_dataset", "e.jsonl", "--gradient_checkpointing"],
        *["--zero_stage", "3", "--bf16", "--lora_rank", "8", "--use_tensorboard", "tb", "--train_split", "x"],
        *["--input_key", "q", "--output_key", "a", "--pretrain_mode", "--save_steps", "4", "--seed", "7"],
    ]
    dotted = [
        *["--model.model_name_or_path", "m", "--data.dataset", "d.jsonl", "--adam.lr", "3e-3"],
        *["--train.batch_size", "16", "--train.micro_batch_size", "8", "--adam.weight_decay", "0.1"],
        *["--data.max_len", "64", "--ckpt.output_dir", "out", "--eval.dataset", "e.jsonl"],
        *["--model.gradient_checkpointing_enable", "--ds.zero_stage", "3", "--ds.param_dtype", "bf16"],
        *["--ds.lora.rank", "8", "--logger.tensorboard_dir", "tb", "--data.dataset_split", "x"],
        *["--data.input_key", "q", "--data.output_key", "a", "--model.pretrain_mode_enable"],
        *["--ckpt.save_steps", "4", "--train.seed", "7"],
    ]
    mixed = [*flat[:12], *dotted[12:]]  # the first flags flat, the rest dotted
    a, b, c = (parse(SFTConfig, argv, raise_errors=True) for argv in (flat, dotted, mixed))
    assert a == b == c
    assert a.adam.lr == 3e-3 and a.adam.weight_decay == 0.1 and a.ds.bf16 and a.model.gradient_checkpointing_enable
    assert a.ds.lora.rank == 8 and a.ckpt.output_dir == "out" and a.data.dataset_split == "x"
    assert a.model.pretrain_mode_enable and a.train.seed == 7 and a.logger.tensorboard_dir == "tb"


def test_one_flag_given_in_both_spellings_with_two_values_is_refused_naming_both():
    with pytest.raises(ConfigError, match=r"--beta 0.1 and --model.beta 0.2 set the same flag"):
        parse(DPOConfig, [*NEEDED, "--beta", "0.1", "--model.beta", "0.2"], raise_errors=True)


def test_each_trainer_keeps_its_defaults():
    sft, rm, dpo = (build(cls, pretrain="m", dataset="d") for cls in (SFTConfig, RMConfig, DPOConfig))
    assert (sft.adam.lr, rm.adam.lr, dpo.adam.lr) == (5e-6, 9e-6, 1e-5)
    assert (sft.train.max_epochs, rm.train.max_epochs, dpo.train.max_epochs) == (2, 1, 1)
    assert (sft.data.max_len, rm.data.max_len, dpo.data.max_len) == (2048, 512, 512)
    assert (
        sft.data.input_template == dpo.data.input_template == "User: {}\nAssistant: " and rm.data.input_template == ""
    )
    assert [c.ckpt.output_dir for c in (sft, rm, dpo)] == ["./ckpt/sft", "./ckpt/rm", "./ckpt/dpo"]
    assert sft.lr_warmup_ratio == 0.03 and sft.lr_scheduler == "cosine_with_min_lr"  # OpenRLHF's, all three
    assert dpo.ref.model_name_or_path == "m"  # the reference defaults to the trained model, in the logged config
    assert build(DPOConfig, pretrain="m", ref_pretrain="r").ref.model_name_or_path == "r"
    assert not any(c.notices for c in (sft, rm, dpo))


def test_the_required_flags_are_named_in_both_spellings():
    with pytest.raises(ConfigError, match=r"--model.model_name_or_path / --pretrain.*--data.dataset / --dataset"):
        parse(SFTConfig, [], raise_errors=True)


@pytest.mark.parametrize(
    ("cls", "values", "match"),
    [
        (SFTConfig, {"input_template": "no braces"}, r"--data.input_template \(--input_template\) 'no braces' has no"),
        (SFTConfig, {"train_batch_size": 12, "micro_train_batch_size": 8}, "--train_batch_size 12 must be a multiple"),
        (SFTConfig, {"multiturn": True}, r"--data.multiturn \(--multiturn\) learns whole chats"),
        (SFTConfig, {"multiturn": True, "apply_chat_template": True, "output_key": "a"}, "give no --data.output_key"),
        (RMConfig, {"loss": "hinge"}, None),  # not a choice
        (DPOConfig, {"beta": 0.0}, r"--model.beta \(--beta\) must be > 0"),
        (DPOConfig, {"label_smoothing": 0.5}, r"--model.label_smoothing \(--label_smoothing\) must be in"),
        (SFTConfig, {"optim": "muon", "muon.momentum": 1.0}, r"--muon.momentum must be in \[0, 1\)"),
    ],
)
def test_a_bad_flag_is_refused_naming_it(cls, values, match):
    if match is None:  # argparse's choices
        with pytest.raises(ConfigError, match="invalid choice"):
            parse(cls, [*NEEDED, *(x for k, v in values.items() for x in (f"--{k}", str(v)))], raise_errors=True)
        return
    with pytest.raises(ValueError, match=match):
        build(cls, pretrain="m", dataset="d", **values)


def test_multiturn_is_what_a_chat_row_without_output_key_already_trains():
    cfg = build(SFTConfig, pretrain="m", dataset="d", multiturn=True, apply_chat_template=True, input_key="messages")
    assert cfg.data.multiturn and not cfg.data.output_key and cfg.notices == []


def test_flags_that_cannot_act_here_are_said_once_at_start_up():
    argv = [*NEEDED, "--ds.packing_samples", "--ckpt.disable_ds", "--model.aux_loss_coef", "0.01", "--local_rank", "0"]
    rm = parse(RMConfig, argv, raise_errors=True)
    said = "\n".join(rm.notices)
    assert "--ds.packing_samples: accepted, but packing pairs is not built yet" in said
    assert "--ckpt.disable_ds True: accepted, but" in said and "--model.aux_loss_coef 0.01: accepted, but" in said
    assert "--local_rank 0: accepted, but" in said
    assert len(rm.notices) == 4
    # SFT packs: no notice for it; a value head's name means nothing to SFT and DPO and says so.
    sft = parse(SFTConfig, [*NEEDED, "--packing_samples", "--value_head_prefix", "v"], raise_errors=True)
    assert sft.ds.packing_samples and sft.notices == [
        "--ds.value_head_prefix v: accepted, but it names a reward model's head and this trainer trains none"
    ]
    # The RM's head is named by it: loaded and saved under that name (learner.runtime.models), no notice.
    assert not build(RMConfig, pretrain="m", dataset="d", value_head_prefix="value_head").notices
    # RM computes its loss in fp32 always: asking for it is said, not refused.
    (fp32,) = build(RMConfig, pretrain="m", dataset="d", compute_fp32_loss=True).notices
    assert fp32.startswith("--model.compute_fp32_loss_enable True: accepted, but rayless always computes")


def test_the_checkpoint_matches_the_fields_it_saved_under_their_flat_names():
    from learner.supervised.checkpoint import MATCH_FIELDS, match_fields

    cfg = build(SFTConfig, pretrain="m", dataset="d", lora_rank=8, seed=3, **{"train.batch_size": 32})
    fields = match_fields(cfg, "sft", n_train=100)
    assert set(fields) == set(MATCH_FIELDS) | {"trainer", "n_train"}
    assert fields["pretrain"] == "m" and fields["lora_rank"] == 8 and fields["seed"] == 3
    assert fields["train_batch_size"] == 32 and fields["micro_train_batch_size"] == 8
    assert fields["target_modules"] == ["all-linear"] and fields["trainer"] == "sft"
    assert all(get(cfg, path) == fields[name] for name, path in MATCH_FIELDS.items())
