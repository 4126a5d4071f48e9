"""A v1 server and a DFlash2 server over one target, running at the same time: every reply, drafted or
plain, greedy or T=0.7, is the same token for token on both, since drafts never decide a token."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from dflash_bench.checks.server import ManagedServer, ServeSettings

pytestmark = pytest.mark.slow

fixtures = pytest.importorskip("dflash_bench.fixtures.small")


def test_v1_and_dflash2_servers_give_the_same_replies(tmp_path) -> None:
    target = fixtures.write_fixture("llama", tmp_path / "llama")
    v1 = fixtures.write_fixture("dflash", tmp_path / "dflash", target="llama")
    v2 = fixtures.write_fixture("dflash2", tmp_path / "dflash2", target="llama")
    servers = [ManagedServer(ServeSettings(str(target), str(d), parallel=4, context=1024), tmp_path / f"{d.name}.log",
                             startup_timeout=300) for d in (v1, v2)]
    requests = [{"prompt": [8 + (7 * i + j) % 400 for j in range(5 + 9 * i)], "max_tokens": 24, "ignore_eos": True,
                 "temperature": 0.7 * (i % 2), "seed": 50 + i, "draft": draft, "return_token_ids": True}
                for i in range(6) for draft in (True, False)]
    with servers[0], servers[1], httpx.Client(timeout=120) as client:
        kinds = [client.get(f"{s.url}/health").json() for s in servers]
        assert [k.get("drafter") for k in kinds] == ["DFlash", "DFlash2"], kinds

        def ask(job: tuple[str, dict]) -> list[int]:
            url, body = job
            reply = client.post(f"{url}/v1/completions", json=body)
            assert reply.status_code == 200, reply.text
            return reply.json()["choices"][0]["token_ids"]

        jobs = [(s.url, body) for body in requests for s in servers]  # both servers busy at once
        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(ask, jobs))
    for n in range(0, len(got), 4):  # one prompt: v1 drafted, DFlash2 drafted, v1 plain, DFlash2 plain
        assert got[n] == got[n + 1] == got[n + 2] == got[n + 3], f"prompt {n // 4}"
