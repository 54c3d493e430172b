"""launch.local --cpu_cores: lockstep's phases get every core; async and 'split' keep the thread counts."""

import os

import launch.local as L


def _cfg(**kw):
    return L.LocalConfig(pretrain="x", **{"learner_args": "--prompt_data p", **kw})


def test_phases_give_each_role_every_core(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    cpus = sorted(os.sched_getaffinity(0))
    env = L.phase_env(_cfg(cpu_cores="phases"))
    assert env["learner"] == {"OMP_NUM_THREADS": str(len(cpus))}
    assert env["service"] == {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cpus)), L.IDLE_SPIN_ENV: "0.05"}
    # an explicit --learner_threads stands
    assert L.phase_env(_cfg(cpu_cores="phases", learner_threads=1))["learner"]["OMP_NUM_THREADS"] == "1"


def test_the_users_binding_wins(monkeypatch):
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0")
    monkeypatch.setenv(L.IDLE_SPIN_ENV, "1")
    assert L.phase_env(_cfg(cpu_cores="phases"))["service"] == {"VLLM_CPU_OMP_THREADS_BIND": "0", L.IDLE_SPIN_ENV: "1"}


def test_auto_is_phases_for_lockstep_on_cpu_vllm_only(monkeypatch):
    monkeypatch.setattr(L, "_cpu_vllm", lambda: True)
    assert L.phase_env(_cfg()) == {}  # the default is split
    assert L.phase_env(_cfg(cpu_cores="auto"))["service"]
    assert L.phase_env(_cfg(cpu_cores="auto", learner_args="--prompt_data p --async_train --max_staleness 1")) == {}
    assert L.phase_env(_cfg(cpu_cores="split")) == {}
    monkeypatch.setattr(L, "_cpu_vllm", lambda: False)  # a GPU build: each role has its own devices
    assert L.phase_env(_cfg(cpu_cores="auto")) == {}


def test_phases_share_the_cores_among_roles_that_run_at_once(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    n = len(os.sched_getaffinity(0))
    env = L.phase_env(_cfg(cpu_cores="phases", learner_nproc=2, rollout_servers=2))
    assert env["learner"]["OMP_NUM_THREADS"] == str(max(1, n // 2))
    assert "VLLM_CPU_OMP_THREADS_BIND" not in env["service"]
