"""Whether a change kept every request's tokens: two receipts' token hashes, request by request.

A kernel's fusion, a launch rewritten, a graph cut: changes meant to keep the bits are proven by the same tokens
for the same requests before and after, which speed cells cannot show (docs/gpu-round-profile.md's session 51:
a launch whose rotation differed from MLX's in 2 of 270,336 elements changed 28 of the default model's 92 token
hashes while every drafted == plain check still passed). A request is named by what was asked (its prompt, the
endpoint, drafted or not, temperature, seed, length, labels; engine-speed's probe, mode, streams and rep), never
by what came back, and the n-th of identical requests pairs with the n-th; its hash is the receipt's token_sha
(engine-speed's, one per stream, joined). Requests that failed or carry no hash are left out.
"""

from __future__ import annotations

import collections
import json
from dataclasses import dataclass

from dflash_bench.checks.receipt import Receipt

# what names a request, in the order a row shows it: the runner's records, then engine-speed's
REQUEST = ("prompt_id", "probe", "mode", "streams", "endpoint", "draft", "temperature", "seed", "max_tokens",
           "stream", "rep", "labels")


@dataclass
class TokenRow:
    kind: str
    request: str
    before: str | None
    after: str | None

    @property
    def changed(self) -> bool:
        """Both receipts ran the request and its tokens differ."""
        return self.before is not None and self.after is not None and self.before != self.after

    def to_dict(self) -> dict:
        return {"kind": self.kind, "request": self.request, "before": self.before, "after": self.after}


def _request(record: dict) -> str:
    parts = []
    for name in REQUEST:
        value = record.get(name)
        if value is None:
            continue
        if name == "labels":  # a check's own names for the request (kind, mode, level, stream, ...)
            parts += [f"{k}={json.dumps(v) if isinstance(v, (dict, list)) else v}" for k, v in sorted(value.items())
                      if k not in record]  # (a label repeating a field is shown once)
        else:
            parts.append(f"{name}={value}")
    return " ".join(parts)


def _sha(record: dict) -> str | None:
    sha = record.get("token_sha")
    if isinstance(sha, list):
        return ",".join(sha) if sha and all(isinstance(s, str) for s in sha) else None
    return sha if isinstance(sha, str) and record.get("status", "ok") == "ok" else None


def token_shas(receipt: Receipt) -> dict[str, str]:
    """Every request's token hash, by its name (module docstring); a repeated request gets `#n` after the first."""
    seen: collections.Counter = collections.Counter()
    out: dict[str, str] = {}
    for record in receipt.records:
        sha = _sha(record)
        if sha is None:
            continue
        name = _request(record)
        seen[name] += 1
        out[name if seen[name] == 1 else f"{name} #{seen[name]}"] = sha
    return out


def rows(kind: str, before: Receipt, after: Receipt) -> list[TokenRow]:
    """One row a request either receipt ran, in BEFORE's order, then AFTER's own."""
    b, a = token_shas(before), token_shas(after)
    return [TokenRow(kind, name, b.get(name), a.get(name)) for name in [*b, *(n for n in a if n not in b)]]


def summary_line(token_rows: list[TokenRow]) -> str:
    """`N of M requests the same tokens, K changed, L run on one side only`."""
    both = [r for r in token_rows if r.before is not None and r.after is not None]
    changed = sum(r.changed for r in both)
    line = f"tokens: {len(both) - changed} of {len(both)} requests the same, {changed} changed"
    one_side = len(token_rows) - len(both)
    return line + (f", {one_side} run on one side only" if one_side else "")
