"""wandb as a sink of MetricsWriter, run for real in offline mode and read back with wandb's own
reader of the offline run (``wandb leet inspect``): every key and step of the JSON-lines file is
in the run's history on the record's step axis, the config is there with the key redacted, a
resume continues the same run id, and a failed start warns once while the other sinks go on."""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import dataclass

import pytest

from common.config import build, flag, section
from helpers.wandb_offline import history, missing_from_history, offline_env, offline_runs, records, run_info
from learner.runtime.metrics import MetricsWriter
from learner.runtime.tracking import WandbSection, public_config
from learner.runtime.wandb_sink import wandb_sink

KEY = "k" * 20 + "0123456789abcdefghij"  # 40 characters: the shape of a wandb key


@dataclass
class _Cfg:
    lr: float = flag(1e-3, "a flag of the trainer's own")
    wandb: WandbSection = section(WandbSection, "Weights & Biases")


def Cfg(**flat) -> _Cfg:  # noqa: N802  # reads as the config it builds
    return build(_Cfg, **flat)


@pytest.fixture
def offline(tmp_path, monkeypatch):
    for k, v in offline_env(tmp_path / "wandb_home").items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("WANDB_DIR", raising=False)
    yield tmp_path
    import wandb

    wandb.teardown()  # its service process ends with the test; the next test's env is read afresh


def _writer(tmp_path, cfg: _Cfg, name: str = "metrics.jsonl") -> MetricsWriter:
    sink = wandb_sink(cfg.wandb, trainer="train_ppo", config=public_config(cfg), folder=tmp_path)
    return MetricsWriter(tmp_path / name, tmp_path / "tb", wandb=sink)


def _records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_every_key_and_step_of_the_metrics_file_is_in_the_offline_run(offline, monkeypatch):
    tmp_path = offline
    # The key on the command line, as an OpenRLHF script passes it: wandb records sys.argv.
    monkeypatch.setattr(sys, "argv", ["learner.train_ppo", "--use_wandb", KEY, "--wandb_project", "proj"])
    cfg = Cfg(use_wandb=KEY, wandb_project="proj", wandb_group="g", wandb_run_name="run-a")
    assert KEY not in repr(cfg)
    w = _writer(tmp_path, cfg)
    w.write(0, {"eval/accuracy": 0.25})
    w.write(1, {"rollout/reward": 0.5, "samples": 128, "note": "text too"})
    w.write(1, {"eval/accuracy": 0.5})  # a second record at one step: its own history row, same x
    w.write(2, {"loss": 1.5}, "train")
    w.write_samples(2, [{"prompt": "1+1=", "response": "2", "reward": 1.0}])
    w.close()
    (run_file,) = offline_runs(tmp_path)
    recs = records(run_file)
    rows = history(recs)
    written = _records(tmp_path / "metrics.jsonl")
    assert missing_from_history(written, rows) == []
    assert [r["step"] for r in rows if "generated_samples._type" in r] == [2]  # the samples table, on step 2
    info = run_info(recs)
    assert info["project"] == "proj" and info["display_name"] == "run-a"
    config = info["config"]["update"]
    assert config["lr"] == 1e-3 and "<redacted>" in json.dumps(config["wandb"])
    # The x axis of every chart is the record's step.
    metric = [r["metric"] for r in recs if r.get("type") == "metric"]
    assert {"glob_name": "*", "options": {"defined": True, "step_sync": True}, "step_metric": "step"} in metric
    # The key is nowhere wandb wrote (the run, its metadata, its logs).
    leaked = [p for p in (tmp_path / "wandb").rglob("*") if p.is_file() and KEY.encode() in p.read_bytes()]
    assert leaked == []


def test_a_resumed_writer_continues_the_same_run(offline):
    tmp_path = offline
    cfg = Cfg(use_wandb="True")
    first = _writer(tmp_path, cfg)
    for step in (1, 2, 3):
        first.write(step, {"loss": float(step)})
    state = json.loads(json.dumps(first.state_dict()))  # through a checkpoint's state.json
    first.close()
    assert state["wandb"]["wandb_run_id"]
    state["step"], state["bytes"] = 2, len("".join(first.path.read_text().splitlines(keepends=True)[:2]))
    resumed = _writer(tmp_path, cfg)
    resumed.load_state_dict(state)  # the checkpoint at step 2: the file cut back, wandb's run continued
    resumed.write(3, {"loss": 30.0})
    resumed.close()
    runs = offline_runs(tmp_path)
    assert len(runs) == 2  # offline, a resume is a second folder of the same run (wandb sync appends it)
    ids = [run_info(records(r))["run_id"] for r in runs]
    assert ids == [state["wandb"]["wandb_run_id"]] * 2
    assert [(r["step"], r["loss"]) for r in history(records(runs[1]))] == [(3, 30.0)]


@pytest.mark.parametrize(
    "why, env",
    [
        ("a bad key", {"WANDB_MODE": "online"}),
        ("no network", {"WANDB_MODE": "online", "WANDB_BASE_URL": "http://127.0.0.1:9", "WANDB_INIT_TIMEOUT": "3"}),
    ],
)
def test_a_failed_start_warns_once_and_the_other_sinks_go_on(offline, monkeypatch, caplog, why, env):
    tmp_path = offline
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    key = "short-key" if why == "a bad key" else KEY
    w = _writer(tmp_path, Cfg(use_wandb=key))
    with caplog.at_level(logging.WARNING, logger="rayless.metrics"):
        for step in (1, 2, 3):
            w.write(step, {"loss": float(step)})
        w.write_samples(3, [{"prompt": "p", "response": "r", "reward": 0.0}])
    w.close()
    warnings = [r.getMessage() for r in caplog.records if r.name == "rayless.metrics"]
    assert len(warnings) == 1 and "could not start" in warnings[0], warnings
    assert key not in caplog.text
    assert [r["loss"] for r in _records(tmp_path / "metrics.jsonl")] == [1.0, 2.0, 3.0]
    assert _records(tmp_path / "samples.jsonl")[0]["prompt"] == "p"
    assert list((tmp_path / "tb").iterdir())  # TensorBoard kept its events
