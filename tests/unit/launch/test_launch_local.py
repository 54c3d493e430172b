"""launch.local's supervisor: a dying role stops the run, named, and nobody is left behind."""

import sys
import time

import pytest

from common.config import ConfigError
from launch.local import TORCHRUN_LOOPBACK_ENV, LocalConfig, Role, Supervisor, build_roles, error_line, loopback_env

DATA = "--prompt_data p"  # the one flag the learner requires beside --pretrain


def _role(name, code, tmp_path):
    return Role(name, [sys.executable, "-c", code], tmp_path / "logs" / f"{name}.log", kind=name.split("-")[0])


def _supervise(roles, cfg) -> int:
    """Starts the roles, watches them to the end, always stops them; the run's exit code."""
    sup = Supervisor(roles, cfg)
    sup.start()
    try:
        return sup.watch()
    finally:
        sup.stop()


def test_last_service_death_stops_everything_and_names_it(tmp_path, capsys):
    cfg = LocalConfig(run_dir=str(tmp_path), pretrain="x", stop_timeout_s=5, quiet=True)
    roles = [
        # ignores SIGTERM: must be killed after the deadline
        _role(
            "reward-0", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)", tmp_path
        ),
        _role("learner", "import time; time.sleep(120)", tmp_path),
    ]
    roles.insert(
        0, _role("rollout-1", "import sys, time; print('boom: CUDA error'); time.sleep(0.5); sys.exit(3)", tmp_path)
    )
    t0 = time.monotonic()
    assert _supervise(roles, cfg) == 1
    assert time.monotonic() - t0 < 30
    err = capsys.readouterr().err
    assert "rollout-1 died (exit code 3)" in err and "rollout-1.log" in err and "boom: CUDA error" in err
    assert "no rollout process is left" in err
    for r in roles:
        assert r.proc.poll() is not None, f"{r.name} still running"


def test_one_of_two_rollout_servers_dying_is_survived(tmp_path, capsys):
    cfg = LocalConfig(run_dir=str(tmp_path), pretrain="x", stop_timeout_s=5, quiet=True)
    roles = [
        _role("rollout-0", "import sys, time; time.sleep(0.3); sys.exit(9)", tmp_path),
        _role("rollout-1", "import time; time.sleep(120)", tmp_path),
        _role("learner", "import time; time.sleep(3)", tmp_path),
    ]
    assert _supervise(roles, cfg) == 0  # the learner's code: the run went on
    err = capsys.readouterr().err
    assert "rollout-0 died (exit code 9)" in err and "1 other rollout process(es) carry on" in err


def test_learner_exit_code_is_the_runs(tmp_path):
    cfg = LocalConfig(run_dir=str(tmp_path), pretrain="x", stop_timeout_s=5, quiet=True)
    roles = [
        _role("rollout-0", "import time; time.sleep(120)", tmp_path),
        _role("learner", "import time; time.sleep(0.5)", tmp_path),
    ]
    assert _supervise(roles, cfg) == 0
    assert roles[0].proc.poll() is not None


def test_build_roles_wires_every_process_to_one_controller(tmp_path):
    cfg = LocalConfig(
        run_dir=str(tmp_path),
        pretrain="/m",
        rollout_servers=2,
        reward_services=1,
        learner_nproc=2,
        port=5999,
        reward_args="--reward_func f.py",
        learner_args=f"{DATA} --max_steps 3",
    )
    roles = {r.name: r for r in build_roles(cfg)}
    assert set(roles) == {"rollout-0", "rollout-1", "reward-0", "learner"}
    assert "tcp://127.0.0.1:5999" in roles["rollout-1"].cmd and "--reward_func" in roles["reward-0"].cmd
    learner = roles["learner"].cmd
    assert "torch.distributed.run" in learner and "--nproc_per_node=2" in learner
    assert learner[learner.index("--min_rollout_servers") + 1] == "2" and learner[-2:] == ["--max_steps", "3"]
    # KL is on by default (init_kl_coef 0.01): the reward services serve the reference model.
    ref = roles["reward-0"].cmd
    assert ref[ref.index("--ref_pretrain") + 1] == "/m"


def test_external_services_start_only_a_learner_that_waits_for_them_and_keeps_them(tmp_path, capsys):
    """--external_services: the services run already (the test suite's shared fleet, a fleet
    started by hand): only the learner starts, waits for as many as --rollout_servers and
    --reward_services say, and leaves them running (--keep_services); flags meant for services
    launch.local does not start are named, not silently dropped."""
    cfg = LocalConfig(
        run_dir=str(tmp_path),
        pretrain="/m",
        rollout_servers=2,
        port=5999,
        external_services=True,
        rollout_args="--max_model_len 128",
        learner_args=f"{DATA} --max_steps 3",
    )
    (learner,) = build_roles(cfg)
    cmd = learner.cmd
    assert learner.name == "learner" and "tcp://127.0.0.1:5999" in cmd and "--keep_services" in cmd
    assert cmd[cmd.index("--min_rollout_servers") + 1] == "2" and cmd[cmd.index("--min_reward_services") + 1] == "1"
    err = capsys.readouterr().err
    assert "do not reach them" in err and "--max_model_len 128" in err and "--ref_pretrain /m" in err
    with pytest.raises(ValueError, match="--external_services needs --port"):
        LocalConfig(run_dir=str(tmp_path), pretrain="/m", external_services=True)


def test_the_learners_own_output_flags_win_over_the_launchers_in_either_spelling(tmp_path):
    """OpenRLHF's scripts name their own output folder and TensorBoard folder: the launcher leaves
    its defaults out then (the learner refuses one flag given twice with two values)."""
    from common.config import parse
    from learner.rl.config import PPOConfig

    args = f"{DATA} --ckpt.output_dir /out --use_tensorboard /tb --logger.metrics_file /m.jsonl"
    (learner,) = [
        r
        for r in build_roles(LocalConfig(run_dir=str(tmp_path), pretrain="/m", learner_args=args))
        if r.kind == "learner"
    ]
    cmd = learner.cmd
    assert "--save_path" not in cmd and cmd.count("--use_tensorboard") == 1 and "--metrics_file" not in cmd
    cfg = parse(PPOConfig, cmd[cmd.index("learner.train_ppo") + 1 :])
    assert (cfg.ckpt.output_dir, cfg.logger.tensorboard_dir, cfg.logger.metrics_file) == ("/out", "/tb", "/m.jsonl")
    (plain,) = [
        r
        for r in build_roles(LocalConfig(run_dir=str(tmp_path), pretrain="/m", learner_args=DATA))
        if r.kind == "learner"
    ]
    assert plain.cmd[plain.cmd.index("--save_path") + 1] == str(tmp_path / "model")


def test_several_learner_ranks_rendezvous_without_torchruns_tcp_stores(tmp_path):
    """torchrun's --standalone stores listen on every interface: the ranks rendezvous through a
    file instead and rank 0 hosts their store on 127.0.0.1 (docs/security.md; the listening
    sockets of real runs are checked in tests/e2e/test_e2e_grpo.py)."""
    two = {
        r.name: r
        for r in build_roles(LocalConfig(run_dir=str(tmp_path), pretrain="/m", learner_args=DATA, learner_nproc=2))
    }
    cmd = two["learner"].cmd
    assert "--standalone" not in cmd and "--rdzv_endpoint" not in " ".join(cmd)
    for flag in ("--nnodes=1", "--rdzv_backend=c10d", "--rdzv_conf=store_type=file", "--local_addr=127.0.0.1"):
        assert flag in cmd[: cmd.index("learner.train_ppo")], flag
    assert two["learner"].env == TORCHRUN_LOOPBACK_ENV == {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    one = {r.name: r for r in build_roles(LocalConfig(run_dir=str(tmp_path), pretrain="/m", learner_args=DATA))}
    assert one["learner"].cmd[1:3] == ["-m", "learner.train_ppo"] and one["learner"].env == {}


def test_every_role_talks_gloo_over_loopback_unless_the_user_says_otherwise(tmp_path, monkeypatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    cfg = LocalConfig(run_dir=str(tmp_path), pretrain="x", stop_timeout_s=5, quiet=True)
    show = "import os, time; print('GLOO', os.environ['GLOO_SOCKET_IFNAME'], flush=True); time.sleep({})"
    roles = [_role("rollout-0", show.format(60), tmp_path), _role("learner", show.format(1), tmp_path)]
    assert _supervise(roles, cfg) == 0
    assert all("GLOO lo" in r.log.read_text() for r in roles), [r.log.read_text() for r in roles]
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "ib0")
    assert loopback_env() == {"GLOO_SOCKET_IFNAME": "ib0"}


def test_auth_gives_every_role_the_run_key_folder(tmp_path):
    roles = build_roles(LocalConfig(run_dir=str(tmp_path), pretrain="/m", learner_args=DATA, auth=True))
    for role in roles:
        assert role.cmd[role.cmd.index("--auth_dir") + 1] == str(tmp_path / "auth"), role.name
    assert not any(
        "--auth_dir" in r.cmd for r in build_roles(LocalConfig(run_dir=str(tmp_path), pretrain="/m", learner_args=DATA))
    )


def test_learner_reward_flags_reach_the_reward_services(tmp_path):
    cfg = LocalConfig(
        run_dir=str(tmp_path),
        pretrain="/m",
        learner_args=f"{DATA} --reward_pretrain /rm --normalize_reward --init_kl_coef 0 --temperature 0.7",
    )
    cmd = {r.name: r for r in build_roles(cfg)}["reward-0"].cmd
    assert cmd[cmd.index("--reward_pretrain") + 1] == "/rm" and "--normalize_reward" in cmd
    assert "--ref_pretrain" not in cmd and "--temperature" not in cmd
    # --ds.value_head_prefix names the RM's head to the reward service too; its default (score)
    # leaves the service its own (auto: the RM config's name, score, value_head).
    assert "--value_head_prefix" not in cmd
    cmd = _reward_cmd(tmp_path, f"{DATA} --reward_pretrain /rm --ds.value_head_prefix value_head")
    assert cmd[cmd.index("--value_head_prefix") + 1] == "value_head"
    assert "--value_head_prefix" not in _reward_cmd(tmp_path, f"{DATA} --value_head_prefix value_head")  # no RM


def test_a_teacher_reaches_the_reward_services_with_the_policys_tokenizer(tmp_path):
    """On-policy distillation (docs/distillation.md): the services serve the teacher beside the
    reference, at the sampling temperature, and check its tokenizer against the policy's."""
    cmd = _reward_cmd(tmp_path, f"{DATA} --teacher_pretrain /t --temperature 0.7 --advantage_estimator rloo "
                      "--n_samples_per_prompt 2 --init_kl_coef 0")  # fmt: skip
    assert cmd[cmd.index("--teacher_pretrain") + 1] == "/t" and cmd[cmd.index("--tokenizer") + 1] == "/m"
    assert cmd[cmd.index("--temperature") + 1] == "0.7" and "--ref_pretrain" not in cmd
    both = _reward_cmd(tmp_path, f"{DATA} --teacher.model_name_or_path /t")  # KL on by default: a reference too
    assert both[both.index("--ref_pretrain") + 1] == "/m" and both[both.index("--teacher_pretrain") + 1] == "/t"
    assert both.count("--temperature") == 1 and "--teacher_topk" not in both
    topk = _reward_cmd(tmp_path, f"{DATA} --teacher_pretrain /t --distill_topk 16")
    assert topk[topk.index("--teacher_topk") + 1] == "16"


def _reward_cmd(tmp_path, learner_args: str) -> list[str]:
    cfg = LocalConfig(run_dir=str(tmp_path), pretrain="/m", learner_args=learner_args)
    return {r.name: r for r in build_roles(cfg)}["reward-0"].cmd


def test_the_services_flags_come_from_the_learners_parsed_flags(tmp_path):
    """What the learner will read, however it was written: the defaults (KL on at 0.01: a
    reference model, the policy's), --flag=value, --no-flag, and a --config file."""
    cmd = _reward_cmd(tmp_path, DATA)
    assert cmd[cmd.index("--ref_pretrain") + 1] == "/m" and cmd[cmd.index("--temperature") + 1] == "1.0"
    cmd = _reward_cmd(tmp_path, f"{DATA} --init_kl_coef=0 --reward_pretrain=/rm --normalize_reward")
    assert "--ref_pretrain" not in cmd and cmd[cmd.index("--reward_pretrain") + 1] == "/rm"
    assert "--normalize_reward" in cmd
    cmd = _reward_cmd(tmp_path, f"{DATA} --reward_pretrain /rm --normalize_reward --no-normalize_reward")
    assert "--normalize_reward" not in cmd
    config = tmp_path / "learner.yaml"
    config.write_text("prompt_data: p\ninit_kl_coef: 0.05\nref_pretrain: /ref\ntemperature: 0.7\n")
    cmd = _reward_cmd(tmp_path, f"--config {config}")
    assert cmd[cmd.index("--ref_pretrain") + 1] == "/ref" and cmd[cmd.index("--temperature") + 1] == "0.7"


def test_a_learner_flag_the_learner_would_refuse_fails_before_anything_starts(tmp_path):
    with pytest.raises(ConfigError, match="--prompt_data"):
        build_roles(LocalConfig(run_dir=str(tmp_path), pretrain="/m"))
    with pytest.raises(ConfigError, match="--n_samples_per_prompt must be >= 1"):
        build_roles(LocalConfig(run_dir=str(tmp_path), pretrain="/m", learner_args=f"{DATA} --n_samples_per_prompt 0"))
    with pytest.raises(ConfigError, match="unrecognized arguments: --no_such_flag"):
        build_roles(LocalConfig(run_dir=str(tmp_path), pretrain="/m", learner_args=f"{DATA} --no_such_flag"))


def test_learner_threads_apply_to_the_learner_only(tmp_path):
    cfg = LocalConfig(run_dir=str(tmp_path), pretrain="x", stop_timeout_s=5, quiet=True, learner_threads=2)
    show = "import os, time; print('OMP', os.environ['OMP_NUM_THREADS'], flush=True); time.sleep({})"
    roles = [_role("rollout-0", show.format(60), tmp_path), _role("learner", show.format(1), tmp_path)]
    assert _supervise(roles, cfg) == 0
    logs = {r.name: r.log.read_text() for r in roles}
    assert "OMP 2" in logs["learner"] and "OMP 1" in logs["rollout-0"], logs


def test_thread_counts_are_checked():
    import pytest

    with pytest.raises(ValueError, match="--learner_threads"):
        LocalConfig(pretrain="x", learner_threads=-1)
    with pytest.raises(ValueError, match="--threads_per_process"):
        LocalConfig(pretrain="x", threads_per_process=0)


def test_a_failed_learner_is_restarted_with_load_checkpoint_while_services_stay_up(tmp_path, capsys):
    """--restart_learner 2: the learner fails twice (killed -9, then exit 1), is started again
    with --load_checkpoint each time, and the third run's exit code is the run's; the service
    kept its process throughout."""
    cfg = LocalConfig(run_dir=str(tmp_path), pretrain="x", stop_timeout_s=5, quiet=True, restart_learner=2)
    count = tmp_path / "starts"
    learner = (
        "import os, sys, signal; p = sys.argv[1]; n = int(open(p).read()) + 1 if os.path.exists(p) else 1; "
        "open(p, 'w').write(str(n)); print('args', sys.argv[2:], flush=True); "
        "os.kill(os.getpid(), signal.SIGKILL) if n == 1 else sys.exit(1 if n == 2 else 0)"
    )
    roles = [
        _role("rollout-0", "import time; time.sleep(120)", tmp_path),
        Role("learner", [sys.executable, "-c", learner, str(count)], tmp_path / "logs" / "learner.log", kind="learner"),
    ]
    sup = Supervisor(roles, cfg)
    sup.start()
    service_pid = roles[0].proc.pid
    try:
        assert sup.watch() == 0
        assert roles[0].proc.pid == service_pid and roles[0].proc.poll() is None  # never restarted
    finally:
        sup.stop()
    assert count.read_text() == "3" and sup.restarts == 2
    log = (tmp_path / "logs" / "learner.log").read_text()  # appended across restarts
    assert log.count("args []") == 1 and log.count("args ['--load_checkpoint']") == 2
    err = capsys.readouterr().err
    assert "exited with code -9; restarting it from its newest checkpoint (restart 1 of 2)" in err
    assert "restart 2 of 2" in err


def test_a_learner_failing_past_its_restarts_ends_the_run(tmp_path):
    cfg = LocalConfig(run_dir=str(tmp_path), pretrain="x", stop_timeout_s=5, quiet=True, restart_learner=1)
    roles = [
        _role("rollout-0", "import time; time.sleep(120)", tmp_path),
        _role("learner", "import sys; sys.exit(3)", tmp_path),
    ]
    assert _supervise(roles, cfg) == 3


def test_a_service_stopped_by_a_signal_is_gone_not_finished(tmp_path, capsys):
    """Exit codes are the services' one rule (common/service.py): 0 only when the controller
    ended it. A reward service stopped from outside the run exits 143 after its last words; the
    launcher counts it as gone, says how it ended, and, the last of its kind, stops the run."""
    cfg = LocalConfig(run_dir=str(tmp_path), pretrain="x", stop_timeout_s=5, quiet=True)
    roles = [
        _role("reward-0", "import sys, time; time.sleep(0.3); sys.exit(143)", tmp_path),
        _role("learner", "import time; time.sleep(120)", tmp_path),
    ]
    assert _supervise(roles, cfg) == 1
    err = capsys.readouterr().err
    assert "reward-0 died (exit code 143): stopped by SIGTERM" in err and "no reward process is left" in err


def test_a_wandb_key_in_the_learner_flags_stays_out_of_the_logs_and_the_saved_config(tmp_path):
    """The learner's log starts with its command line and the run folder keeps the launcher's
    config: a key passed as --use_wandb KEY is <redacted> in both; on/off values are kept."""
    from launch.local import public_config
    from learner.runtime.tracking import redact_argv

    key = "0123456789abcdef0123456789abcdef01234567"
    assert redact_argv(["--use_wandb", key, "--x", key]) == ["--use_wandb", "<redacted>", "--x", key]
    assert redact_argv([f"--use_wandb={key}", "--use_wandb", "True"]) == [
        "--use_wandb=<redacted>",
        "--use_wandb",
        "True",
    ]
    cfg = LocalConfig(run_dir=str(tmp_path), pretrain="x", learner_args=f"--prompt_data p --use_wandb {key}")
    assert key not in str(public_config(cfg)) and "--use_wandb '<redacted>'" in public_config(cfg)["learner_args"]
    learner = [r for r in build_roles(cfg) if r.kind == "learner"][0]
    learner.cmd = [sys.executable, "-c", "pass", *learner.cmd[3:]]  # the learner's flags, not its run
    assert _supervise([learner], cfg) == 0
    log = learner.log.read_text()
    assert log.startswith("$ ") and "--use_wandb '<redacted>'" in log and key not in log


def test_an_agent_run_gives_every_rollout_server_the_agent_file_and_starts_no_idle_reward_service(tmp_path, capsys):
    """--agent_func_path reaches every rollout server (the episodes run there); without KL the
    agent's rewards are the reward and a reward service would have nothing to do: none starts
    and the learner waits for none. With KL the reference still needs one."""
    env = tmp_path / "env.py"
    env.write_text("class AgentExecutor: ...\n")
    agent = f"{DATA} --agent_func_path {env} --max_len 64"
    roles = build_roles(
        LocalConfig(run_dir=str(tmp_path), pretrain="/m", rollout_servers=2, learner_args=f"{agent} --init_kl_coef 0")
    )
    assert [r.name for r in roles] == ["rollout-0", "rollout-1", "learner"]
    for r in roles[:2]:
        assert r.cmd[r.cmd.index("--agent_func_path") + 1] == str(env)
    assert roles[-1].cmd[roles[-1].cmd.index("--min_reward_services") + 1] == "0"
    assert "the agent scores its episodes, no reward service started" in capsys.readouterr().out
    roles = build_roles(LocalConfig(run_dir=str(tmp_path), pretrain="/m", learner_args=f"{agent} --init_kl_coef 0.01"))
    (reward,) = [r for r in roles if r.kind == "reward"]
    assert "--ref_pretrain" in reward.cmd and "--reward_func" not in reward.cmd


# What a learner's log ends with when it fails: the error, then the interpreter's exit noise.
NANOBIND_EXIT = [
    "nanobind: leaked 3 instances!",
    ' - leaked instance 0x7f3a2c0b4e50 of type "triton._C.libtriton.ir.context"',
    "nanobind: leaked 41 types!",
    ' - leaked type "triton._C.libtriton.ir.builder"',
    "nanobind: leaked 250 functions!",
    ' - leaked function "get_int1"',
    "nanobind: this is likely caused by a reference counting issue in the binding code.",
    "/usr/lib/python3.11/multiprocessing/resource_tracker.py:254: UserWarning: resource_tracker: "
    "There appear to be 1 leaked semaphore objects to clean up at shutdown",
    "  warnings.warn('resource_tracker: There appear to be %d '",
]
LEDGER = "prompt 3 was handed out 5 times and answered with an error each time (the last: r0 answered agent_failed: x)"


def _traceback(exc: str, prefix: str = "") -> list[str]:
    lines = [
        "Traceback (most recent call last):",
        '  File "/repo/learner/rl/run.py", line 200, in run',
        "    schedule.step(step)",
        '  File "/repo/learner/controller/ledger.py", line 96, in start_generation',
        "    raise LedgerError(",
        exc,
    ]
    return [prefix + ln for ln in lines]


@pytest.mark.parametrize(
    "log, want",
    [
        # one process: its traceback, then a page of exit noise
        (["2026-12-03 INFO learner: step 4/10", *_traceback(f"learner.controller.ledger.LedgerError: {LEDGER}"),
          *NANOBIND_EXIT * 20], f"LedgerError: {LEDGER}"),
        # two ranks under torchrun: rank 1 stops because rank 0 failed, then torchrun's summary
        ([*_traceback(f"learner.controller.ledger.LedgerError: {LEDGER}", "[rank0]: "),
          *_traceback("learner.rl.schedules.base.StoppedByRank0: step 4: rank 0 (the controller) failed", "[rank1]: "),
          *_traceback("torch.distributed.elastic.multiprocessing.errors.ChildFailedError: "),
          "============================================================", "learner.train_ppo FAILED",
          *NANOBIND_EXIT], f"LedgerError: {LEDGER}"),
        # a RunError: the learner's own line, no traceback
        (["learner: --prompt_data data.jsonl: no such file", *NANOBIND_EXIT],
         "learner: --prompt_data data.jsonl: no such file"),
        # chained: the one raised last, as Python prints it last
        ([*_traceback("KeyError: 'step'"), "", "During handling of the above exception, another exception occurred:",
          "", *_traceback("RuntimeError: the checkpoint has no step")], "RuntimeError: the checkpoint has no step"),
        (["2026-12-03 INFO learner: step 10/10", *NANOBIND_EXIT], None),  # nothing raised
    ],
)  # fmt: skip
def test_the_error_line_is_the_last_exception_of_rank_0_not_exit_noise(log, want):
    assert error_line(log) == want


def test_a_failed_learner_shows_its_error_first_and_no_exit_noise(tmp_path, capsys):
    """The learner raises, then its interpreter prints a page of nanobind's "leaked" lines at
    exit, as triton's bindings do: launch.local says the error in one line before the log's
    tail, and the tail is the error's own lines, not the noise."""
    noise = "\n".join(NANOBIND_EXIT * 20)
    code = (
        "import atexit, sys\n"
        f"atexit.register(lambda: print({noise!r}, file=sys.stderr))\n"
        "class LedgerError(RuntimeError): pass\n"
        "print('step 4/10', flush=True)\n"
        f"raise LedgerError({LEDGER!r})\n"
    )
    cfg = LocalConfig(run_dir=str(tmp_path), pretrain="x", stop_timeout_s=5, quiet=True)
    roles = [_role("rollout-0", "import time; time.sleep(120)", tmp_path), _role("learner", code, tmp_path)]
    assert _supervise(roles, cfg) == 1
    err = capsys.readouterr().err
    assert "nanobind" in roles[1].log.read_text()  # the noise is in the log, where it belongs
    lines = err.strip().splitlines()
    assert lines[:3] == [
        "the learner exited with code 1",
        f"error: LedgerError: {LEDGER}",
        f"see its log: {roles[1].log}; its last lines (exit noise left out):",
    ], err
    assert "nanobind" not in err and "resource_tracker" not in err and lines[-1].strip() == f"LedgerError: {LEDGER}"
