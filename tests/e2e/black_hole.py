"""A loopback reverse proxy that turns one real engine into a black hole on demand (engine-fault drills).

Used by tests/e2e/test_engine_faults.py and bench/engine_faults/run.py. It forwards every call to the
engine unchanged until ``broken`` is set; then every ``POST /inference/v1/generate`` is answered 403,
exactly as a vLLM server started without ``--enable-scale-out`` answers, while ``/health`` and the
control endpoints (pause, weight reloads, ...) still work: the failure vime must find by probing.
It counts the rollout generate requests it received (vime's probes, recognised by their token ids,
are not counted) with the status it answered.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import requests

from vime.engines.probe import PROBE_TOKEN_IDS

SCALE_OUT_403 = (
    b'{"error":{"message":"Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out '
    b'to enable them.","type":"PermissionDeniedError","param":null,"code":403}}'
)


class BlackHoleProxy:
    """A loopback reverse proxy in front of one real engine. ``broken``: generate requests get 403, every
    other call is still forwarded; ``refuse_rollouts``: only the rollouts' generate requests get 403, vime's
    probes pass (an engine whose failures the probes do not see, so that a test can watch rollout requests
    fail for as long as it wants). Counts the rollout generate requests (not the probes) it received."""

    def __init__(self, target: str):
        proxy = self
        self.target, self.broken, self.refuse_rollouts = target, False, False
        self.rollout_requests: list[tuple[float, int]] = []  # (time, status answered)

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self):
                self._forward("GET", b"")

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.path.startswith("/inference/v1/generate"):
                    probe = json.loads(body or b"{}").get("token_ids") == list(PROBE_TOKEN_IDS)
                    if proxy.broken or (proxy.refuse_rollouts and not probe):
                        if not probe:
                            proxy.rollout_requests.append((time.monotonic(), 403))
                        return self._answer(403, SCALE_OUT_403)
                    if not probe:
                        proxy.rollout_requests.append((time.monotonic(), 200))
                self._forward("POST", body)

            def _forward(self, method, body):
                headers = {k: v for k, v in self.headers.items() if k.lower() in ("content-type", "x-session-id")}
                try:
                    answer = requests.request(
                        method, proxy.target + self.path, data=body or None, headers=headers, timeout=300
                    )
                except requests.RequestException:
                    return self._answer(502, b"proxy: the engine did not answer")
                self._answer(answer.status_code, answer.content, answer.headers.get("content-type"))

            def _answer(self, status, body, content_type="application/json"):
                self.send_response(status)
                self.send_header("Content-Type", content_type or "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()
