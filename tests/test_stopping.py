"""Stop requests (dpllm.stopping): SIGTERM from a job scheduler, a lost Ctrl-C, time-based checkpoints."""

import json
import os
import shlex
import signal
import subprocess
import sys
import time

import pytest

from dpllm import ledger
from tests.helpers import forked_recipe, load_recipe, signal_when

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The default accountant (PRV) calibrates these plans in ~0.1 CPU-s, Opacus's RDP in 2-3 s (in each process).
FAST = ["--logical_batch_size", "16", "--physical_batch_size", "16", "--max_length", "32", "--tiny_hidden_size",
        "32", "--tiny_num_heads", "2", "--eval_every", "0", "--eval_max_records", "8", "--progress", "false",
        "--max_records", "120"]
recipe = load_recipe("finetune_llm")


def _default_signals():
    """The child handles SIGINT and SIGTERM at their defaults, whatever this test process inherited."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def test_sigterm_checkpoints_at_the_step_boundary_and_the_printed_command_resumes(tmp_path):
    """A scheduler's SIGTERM, with no save_every: the step finishes, a resumable checkpoint is written there, one
    line names it and the resume command, exit 143; the printed command finishes the run with the planned ε.
    The process runs `python recipes/finetune_llm.py ARGV`'s code, forked from the fork server (tests.helpers):
    what the signal meets is a real process of its own, without a second import of torch and the rest."""
    out, stderr = tmp_path / "run", tmp_path / "stderr.log"
    # 50 steps: the signal goes out within ~10 ms of step 1's line, ~49 steps (≥ 3 CPU-s of the child's) before the
    # run could end; the printed command then trains the rest in this process, so each step more costs here
    steps = 50
    argv = [*FAST, "--max_steps", str(steps), "--log_every", "1", "--output_dir", str(out)]
    proc, metrics = forked_recipe(argv, stderr), out / "metrics.jsonl"
    err = signal_when(proc, stderr, lambda: metrics.is_file() and '"split": "train"' in metrics.read_text(),
                      signal.SIGTERM, within=180, join=120, what="training never started")
    assert proc.exitcode == 143 and "Traceback" not in err, err[-3000:]
    lines = [x for x in err.splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and lines[0].startswith("error: stopped by SIGTERM at step "), err[-3000:]
    step = int(lines[0].split("at step ", 1)[1].split(" ", 1)[0])
    assert 0 < step < steps
    ckpt = out / "checkpoints" / f"step-{step:06d}"
    assert f"the last resumable checkpoint is {ckpt} (step {step}); resume with: " in lines[0]
    assert json.loads((ckpt / "trainer_state.json").read_text())["step"] == step
    command = shlex.split(lines[0].split("resume with: ", 1)[1])
    assert command[-2:] == ["--resume_from", "latest"] and command[2:-2] == argv
    short = [*command[2:-2], "--resume_from", "latest"]
    assert recipe.cli(short) == 0
    report = json.loads((out / "privacy_report.json").read_text())
    assert report["steps"] == steps and sum(h[2] for h in report["history"]) == steps
    assert json.loads((out / "run_summary.json").read_text())["resumed_from_step"] == step
    assert ledger.verify(out).ok


def test_sigint_mid_run_exits_130_with_one_line(tmp_path):
    """The real signal, in a real process (forked as above): no traceback, exit 130, the checkpoint left intact. The
    process has SIGINT at Python's default whatever this one inherited (a test run from a shell without job
    control, a CI script's background job, inherits it *ignored*: a run started so rightly ignores Ctrl-C)."""
    out, stderr = tmp_path / "run", tmp_path / "stderr.log"
    proc = forked_recipe([*FAST, "--max_steps", "500", "--output_dir", str(out), "--save_every", "1"], stderr)
    err = signal_when(proc, stderr, (out / "checkpoints" / "latest").is_file, signal.SIGINT, within=120, join=60,
                      what="no checkpoint appeared")
    assert proc.exitcode == 130 and "Traceback" not in err, err[-3000:]
    line = next(x for x in err.splitlines() if x.startswith("error: interrupted at step"))
    ckpt = line.split("the last resumable checkpoint is ", 1)[1].split(" (step", 1)[0]
    assert (out / "checkpoints" / "latest").read_text().strip() == os.path.basename(ckpt)
    assert (out / "checkpoints" / os.path.basename(ckpt) / "trainer_state.json").is_file()


def test_a_lost_ctrl_c_still_stops_the_run_at_the_next_step(tmp_path, capsys, monkeypatch):
    """An interrupt that Python loses (raised where a destructor or a library swallows it) is still a request:
    the run stops at the step boundary with a resumable checkpoint."""
    import dpllm.train

    after = dpllm.train.Trainer.after_step

    def swallowed_ctrl_c(self):
        after(self)
        if self.step == 2:
            try:
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(1)  # the handler runs here, in this frame
            except KeyboardInterrupt:
                pass  # what a careless `except BaseException` in some callback would do

    monkeypatch.setattr(dpllm.train.Trainer, "after_step", swallowed_ctrl_c)
    # Ctrl-C at Python's default, whatever this worker inherited: a suite started as a background job of a shell
    # without job control (`make test &` in a CI script) inherits SIGINT *ignored*, and dpllm rightly keeps it
    # ignored (test_a_signal_started_ignored_stays_ignored), so the run would finish with 0.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    out = tmp_path / "run"
    try:
        code = recipe.cli([*FAST, "--max_steps", "5", "--output_dir", str(out)])
    finally:
        signal.signal(signal.SIGINT, previous)
    assert code == 130
    err = capsys.readouterr().err
    assert f"interrupted at step 2 of 5; the last resumable checkpoint is {out / 'checkpoints' / 'step-000002'}" in err
    assert not (out / "privacy_report.json").exists()


def test_time_based_checkpoints(tmp_path):
    """save_every_minutes writes resumable checkpoints with no save_every (here: due at every step)."""
    out = tmp_path / "run"
    assert recipe.cli([*FAST, "--max_steps", "4", "--output_dir", str(out), "--save_every_minutes", "1e-9"]) == 0
    steps = sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("step-"))
    assert steps == ["step-000002", "step-000003"]  # every step before the last; the last 2 are kept
    assert (out / "checkpoints" / "latest").read_text().strip() == "step-000003"
    assert ledger.verify(out).ok


def test_a_signal_started_ignored_stays_ignored():
    """nohup and background jobs start with SIGINT ignored: dpllm does not take that decision back."""
    from dpllm.stopping import StopRequests

    previous, term = signal.signal(signal.SIGINT, signal.SIG_IGN), signal.getsignal(signal.SIGTERM)
    try:
        with StopRequests() as stops:
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) == stops._handle
        assert signal.getsignal(signal.SIGTERM) is term
    finally:
        signal.signal(signal.SIGINT, previous)


# A stand-in for accelerate's single-process launcher (accelerate/commands/launch.py, simple_launcher): Popen, wait,
# nothing forwarded. Its command line names accelerate, as the real one's does.
_LAUNCHER = "import subprocess, sys\np = subprocess.Popen([sys.executable, '-c', sys.argv[1]])\np.wait()\n"
_WORKER = """
import os, signal, sys, time
from dpllm.stopping import StopRequests
with StopRequests() as stops:
    stops.defer_term = True  # as in the training loop: SIGTERM waits for the step boundary
    print(os.getpid(), flush=True)
    deadline = time.time() + 30
    while stops.requested is None and time.time() < deadline:
        time.sleep(0.01)
print(signal.Signals(stops.requested).name if stops.requested else "not stopped", flush=True)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_a_worker_started_alone_by_accelerate_stops_when_its_launcher_is_signalled(sig):
    """accelerate's single-process launcher forwards no signal and dies of SIGTERM (or a traceback after SIGINT):
    its worker gets a SIGTERM instead of training on as an orphan, whatever ended the launcher."""
    env = {**os.environ, "ACCELERATE_MIXED_PRECISION": "no", "PYTHONPATH": ROOT}
    env.pop("TORCHELASTIC_RUN_ID", None)
    launcher = subprocess.Popen([sys.executable, "-c", _LAUNCHER, _WORKER, "accelerate", "launch"], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                                preexec_fn=_default_signals, start_new_session=True)
    try:
        worker = int(launcher.stdout.readline())
        launcher.send_signal(sig)
        out, _ = launcher.communicate(timeout=60)  # EOF once the worker, too, has closed its end
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    assert launcher.returncode != 0 and out.strip() == "SIGTERM", (worker, out)


def test_only_a_worker_of_accelerates_single_process_launcher_follows_its_launcher(monkeypatch):
    """A shell that exports accelerate's variables is no launcher (a run from it must not stop when the shell
    ends), and torchrun's agent passes signals on itself: neither is followed."""
    import dpllm.stopping as stopping

    asked = []
    monkeypatch.setattr(stopping, "_parent_death_signal", lambda signum: asked.append(signum) or True)
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert not stopping.follow_launcher() and not asked  # this test's parent is no accelerate
    monkeypatch.setattr(stopping, "_parent_is_accelerate_launch", lambda: True)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    assert not stopping.follow_launcher() and not asked
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    assert stopping.follow_launcher() and asked == [signal.SIGTERM]


def test_sigterm_to_a_single_process_accelerate_launch_checkpoints_and_the_worker_exits_143(tmp_path):
    """The README's command, `accelerate launch recipes/finetune_llm.py ...` (one process, no torchrun agent),
    SIGTERM to the launcher only (as Kubernetes or `kill PID` sends it): the worker finishes its step, writes a
    resumable checkpoint, prints one line and exits 143, instead of training on as an orphan.

    The launch asks for two processes without --multi_gpu: accelerate then starts ONE, through the same
    single-process launcher as the README's command, and the run says so (with the --multi_gpu fix) and trains as
    one process (the checkpoint's world size); the resume command it prints keeps the launcher's options. This is
    also the suite's run of that launcher (tests/test_paths_and_launch.py reads which count was asked for; the
    2-process launches are tests/test_distributed.py's and tests/test_fsdp_bk.py's)."""
    import ctypes

    out = tmp_path / "run"
    accelerate = os.path.join(os.path.dirname(sys.executable), "accelerate")
    script = os.path.join(ROOT, "recipes", "finetune_llm.py")
    cmd = [accelerate, "launch", "--num_processes", "2", script, *FAST, "--max_steps", "200", "--log_every", "1",
           "--output_dir", str(out)]
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER: the orphaned worker's exit status comes here
    launcher = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                                preexec_fn=_default_signals, start_new_session=True)
    try:
        metrics, deadline = out / "metrics.jsonl", time.time() + 180  # a liveness guard for a loaded machine
        while not (metrics.is_file() and '"split": "train"' in metrics.read_text()):
            assert time.time() < deadline and launcher.poll() is None, "training never started"
            time.sleep(0.1)
        worker = int(open(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read().split()[0])
        launcher.send_signal(signal.SIGTERM)
        _, err = launcher.communicate(timeout=120)  # EOF once the worker has closed its end too
        _, status = os.waitpid(worker, 0)
    finally:
        libc.prctl(36, 0, 0, 0, 0)
        try:
            os.killpg(launcher.pid, signal.SIGKILL)  # the launcher's process group: an orphaned worker included
        except ProcessLookupError:
            pass
    assert launcher.returncode == -signal.SIGTERM and os.waitstatus_to_exitcode(status) == 143, err[-3000:]
    assert "accelerate launch was asked for 2 processes but started 1" in err and "--multi_gpu" in err, err[-3000:]
    lines = [x for x in err.splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and lines[0].startswith("error: stopped by SIGTERM at step "), err[-3000:]
    step = int(lines[0].split("at step ", 1)[1].split(" ", 1)[0])
    ckpt = out / "checkpoints" / f"step-{step:06d}"
    assert 0 < step < 200 and f"the last resumable checkpoint is {ckpt} (step {step})" in lines[0]
    assert f"resume with: accelerate launch --num_processes 2 {script} " in lines[0]  # read while the launcher ran
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["step"] == step and state["world_size"] == 1
    assert ledger.read(out)[-1]["checkpoint"] == f"checkpoints/step-{step:06d}"


def test_a_worker_under_accelerate_launch_as_pid_1_warns_that_sigterm_cannot_reach_it(monkeypatch, caplog):
    """In a container whose pid 1 is `accelerate launch` (one process), the kernel drops the SIGTERM that docker
    stop or Kubernetes sends it: the worker says so at start, with what to run instead."""
    import dpllm.stopping as stopping

    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setattr(stopping, "_parent_death_signal", lambda signum: True)
    monkeypatch.setattr(stopping, "_parent_is_accelerate_launch", lambda: True)
    monkeypatch.setattr(stopping.os, "getppid", lambda: 1)
    term = signal.getsignal(signal.SIGTERM)
    try:
        with stopping.StopRequests() as stops:
            assert stops.requested is None
    finally:
        signal.signal(signal.SIGTERM, term)
    assert "accelerate launch runs as pid 1 with one process: it ignores SIGTERM" in caplog.text
    assert "start one process as `python SCRIPT ...`" in caplog.text
