"""Two-server mode: the same requests to a server that drafts (--url) and to one that does not
(--plain-url: same model, same settings, no speculative decoding), compared token for token.

This is how the drafted-equals-plain checks reach engines that have no `draft` field: the plain
reply comes from the second server instead of from `"draft": false` on the first. Both servers'
engines are detected (checks/adapters.py) and what each reported goes into the receipt.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

from dflash_bench.checks.adapters import TEXT, EngineClient
from dflash_bench.checks.client import Record
from dflash_bench.checks.receipt import Receipt
from dflash_bench.checks.server import AttachedServer, ServerFailed

PLAIN_LABEL = "the plain server"


@contextlib.contextmanager
def plain_side(url: str | None, timeout: float, api_key: str | None, receipt: Receipt,
               tokenizer: Callable[[str], list[int]] | None = None) -> Iterator[EngineClient | None]:
    """The client for --plain-url (None without one); its server's description goes into the receipt."""
    if not url:
        yield None
        return
    server = AttachedServer(url)
    try:
        server.__enter__()
    except ServerFailed as err:
        raise ServerFailed(str(err).replace("--url", "--plain-url", 1)) from None
    with server:
        client = EngineClient(server.url, timeout, api_key, tokenizer)
        try:
            receipt.server["plain"] = {**server.describe(), "adapter": client.describe()}
            client.pick_model(server.health)
            receipt.server["plain"]["model"] = client.model
            yield client
        finally:
            client.close()


def evidence(*records: Record) -> str | None:
    """The weakest evidence of the records compared: text-level if either was re-tokenized text."""
    kinds = [r.evidence for r in records]
    if None in kinds:
        return None
    return TEXT if TEXT in kinds else kinds[0] if len(set(kinds)) == 1 else "token pieces"


def weakest(rows: list[dict]) -> str | None:
    """The receipt's evidence: the weakest any compared row had (text < token pieces < token ids)."""
    order = {TEXT: 0, "token pieces": 1, "token ids": 2}
    kinds = [r["evidence"] for r in rows if r.get("evidence") in order]
    return min(kinds, key=order.__getitem__) if kinds else None
