"""Prompt sets, read from the JSON files in `dflash_bench/prompts/` (data, not code, so they can be
reviewed and extended without touching the checks). They ship inside the package (pyproject.toml's
package-data), so a non-editable install finds them from any folder; DFLASH_BENCH_PROMPTS points the
checks at another folder of the same files."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from dflash_bench.checks.client import Request
from dflash_bench.engine.errors import DFlashBenchError

PROMPTS_DIR = Path(os.environ.get("DFLASH_BENCH_PROMPTS", Path(__file__).resolve().parents[1] / "prompts"))


class BadPromptSet(DFlashBenchError):
    """A prompt file is missing or lacks a field."""


@dataclass(frozen=True)
class Prompt:
    """One prompt: `endpoint` is "chat" (one user turn) or "completions" (raw text)."""

    id: str
    endpoint: str
    text: str
    max_tokens: int
    kind: str
    expect: str | None = None
    verified_with: tuple[str, ...] = ()

    def request(self, *, draft: bool | None = True, max_tokens: int | None = None, temperature: float = 0.0,
                seed: int | None = None, stream: bool = False) -> Request:
        """The request for this prompt; `draft=None` leaves the field out (servers that lack it)."""
        if self.endpoint == "chat":
            messages, prompt = [{"role": "user", "content": self.text}], None
        else:
            messages, prompt = None, self.text
        return Request(prompt_id=self.id, prompt=prompt, messages=messages,
                       max_tokens=max_tokens or self.max_tokens, temperature=temperature, seed=seed,
                       draft=draft, stream=stream)


def _load(name: str) -> dict:
    path = PROMPTS_DIR / name
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise BadPromptSet(f"prompt file {path} is missing (DFLASH_BENCH_PROMPTS, when set, names a folder holding the files of dflash_bench/prompts/)") from None
    except json.JSONDecodeError as err:
        raise BadPromptSet(f"prompt file {path} is not valid JSON: {err}") from None


def _field(entry: dict, key: str, where: str):
    if key not in entry:
        raise BadPromptSet(f"{where}: field {key!r} is missing")
    return entry[key]


def known_answers() -> list[Prompt]:
    """Short factual questions, each with the substring a right answer contains."""
    data = _load("known_answers.json")
    endpoint, max_tokens = data.get("endpoint", "chat"), int(data.get("max_tokens", 64))
    return [
        Prompt(id=_field(p, "id", "known_answers.json"), endpoint=endpoint, text=_field(p, "text", p["id"]),
               max_tokens=max_tokens, kind="known", expect=_field(p, "expect", p["id"]),
               verified_with=tuple(p.get("verified_with", ())))
        for p in data["prompts"]
    ]


def probes() -> dict[str, Prompt]:
    """The decode probes by role: "code" (raw completion) and "chat"."""
    data = _load("probes.json")
    out = {}
    for p in data["probes"]:
        role = _field(p, "role", "probes.json")
        out[role] = Prompt(id=_field(p, "id", "probes.json"), endpoint=_field(p, "endpoint", p["id"]),
                           text=_field(p, "text", p["id"]), max_tokens=int(p.get("max_tokens", 256)), kind=role)
    for role in ("code", "chat"):
        if role not in out:
            raise BadPromptSet(f"probes.json: no probe with role {role!r}")
    return out


def long_prompts() -> list[Prompt]:
    """Prompts longer than the drafter's sliding window: the chronicle's first paragraphs plus a question."""
    data = _load("long.json")
    paragraphs = _field(data, "paragraphs", "long.json")
    out = []
    for p in data["prompts"]:
        count = int(_field(p, "paragraphs", p["id"]))
        if not 0 < count <= len(paragraphs):
            raise BadPromptSet(f"long.json {p['id']}: paragraphs {count} is outside 1..{len(paragraphs)}")
        text = "\n\n".join(paragraphs[:count]) + _field(p, "question", p["id"])
        out.append(Prompt(id=p["id"], endpoint=_field(p, "endpoint", p["id"]), text=text,
                          max_tokens=int(p.get("max_tokens", 256)), kind="long"))
    return out


def prefill_paragraph() -> tuple[str, str]:
    """The public prefill paragraph and the separator it is repeated with."""
    data = _load("prefill.json")
    return _field(data, "paragraph", "prefill.json"), data.get("separator", " ")
