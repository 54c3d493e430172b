"""launch.demo reuses a stage's output only when it was made from the same command and inputs."""

from launch.demo import mark_stage_done, stage_done, stage_key


def test_a_stage_is_reused_only_for_the_same_command_and_inputs(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text('{"input": "12>", "label": "21"}\n')
    out = tmp_path / "sft"
    out.mkdir()
    (out / "config.json").write_text("{}")  # output of some earlier run, no stamp: not trusted
    key = stage_key(["-m", "learner.train_sft", "--max_epochs", "2"], [data])
    assert not stage_done(out, key)
    mark_stage_done(out, key)
    assert stage_done(out, stage_key(["-m", "learner.train_sft", "--max_epochs", "2"], [data]))
    assert not stage_done(out, stage_key(["-m", "learner.train_sft", "--max_epochs", "12"], [data]))
    data.write_text('{"input": "13>", "label": "31"}\n')
    assert not stage_done(out, stage_key(["-m", "learner.train_sft", "--max_epochs", "2"], [data]))
