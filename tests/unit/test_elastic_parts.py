"""Elastic engines and engine faults, the parts that need no server (docs/elastic.md): addresses and
/server_info facts, which request errors send a group back as a continuation, health verdicts, the
registry's request lifecycle, the `vime engines` command's refusals, and a late engine catching up
to a delta version it never held."""

from __future__ import annotations

import json
import os
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from vime.config import ConfigError, parse_train_args
from vime.engines.external import engine_url, facts_from_server_info
from vime.engines.http import EngineError
from vime.rollout.generate import GenerateError
from vime.tools import engines_cli
from vime.workers.engine_registry import EngineRegistry
from vime.workers.health import HealthMonitor


def test_engine_addresses_are_normalised_or_refused():
    assert engine_url("127.0.0.1:8000") == "http://127.0.0.1:8000"
    assert engine_url("http://node-3:30001/") == "http://node-3:30001"
    assert engine_url("https://[::1]:443") == "https://[::1]:443"
    for bad in ("node-3", "node:0", "node:99999", "http://a:1/v1"):
        with pytest.raises(ValueError, match="is not host:port"):
            engine_url(bad)


def server_info(parallel=None, kv=None, ec=None, model="/models/m"):
    return {
        "vllm_config": {
            "parallel_config": parallel or {"tensor_parallel_size": 1},
            "kv_transfer_config": kv,
            "ec_transfer_config": ec,
            "model_config": {"model": model},
        }
    }


def test_server_info_gives_gpu_count_and_worker_type():
    facts = facts_from_server_info(
        "http://e:1",
        server_info(
            {
                "tensor_parallel_size": 2,
                "pipeline_parallel_size": 2,
                "data_parallel_size": 4,
                "data_parallel_size_local": 2,
                "prefill_context_parallel_size": 1,
            }
        ),
    )
    assert (facts.gpus, facts.tensor_parallel_size, facts.worker_type, facts.model) == (8, 2, "regular", "/models/m")
    assert facts_from_server_info("u", server_info(kv={"kv_role": "kv_producer"})).worker_type == "prefill"
    assert facts_from_server_info("u", server_info(kv={"kv_role": "kv_consumer"})).worker_type == "decode"
    assert facts_from_server_info("u", server_info(kv={"kv_role": "kv_both"})).worker_type == "regular"
    assert facts_from_server_info("u", server_info(ec={"ec_role": "ec_producer"})).worker_type == "encoder"
    with pytest.raises(EngineError, match="did not return a JSON vllm_config"):
        facts_from_server_info("http://e:1", {"vllm_config": "VllmConfig(text form)"})


def test_only_the_samples_own_faults_spend_its_attempts():
    """An engine that answers no request, 5xx, or a 4xx that is not about the request (403 from a server
    without --enable-scale-out, 404) is at fault: the group goes back to the queue. A request the engine
    refused for itself (400/413/422) or an answer this sample's settings cannot use is the sample's."""
    engine = [
        GenerateError("answered 500", status=500),
        GenerateError("answered 503", status=503),
        GenerateError("answered 403: Scale-out endpoints are disabled", status=403),
        GenerateError("answered 404", status=404),
        GenerateError("answered 429", status=429),
        GenerateError("timed out after 120s (--rollout-request-timeout)"),
        GenerateError("failed: Server disconnected"),
    ]
    assert all(error.engine_fault for error in engine)
    sample = [
        GenerateError("answered 400: This model's maximum context length is 64", status=400),
        GenerateError("answered 413", status=413),
        GenerateError("answered 422", status=422),
        GenerateError("score centering: the engine returned 3 top log-probs", engine_fault=False),
    ]
    assert not any(error.engine_fault for error in sample)
    import pickle  # crosses Ray actor boundaries whole

    copy = pickle.loads(pickle.dumps(GenerateError("answered 403", status=403)))
    assert (copy.status, copy.engine_fault, str(copy)) == (403, True, "answered 403")


def test_elastic_flags_parse_and_validate(tmp_path):
    from vime.tools.make_tiny_model import make_tiny_model

    model = make_tiny_model(str(tmp_path / "m"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"input": "1=", "label": "2"}\n')
    base = [
        "--hf-checkpoint",
        model,
        "--prompt-data",
        str(prompts),
        "--rm-type",
        "exact_match",
        "--run-dir",
        str(tmp_path / "run"),
    ]
    s = parse_train_args(
        base
        + [
            "--rollout-health-check-interval",
            "2",
            "--rollout-health-check-timeout",
            "3",
            "--rollout-health-check-first-wait",
            "5",
            "--rollout-engine-restart-budget",
            "0",
            "--rollout-elastic-resource",
            "",
        ]
    )
    e = s.elastic
    assert (
        e.rollout_health_check_interval,
        e.rollout_health_check_timeout,
        e.rollout_health_check_first_wait,
        e.rollout_engine_restart_budget,
        e.rollout_elastic_resource,
    ) == (2, 3, 5, 0, "")
    assert parse_train_args(base).elastic.rollout_elastic_resource == "vime_rollout"
    assert parse_train_args(base).elastic.rollout_elastic_node_engines is True
    assert parse_train_args(base + ["--no-rollout-elastic-node-engines"]).elastic.rollout_elastic_node_engines is False
    with pytest.raises(ConfigError, match="--rollout-health-check-interval: must be > 0"):
        parse_train_args(base + ["--rollout-health-check-interval", "0"])
    with pytest.raises(ConfigError, match="--rollout-engine-restart-budget: must be >= 0"):
        parse_train_args(base + ["--rollout-engine-restart-budget", "-1"])


class _Engine(BaseHTTPRequestHandler):
    """Stands in for a vLLM server in this unit test (no vLLM in the unit tier): /health, and the
    generate route answering as vLLM 0.32 does, or with 403 when the server says it is a black hole."""

    def do_GET(self):
        self._answer(200 if self.path == "/health" else 404, b"")

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if self.path != "/inference/v1/generate":
            self._answer(404, b"")
        elif self.server.black_hole:
            self._answer(403, b'{"error": {"message": "Scale-out endpoints are disabled."}}')
        else:
            self._answer(
                200,
                json.dumps(
                    {
                        "choices": [
                            {
                                "token_ids": [5],
                                "finish_reason": "length",
                                "logprobs": {"content": [{"token_id": 5, "logprob": -1.5}]},
                                "weight_versions": [{"version": self.server.label, "start": 0, "end": 1}],
                            }
                        ]
                    }
                ).encode(),
            )

    def _answer(self, status, body):
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def _engine_server(black_hole=False, label="default"):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Engine)
    server.black_hole, server.label = black_hole, label
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def test_health_monitor_declares_an_engine_dead_after_consecutive_failures():
    server, alive = _engine_server()
    hole, black_hole = _engine_server(black_hole=True)  # /health 200, generate 403: a black hole
    with socket.socket() as s:  # a port nobody listens on: connection refused
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    verdicts = []
    monitor = HealthMonitor(interval=0.01, timeout=1, failures=2, on_dead=lambda url, why: verdicts.append(url))
    try:
        monitor.watch(alive)
        monitor.watch(dead)
        monitor.watch(black_hole)
        monitor.watch("http://127.0.0.1:1", first_wait=3600)  # not checked during its first wait
        monitor.check_once()
        assert monitor.take_dead() == [] and monitor.status()[dead]["failures"] == 1
        assert (
            "answered 403; the server refuses the token-in/token-out route; start it with --enable-scale-out"
            in monitor.status()[black_hole]["last_error"]
        )
        import time

        time.sleep(0.02)
        with monitor.updating():  # a check during a weight update counts neither way
            monitor.check_once()
        assert monitor.take_dead() == [] and monitor.status()[dead]["failures"] == 1
        time.sleep(0.02)
        monitor.check_once()
        declared = dict(monitor.take_dead())
        assert sorted(declared) == sorted([dead, black_hole]) and "2 consecutive failed check(s)" in declared[dead]
        assert sorted(verdicts) == sorted([dead, black_hole])
        status = monitor.status()
        assert status[alive]["healthy"] is True and status[alive]["checks"] == 3
        assert status["http://127.0.0.1:1"]["checks"] == 0
        monitor.check_once()
        assert monitor.take_dead() == []  # declared once
    finally:
        monitor.stop()
        for s in (server, hole):
            s.shutdown()
            s.server_close()


def test_generation_probe_checks_tokens_log_probs_and_the_version():
    from vime.engines.probe import ProbeFailed, check_choice, probe_generation

    server, url = _engine_server(label="4")
    hole, black_hole = _engine_server(black_hole=True)
    try:
        assert probe_generation(url, timeout=5, expect_version=4)["token_ids"] == [5]
        with pytest.raises(ProbeFailed, match="generated with weight version '4', expected 3"):
            probe_generation(url, timeout=5, expect_version=3)
        with pytest.raises(ProbeFailed, match="answered 403; .*start it with --enable-scale-out"):
            probe_generation(black_hole, timeout=5)
    finally:
        for s in (server, hole):
            s.shutdown()
            s.server_close()
    good = {
        "token_ids": [5],
        "logprobs": {"content": [{"logprob": -0.1}]},
        "weight_versions": [{"version": "default", "start": 0, "end": 1}],
    }
    assert check_choice("u", good, 0) is good  # vLLM's first label, "default", is version 0
    assert check_choice("u", {"finish_reason": "abort", "token_ids": []}, 3)  # aborted by a weight update
    for broken, why in (
        ({**good, "token_ids": []}, "no generated token ids"),
        ({**good, "logprobs": None}, "0 log-prob"),
        ({**good, "weight_versions": None}, "no weight_versions"),
    ):
        with pytest.raises(ProbeFailed, match=why):
            check_choice("u", broken, None)


def test_registry_requests_go_pending_running_done():
    registry = EngineRegistry()
    first = registry.submit("add", "127.0.0.1:8000")
    second = registry.submit("remove", "engine-0")
    assert [r["id"] for r in registry.take()] == [first, second]
    assert registry.take() == []  # taken once
    assert registry.request(first)["state"] == "running"
    registry.finish(first, True, "engine-1 serves weight version 4")
    registry.finish(second, False, "engine-0 is the only serving engine")
    assert registry.request(first)["state"] == "done" and registry.request(second)["state"] == "failed"
    assert registry.request("nope") is None
    with pytest.raises(ValueError, match="unknown engine operation"):
        registry.submit("restart", "engine-0")
    registry.publish({"weight_version": 4, "engines": []})
    assert registry.engines()["weight_version"] == 4 and registry.engines()["updated"] is not None


def test_engines_command_refuses_runs_it_cannot_reach(tmp_path, capsys):
    run = tmp_path / "run"
    assert engines_cli.main(["list", "--run", str(run)]) == 1
    assert "run.json does not exist" in capsys.readouterr().err
    run.mkdir()
    (run / "run.json").write_text(json.dumps({"run_token": "t", "pid": os.getpid()}))
    assert engines_cli.main(["add", "--run", str(run), "127.0.0.1:8000"]) == 1
    assert "has not started Ray yet" in capsys.readouterr().err
    (run / "run.json").write_text(
        json.dumps({"pid": 2**22 + 12345, "ray_address": "127.0.0.1:1", "ray_namespace": "vime-x"})
    )
    assert engines_cli.main(["remove", "--run", str(run), "engine-0"]) == 1
    assert "is not running" in capsys.readouterr().err


def test_engine_table_shows_state_version_and_health():
    table = engines_cli.format_table(
        {
            "weight_version": 7,
            "engines": [
                {
                    "name": "engine-0",
                    "url": "http://127.0.0.1:5",
                    "origin": "start",
                    "owned": True,
                    "state": "serving",
                    "weight_version": 7,
                    "healthy": True,
                    "restarts": 1,
                    "node_id": "abcdef0123456789",
                    "last_error": "",
                },
                {
                    "name": "engine-1",
                    "url": "http://h:6",
                    "origin": "added",
                    "owned": False,
                    "state": "lost",
                    "weight_version": 3,
                    "healthy": False,
                    "failed_checks": 2,
                    "restarts": 0,
                    "node_id": None,
                    "last_error": "failed its health checks",
                },
            ],
        }
    )
    lines = table.splitlines()
    assert lines[0].split()[:5] == ["NAME", "URL", "ORIGIN", "STATE", "WEIGHT_VERSION"]
    assert "engine-0" in lines[1] and "serving" in lines[1] and " ok " in lines[1] and "abcdef012345" in lines[1]
    assert "added, external" in lines[2] and "failing (2)" in lines[2]
    assert "current weight version: 7" in table and "engine-1: failed its health checks" in table


class _Client:
    """The RL endpoints of an engine, recorded (what vLLM would be told)."""

    url = "http://engine"

    def __init__(self):
        self.label, self.loaded = "default", []

    def pause(self, mode):
        pass

    def resume(self):
        pass

    def reset_prefix_cache(self):
        pass

    def reload_weights(self, path):
        self.loaded.append(path)

    def update_weight_version(self, version):
        self.label = str(version)

    def probe(self, expect_version=None):
        assert expect_version is None or str(expect_version) == self.label  # probed with the version it serves

    def weight_version(self):
        return self.label


def test_a_late_engine_catches_up_to_a_delta_version_it_never_held(tmp_path):
    from tests.unit.test_weights_delta import Trainer, read_files
    from vime.tools.make_tiny_model import make_tiny_model
    from vime.weights.publisher import WeightPublisher
    from vime.workers.engines import EngineActor, EngineSpec

    trainer = Trainer(make_tiny_model(str(tmp_path / "m")))
    root = str(tmp_path / "weights")
    publisher = WeightPublisher(root, keep=5)
    for version in (1, 2, 3):  # full, delta, delta
        trainer.step()
        publisher.publish(version, trainer.write, mode="delta", full_interval=10)
    expected = str(tmp_path / "expected")
    trainer.write(expected)

    engine = EngineActor(
        EngineSpec(
            index=7,
            model="unused",
            vllm_args={},
            tensor_parallel_size=1,
            run_token="t",
            log_path=str(tmp_path / "log"),
            startup_timeout=1,
            http_timeout=1,
        )
    )
    engine.client = _Client()
    assert engine.load_version(root, 3) == 3
    assert engine.client.label == "3" and read_files(engine.client.loaded[-1]) == read_files(expected)
    trainer.step()  # the next delta applies to the rebuilt copy
    publisher.publish(4, trainer.write, mode="delta", full_interval=10)
    engine.update_weights(os.path.join(root, "weight_v000004"), 4, flush=False)
    trainer.write(expected + "4")
    assert read_files(engine.client.loaded[-1]) == read_files(expected + "4")
    # A version pruned while an engine started: the newest one published is loaded instead, and
    # the version returned says so (the driver checks it before registering the engine).
    trainer.step()
    publisher.publish(5, trainer.write, mode="delta", force_full=True)
    import shutil

    shutil.rmtree(os.path.join(root, "weight_v000002"))
    late = EngineActor(
        EngineSpec(
            index=8,
            model="unused",
            vllm_args={},
            tensor_parallel_size=1,
            run_token="t",
            log_path=str(tmp_path / "log"),
            startup_timeout=1,
            http_timeout=1,
        )
    )
    late.client = _Client()
    assert late.load_version(root, 2) == 5 and late.client.label == "5"
    with pytest.raises(Exception, match="does not exist"):
        late.load_version(root, 9)
    assert late.load_version(root, 0) == 0  # back to --hf-checkpoint: reloaded, not only relabelled
    assert late.client.loaded[-1] == "unused" and late.client.label == "0"
    engine.stop()
    late.stop()


def test_node_watch_reports_each_join_and_each_departure_once():
    from vime.workers.engine_nodes import NodeWatch

    def node(node_id, alive=True, rollout=0.0, host="10.0.0.2"):
        return {"NodeID": node_id, "Alive": alive, "Resources": {"rollout": rollout}, "NodeManagerAddress": host}

    watch = NodeWatch("rollout", tensor_parallel_size=2)
    # The driver's node hosts an engine already; a node without the resource never gets engines.
    left, joined = watch.scan([node("driver", rollout=2), node("plain")], hosting=["driver"])
    assert (left, joined) == ([], [])
    left, joined = watch.scan([node("driver", rollout=2), node("new", rollout=5)], hosting=["driver"])
    assert left == [] and [(j.node_id, j.host, j.amount, j.engines) for j in joined] == [("new", "10.0.0.2", 5, 2)]
    # A single slot still gets one engine, however large the engines are.
    left, joined = watch.scan([node("driver", rollout=2), node("new", rollout=5), node("small", rollout=1)], [])
    assert left == [] and [j.engines for j in joined] == [1]
    # Seen again: nothing new. Gone: reported once, then never again.
    assert watch.scan([node("driver", rollout=2), node("new", rollout=5), node("small", rollout=1)], []) == ([], [])
    left, _ = watch.scan([node("driver", rollout=2), node("new", alive=False, rollout=5)], hosting=["driver"])
    assert left == ["new", "small"]
    assert watch.scan([node("driver", rollout=2)], hosting=["driver"]) == ([], [])
    assert watch.lost == {"new", "small"}


def test_node_watch_without_node_engines_reports_joins_that_get_a_worker_only():
    from vime.workers.engine_nodes import NodeWatch

    def node(node_id, alive=True, rollout=1.0):
        return {"NodeID": node_id, "Alive": alive, "Resources": {"rollout": rollout}, "NodeManagerAddress": "127.0.0.2"}

    # --no-rollout-elastic-node-engines (an engine-free --rollout-function-path): no engine, whatever the amount.
    watch = NodeWatch("rollout", tensor_parallel_size=1, node_engines=False)
    left, joined = watch.scan([node("a", rollout=4), node("b")], hosting=[])
    assert left == [] and [(j.node_id, j.engines) for j in joined] == [("a", 0), ("b", 0)]
    assert {j.host for j in joined} == {"127.0.0.2"}
    assert watch.scan([node("a", rollout=4), node("b")], hosting=[]) == ([], [])  # each join once
    assert watch.scan([node("a", rollout=4), node("b", alive=False)], hosting=[]) == (["b"], [])


def test_failure_reasons_name_the_root_cause_and_fit_the_progress_line():
    from vime.workers.failure_reasons import error_reason, progress_reason

    class Wrapped(Exception):  # how Ray wraps an actor's error: the original is its .cause
        def __init__(self, cause):
            super().__init__("ray wrapper text")
            self.cause = cause

    assert error_reason(Wrapped(ValueError("line one\nthe last line"))) == "ValueError: the last line"
    assert error_reason(Wrapped(EngineError("http://e:1", "generate answered 403"))).endswith("generate answered 403")
    short = progress_reason("engine http://e:1: failed its health checks: " + "x" * 300)
    assert short.startswith("xxx") and len(short) == 110 and short.endswith("...")
