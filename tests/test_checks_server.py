"""ManagedServer: start a server subprocess on a free loopback port, wait for ready, keep its
startup line and log, stop it; a server that dies before ready is one clear error."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from dflash_bench.checks import runner
from dflash_bench.checks.client import Request
from dflash_bench.checks.receipt import Receipt
from dflash_bench.checks.server import ManagedServer, ServerFailed, ServeSettings

FAKE = (sys.executable, str(Path(__file__).with_name("fake_openai.py")))


def test_serve_arguments_pass_only_what_was_given():
    s = ServeSettings(target="default", drafter="/d", parallel=4, prompt_cache_gib=0)
    assert s.argv("127.0.0.1", 8080) == ["default", "--drafter", "/d", "--parallel", "4", "--prompt-cache-gib", "0",
                                         "--host", "127.0.0.1", "--port", "8080"]


def test_managed_server_starts_answers_and_stops(tmp_path):
    log = tmp_path / "serve.log"
    server = ManagedServer(ServeSettings(parallel=4), log, startup_timeout=30, command=FAKE)
    with server:
        assert server.url.startswith("http://127.0.0.1:")
        assert httpx.get(f"{server.url}/health").json()["status"] == "ready"
        described = server.describe()
        assert described["managed"] and described["health"]["context"] == 4096
        assert described["startup_line"] == "fake serve default: DFlash drafts for 4 streams of 4096 tokens"
        assert described["command"][-6:] == ["--parallel", "4", "--host", "127.0.0.1", "--port", str(server.port)]
    assert not server.alive() and server.proc.returncode is not None
    assert "DFlash drafts" in log.read_text()


def test_a_server_that_dies_before_ready_is_one_clear_error(tmp_path):
    server = ManagedServer(ServeSettings(), tmp_path / "serve.log", startup_timeout=30, command=(*FAKE, "--die"))
    with pytest.raises(ServerFailed, match="exited with code 3 before it was ready: fake: refusing to start"):
        server.start()


def test_a_managed_server_dying_mid_run_leaves_an_incomplete_receipt_naming_it(tmp_path, monkeypatch):
    monkeypatch.setattr(runner, "open_server", lambda url, settings, log, timeout: ManagedServer(
        settings, log, timeout, command=FAKE))

    def body(ctx):
        ctx.send(Request("before", prompt="hi", max_tokens=2))
        ctx.server.proc.kill()
        ctx.server.proc.wait()
        ctx.send(Request("after", prompt="hi", max_tokens=2))

    out = tmp_path / "r.json"
    receipt, code = runner.run_check(runner.RunSpec("exactness", out), {}, body)
    assert code == 2
    saved = Receipt.load(out)
    assert not saved.complete and "the server exited with code -9" in saved.incomplete_reason
    assert [r["prompt_id"] for r in saved.records] == ["before"]
    assert saved.server["managed"] and saved.server["startup_line"].startswith("fake serve default")
    assert (tmp_path / "r.server.log").exists()


def test_a_managed_server_dies_with_a_harness_killed_outright(tmp_path):
    script = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
              "from pathlib import Path\n"
              "from dflash_bench.checks.server import ManagedServer, ServeSettings\n"
              f"s = ManagedServer(ServeSettings(), Path({str(tmp_path / 'serve.log')!r}), 30, command={FAKE!r})\n"
              "s.start(); print(s.proc.pid, flush=True)\n"
              "import time; time.sleep(60)\n")
    harness = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    child = int(harness.stdout.readline())
    harness.kill()
    harness.wait()
    deadline = time.monotonic() + 10
    while _running(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _running(child)


def _running(pid: int) -> bool:
    """True while `pid` exists and is not a zombie (an orphan is reaped by init, not by us)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"
