"""MetricsWriter: the JSON-lines records every trainer writes, and its optional TensorBoard."""

from __future__ import annotations

import json

from learner.runtime.metrics import MetricsWriter


def _records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_appends_one_prefixed_record_per_write(tmp_path):
    path = tmp_path / "out" / "train_log.jsonl"
    w = MetricsWriter(path)
    assert path.exists() and path.read_text() == ""  # created before the first step
    w.write(1, {"loss": 0.5, "lr": 1e-3}, "train")
    w.write(2, {"acc": 1.0}, "eval")
    w.close()
    got = _records(path)
    assert [r["step"] for r in got] == [1, 2]
    assert got[0]["train/loss"] == 0.5 and got[0]["train/lr"] == 1e-3 and got[1]["eval/acc"] == 1.0
    assert all(isinstance(r["time"], float) for r in got)


def test_no_prefix_keeps_keys_and_a_second_writer_appends(tmp_path):
    path = tmp_path / "metrics.jsonl"
    MetricsWriter(path).write(1, {"reward/mean": 0.25, "note": "text is kept"})
    MetricsWriter(path).write(2, {"reward/mean": 0.5})  # a resumed run continues the file
    got = _records(path)
    assert [r["reward/mean"] for r in got] == [0.25, 0.5] and got[0]["note"] == "text is kept"


def test_tensorboard_gets_the_numeric_values(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    w = MetricsWriter(tmp_path / "m.jsonl", tmp_path / "tb")
    w.write(3, {"loss": 2.0, "note": "not a scalar"}, "train")
    w.close()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert acc.Tags()["scalars"] == ["train/loss"]
    (event,) = acc.Scalars("train/loss")
    assert event.step == 3 and event.value == 2.0


def test_a_resumed_run_hides_the_killed_runs_later_events_from_tensorboard(tmp_path):
    """Killed after step 5, resumed from the checkpoint of step 3: steps 4 and 5 are written
    again, and TensorBoard shows each step once, the resumed run's value."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    first = MetricsWriter(tmp_path / "m.jsonl", tmp_path / "tb")
    for step in range(1, 6):
        first.write(step, {"loss": float(step)})
    first.close()
    resumed = MetricsWriter(tmp_path / "m.jsonl", tmp_path / "tb")
    resumed.resume_after(3)
    for step in (4, 5):
        resumed.write(step, {"loss": 10.0 * step})
    resumed.close()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0), (5, 50.0)]


def test_samples_go_to_their_own_file_and_a_resume_drops_the_killed_runs_later_ones(tmp_path):
    first = MetricsWriter(tmp_path / "metrics.jsonl")
    for step in (2, 4, 6):
        first.write_samples(step, [{"prompt": "1+1=", "response": str(step), "reward": 1.0}])
    first.write_samples(8, [])  # nothing to show: no line
    first.close()
    resumed = MetricsWriter(tmp_path / "metrics.jsonl")
    resumed.resume_after(4)
    resumed.write_samples(6, [{"prompt": "1+1=", "response": "again", "reward": 0.0}])
    got = _records(tmp_path / "samples.jsonl")
    assert [(r["step"], r["response"]) for r in got] == [(2, "2"), (4, "4"), (6, "again")]
    assert _records(tmp_path / "metrics.jsonl") == []  # samples are not metrics
