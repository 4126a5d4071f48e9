"""The server a check talks to: the bundled one started on a free loopback port (and stopped after),
or one already running at --url.

The managed server runs in its own session so that a Ctrl-C in the terminal reaches the harness
only: the harness writes its receipt, then stops the server itself.
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from dflash_bench.engine.errors import DFlashBenchError

# The bundled server's startup line names the drafter kind, the streams and the context.
STARTUP_LINE = re.compile(r"drafts|streams|no drafter", re.IGNORECASE)
SERVE_COMMAND = (sys.executable, "-m", "dflash_bench", "serve")


class ServerFailed(DFlashBenchError):
    """The server did not come up, or went away during a run."""


@dataclass
class ServeSettings:
    """What `dflash-bench serve` is started with; None leaves the server's own default."""

    target: str = "default"
    drafter: str | None = None
    parallel: int | None = None
    context: int | None = None
    prompt_cache_gib: float | None = None
    drafter_bits: int | None = None
    backend: str | None = None
    verify_budget: str | None = None
    tree_nodes: int | None = None

    def argv(self, host: str, port: int) -> list[str]:
        args = [self.target]
        for flag, value in (("--drafter", self.drafter), ("--parallel", self.parallel), ("--context", self.context),
                            ("--prompt-cache-gib", self.prompt_cache_gib), ("--drafter-bits", self.drafter_bits),
                            ("--backend", self.backend), ("--verify-budget", self.verify_budget),
                            ("--tree-nodes", self.tree_nodes)):
            if value is not None:
                args += [flag, str(value)]
        return args + ["--host", host, "--port", str(port)]


def _die_with_parent() -> None:
    """In the child, before exec (Linux): SIGTERM when the harness dies, even by SIGKILL, so a
    server in its own session is never left running."""
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _health(url: str) -> dict | None:
    try:
        r = httpx.get(f"{url}/health", timeout=5.0)
    except httpx.HTTPError:
        return None
    if r.status_code != 200:
        return None
    try:
        body = r.json()
    except ValueError:
        return {}  # a 200 with no JSON (vLLM's /health answers an empty body) is alive, naming nothing
    return body if isinstance(body, dict) else {}


def _answers(url: str, path: str) -> bool:
    try:
        return httpx.get(f"{url}{path}", timeout=5.0).status_code == 200
    except httpx.HTTPError:
        return False


class AttachedServer:
    """A server someone else runs: we only read it. A server without /health (llama-cpp-python's)
    counts as up while GET /v1/models answers 200; its health is then empty."""

    managed = False

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self.health: dict | None = None

    def __enter__(self) -> AttachedServer:
        self.health = _health(self.url)
        if self.health is None:
            if not _answers(self.url, "/v1/models"):
                raise ServerFailed(f"--url {self.url}: neither GET /health nor GET /v1/models answered 200")
            self.health = {}
        return self

    def __exit__(self, *exc) -> None:
        return None

    def alive(self) -> bool:
        return _health(self.url) is not None or _answers(self.url, "/v1/models")

    def death(self) -> str | None:
        return None if self.alive() else f"the server at {self.url} stopped answering /health and /v1/models"

    def describe(self) -> dict:
        return {"url": self.url, "managed": False, "health": self.health}


class ManagedServer:
    """`dflash-bench serve` as a subprocess on a free loopback port, its output in `log_path`."""

    managed = True

    def __init__(self, settings: ServeSettings, log_path: Path, startup_timeout: float = 600.0,
                 host: str = "127.0.0.1", command: tuple[str, ...] = SERVE_COMMAND) -> None:
        self.settings, self.log_path, self.startup_timeout, self.host = settings, Path(log_path), startup_timeout, host
        self.command = command
        self.port = free_port(host)
        self.url = f"http://{host}:{self.port}"
        self.argv = [*command, *settings.argv(host, self.port)]
        self.proc: subprocess.Popen | None = None
        self.health: dict | None = None
        self.startup_seconds: float | None = None

    def __enter__(self) -> ManagedServer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "wb")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        t0 = time.monotonic()
        self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=env, start_new_session=True, preexec_fn=_die_with_parent)
        log.close()
        try:
            self._wait_ready(t0)
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - t0

    def _wait_ready(self, t0: float) -> None:
        while True:
            code = self.proc.poll()
            if code is not None:
                raise ServerFailed(f"the server exited with code {code} before it was ready: {self.log_tail()}")
            health = _health(self.url)
            if health is not None and health.get("status") == "ready":
                self.health = health
                return
            if time.monotonic() - t0 > self.startup_timeout:
                raise ServerFailed(f"the server was not ready within {self.startup_timeout:.0f} s "
                                   f"(--startup-timeout): {self.log_tail()}")
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=15)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def death(self) -> str | None:
        """Why the server is gone, or None while it runs."""
        if self.alive():
            return None
        return f"the server exited with code {self.proc.returncode if self.proc else None}: {self.log_tail()}"

    def log_lines(self) -> list[str]:
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace").splitlines()
        except FileNotFoundError:
            return []

    def log_tail(self, n: int = 5) -> str:
        lines = [line for line in self.log_lines() if line.strip()]
        return " | ".join(lines[-n:]) if lines else "(no output)"

    def startup_line(self) -> str | None:
        return next((line.strip() for line in self.log_lines() if STARTUP_LINE.search(line)), None)

    def describe(self) -> dict:
        return {"url": self.url, "managed": True, "command": self.argv, "settings": asdict(self.settings),
                "health": self.health, "startup_line": self.startup_line(), "startup_seconds": self.startup_seconds,
                "log": str(self.log_path)}


def open_server(url: str | None, settings: ServeSettings, log_path: Path, startup_timeout: float = 600.0):
    """The server for a run, as a context manager: attached to `url`, or a managed bundled server."""
    if url:
        return AttachedServer(url)
    return ManagedServer(settings, log_path, startup_timeout)
