"""launch.demo's report: held-out accuracy before and after from the first and last evaluation,
and the reward-curve PNG with the evaluation curve beside the training reward."""

from __future__ import annotations

import json

from launch.demo import report


def test_the_report_reads_the_evaluations_and_draws_both_curves(tmp_path, capsys, monkeypatch):
    rows = [{"step": 0, "eval/accuracy": 0.1}]
    for step in range(1, 11):
        rows.append({"step": step, "rollout/reward": step / 20})
        if step % 5 == 0:
            rows.append({"step": step, "eval/accuracy": step / 10})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    drawn = {}
    import matplotlib.axes

    plot = matplotlib.axes.Axes.plot

    def recording_plot(self, x, y, *a, label=None, **kw):
        drawn[label] = (list(x), list(y))
        return plot(self, x, y, *a, label=label, **kw)

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", recording_plot)
    report(tmp_path, seconds=60.0)
    out = capsys.readouterr().out
    assert any(line.split() == ["held-out", "accuracy", "0.100", "1.000"] for line in out.splitlines()), out
    assert drawn["held-out accuracy (greedy)"] == ([0, 5, 10], [0.1, 0.5, 1.0])
    assert drawn["train reward"][0] == list(range(1, 11))
    assert (tmp_path / "reward_curve.png").stat().st_size > 0
