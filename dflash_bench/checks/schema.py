"""The receipt contract: pydantic models of every file receipts/ holds, and their versioned JSON Schema.

Three documents live in receipts/:
- a run receipt (schema "dflash-bench/receipt"): the envelope below with the kind's records and
  aggregates (checks/aggregates.py); receipt.Receipt writes it;
- a comparison (schema "dflash-bench/compare"), what `compare --out` writes; files written before the
  schema key was added (a user's; every committed one now carries it) are read by their keys;
- a training receipt (schema 1 and a `what`), written by tools/train_drafter;
and one side file, the prefill check's token arrays (<receipt>.prefill-arrays.json, named in the
prefill receipt's side_files).

Versions of the run receipt: 1, then 2, which adds (all optional) each streamed record's chunk times
and latencies, the `dflash` block's acceptance histogram and per-depth acceptance, and decode's
`latency` and `acceptance` aggregates. A version-1 receipt has the same shape less those keys, so
this tool reads both as they are; no migration rewrites the committed ones.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, RootModel, Tag, TypeAdapter, ValidationError

from dflash_bench.checks import aggregates as agg
from dflash_bench.engine.errors import DFlashBenchError

SCHEMA = "dflash-bench/receipt"
SCHEMA_VERSION = 2
READS = (1, 2)
COMPARE_SCHEMA = "dflash-bench/compare"
SCHEMA_ID = f"urn:dflash-bench:receipt:v{SCHEMA_VERSION}"


class BadReceipt(DFlashBenchError):
    """A file is not a receipt this version reads."""


class Strict(BaseModel):
    """The envelope: every key named, none unknown (a typo in a writer fails the receipts test)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class Entry(Strict):
    check: str
    subject: Optional[str] = None
    message: str


class NotRun(Strict):
    check: str
    reason: str
    subject: Optional[str] = None


class Verdict(Strict):
    passed: bool
    failures: list[Entry] = Field(default_factory=list)
    unverified: list[Entry] = Field(default_factory=list)
    warnings: list[Entry] = Field(default_factory=list)


class Git(Strict):
    commit: Optional[str] = None
    dirty: Optional[bool] = None


class Tool(Strict):
    name: str
    version: str
    git: Git = Field(default_factory=Git)


class CheckRecord(agg.Loose):
    """One request a check sent (checks/client.py's Record). Times are seconds from sending."""

    prompt_id: str
    endpoint: str
    status: str
    draft: Optional[bool] = None
    temperature: Optional[float] = None
    seed: Optional[int] = None
    max_tokens: Optional[int] = None
    stream: bool = False
    error: Optional[str] = None
    http_status: Optional[int] = None
    prompt_tokens: Optional[int] = None
    cached_tokens: Optional[int] = None
    completion_tokens: Optional[int] = None
    token_sha: Optional[str] = None
    ttft: Optional[float] = None
    decode_seconds: Optional[float] = None
    elapsed: Optional[float] = None
    chunk_times: Optional[list[float]] = None  # v2: when each streamed chunk carrying tokens came
    chunk_tokens: Optional[list[int]] = None  # v2: how many tokens each of those chunks carried
    tpot: Optional[float] = None  # v2: (last chunk - first chunk) / (tokens after the first chunk)
    acceptance_histogram: Optional[list[int]] = None  # v2: from the reply's `dflash` block
    acceptance_by_depth: Optional[list[Optional[float]]] = None  # v2: from the reply's `dflash` block
    drafted_by_depth: Optional[list[int]] = None  # v2: from the reply's `dflash` block
    labels: dict[str, Any] = Field(default_factory=dict)


class SpeedRecord(agg.Loose):
    """engine-speed: one rep of a cell, decoded in process."""

    probe: str
    mode: str
    rep: int
    streams: int


class PlanRecord(agg.Loose):
    """plan --check: one of the planned streams, decoded in process."""

    id: str
    finish: str


class SelfcheckRecord(agg.Loose):
    """selfcheck: one path's verdict."""

    path: str
    passed: bool
    choice: str
    detail: str


class ReceiptBase(Strict):
    schema_: Literal["dflash-bench/receipt"] = Field(SCHEMA, alias="schema")
    schema_version: Literal[1, 2] = SCHEMA_VERSION
    kind: str
    command: list[str]
    started_at: Optional[str] = None
    finished_at: Optional[str] = None
    complete: bool
    incomplete_reason: Optional[str] = None
    tool: Tool
    environment: dict[str, Any] = Field(default_factory=dict)
    server: dict[str, Any] = Field(default_factory=dict)
    settings: dict[str, Any]
    records: list[Any] = Field(default_factory=list)
    aggregates: Any = None
    not_run: list[NotRun] = Field(default_factory=list)
    side_files: dict[str, str] = Field(default_factory=dict)
    verdict: Verdict


def _receipt_model(kind: str, aggregates: type[BaseModel], record: type[BaseModel]) -> type[ReceiptBase]:
    name = "".join(part.title() for part in kind.split("-")) + "Receipt"
    annotations = {"kind": Literal[kind], "aggregates": aggregates, "records": list[record]}  # type: ignore[valid-type]
    namespace = {"__annotations__": annotations, "__module__": __name__, "__doc__": f"A `{kind}` receipt.",
                 "aggregates": Field(default_factory=aggregates), "records": Field(default_factory=list)}
    return type(name, (ReceiptBase,), namespace)


RECORDS: dict[str, type[BaseModel]] = {"engine-speed": SpeedRecord, "plan": PlanRecord, "selfcheck": SelfcheckRecord,
                                       "suite": agg.Loose}
RECEIPTS: dict[str, type[ReceiptBase]] = {kind: _receipt_model(kind, model, RECORDS.get(kind, CheckRecord))
                                          for kind, model in agg.BY_KIND.items()}
AnyReceipt = Annotated[Union[tuple(RECEIPTS.values())], Field(discriminator="kind")]  # type: ignore[valid-type]


# -- the other documents in receipts/ ------------------------------------------------------------
class CompareCell(agg.Loose):
    section: str
    row: str
    mode: str
    before: Optional[agg.Summary] = None
    after: Optional[agg.Summary] = None
    judged: bool
    noisy: bool = False
    ratio: Optional[float] = None
    drop: bool = False
    note: str = ""


class CompareTokens(Strict):
    """One request's token hash on each side (checks/tokens.py's TokenRow); None where that side did not run it."""

    kind: str
    request: str
    before: Optional[str] = None
    after: Optional[str] = None


class CompareDoc(Strict):
    """What `compare --out` writes (checks/compare.py's CompareResult.to_dict)."""

    schema_: Optional[Literal["dflash-bench/compare"]] = Field(None, alias="schema")
    schema_version: Optional[int] = None
    before: list[str]
    after: list[str]
    noise: float
    cells: list[CompareCell] = Field(default_factory=list)
    failures: list[dict[str, Any]] = Field(default_factory=list)
    drops: list[str] = Field(default_factory=list)
    incomplete: list[str] = Field(default_factory=list)
    tokens: list[CompareTokens] = Field(default_factory=list)
    tokens_changed: list[str] = Field(default_factory=list)
    same_tokens: bool = False
    exit_code: int


class HeldOut(agg.Loose):
    """A drafter measured on held-out sequences (tools/train_drafter)."""

    loss: Optional[float] = None
    sequences: Optional[int] = None
    tokens_per_round: Optional[float] = None
    acceptance_by_row: list[float] = Field(default_factory=list)
    tokens_per_round_by_kind: dict[str, float] = Field(default_factory=dict)


class HeldOutAverage(agg.Loose):
    """`train_drafter average`: each source drafter and their mean, measured on the same sequences."""

    data: list[str] = Field(default_factory=list)
    drafters: dict[str, HeldOut]


class TrainingReceipt(agg.Loose):
    """What tools/train_drafter writes beside a drafter it trained or averaged."""

    schema_: Literal[1] = Field(alias="schema")
    what: str
    command: str
    date: str
    git_revision: Optional[str] = None
    files: dict[str, dict[str, Any]] = Field(default_factory=dict)
    held_out: Union[HeldOutAverage, HeldOut]
    notes: Union[str, list[str], None] = None

    def evaluations(self) -> dict[str, HeldOut]:
        """Each drafter measured: one for a training run, every source and the mean for an average."""
        if isinstance(self.held_out, HeldOutAverage):
            return dict(self.held_out.drafters)
        return {"this drafter": self.held_out}


class PrefillArrays(RootModel[dict[str, list[int]]]):
    """The prefill check's side file: size -> the exact token array sent."""


def document_kind(data: Any) -> str:
    """Which document a parsed JSON file is (the discriminator of Document)."""
    if not isinstance(data, dict):
        return "unknown"
    if data.get("schema") == SCHEMA:
        return "receipt"
    if data.get("schema") == COMPARE_SCHEMA or {"before", "after", "cells", "noise"} <= data.keys():
        return "compare"
    if data.get("schema") == 1 and "what" in data:
        return "train"
    if data and all(k.isdigit() and isinstance(v, list) for k, v in data.items()):
        return "prefill-arrays"
    return "unknown"


Document = Annotated[Union[Annotated[AnyReceipt, Tag("receipt")], Annotated[CompareDoc, Tag("compare")],
                           Annotated[TrainingReceipt, Tag("train")], Annotated[PrefillArrays, Tag("prefill-arrays")]],
                     Discriminator(document_kind)]
DOCUMENT = TypeAdapter(Document)
RECEIPT = TypeAdapter(AnyReceipt)


def _problem(err: ValidationError) -> str:
    first = err.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "(top)"
    more = f" (and {err.error_count() - 1} more)" if err.error_count() > 1 else ""
    return f"{where}: {first['msg']}{more}"


def validate_receipt(data: Any, where: str = "receipt") -> ReceiptBase:
    """The typed run receipt, or BadReceipt naming the first key that breaks the contract."""
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        found = data.get("schema") if isinstance(data, dict) else None
        raise BadReceipt(f"{where}: schema is {found!r}, not {SCHEMA!r}")
    if data.get("schema_version") not in READS:
        raise BadReceipt(f"{where}: schema_version {data.get('schema_version')!r}, this tool reads "
                         f"{', '.join(map(str, READS))}")
    if data.get("kind") not in RECEIPTS:
        raise BadReceipt(f"{where}: kind {data.get('kind')!r} is not one of {', '.join(RECEIPTS)}")
    try:
        return RECEIPT.validate_python(data)
    except ValidationError as err:
        raise BadReceipt(f"{where}: {_problem(err)}") from None


def read_json(path: Path) -> Any:
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise BadReceipt(f"{path}: no such file") from None
    except json.JSONDecodeError as err:
        raise BadReceipt(f"{path}: not JSON ({err})") from None


def load_document(path: Path) -> Union[ReceiptBase, CompareDoc, TrainingReceipt, PrefillArrays]:
    """Any file receipts/ holds, typed; BadReceipt when it is none of them or breaks its contract."""
    data = read_json(path)
    kind = document_kind(data)
    if kind == "receipt":
        return validate_receipt(data, str(path))
    if kind == "unknown":
        raise BadReceipt(f"{path}: not a receipt, comparison, training receipt or prefill arrays")
    try:
        return DOCUMENT.validate_python(data)
    except ValidationError as err:
        raise BadReceipt(f"{path}: {_problem(err)}") from None


def json_schema() -> dict:
    """The JSON Schema of every document in receipts/ (what `dflash-bench schema` prints)."""
    schema = DOCUMENT.json_schema(by_alias=True)
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "$id": SCHEMA_ID,
            "title": f"dflash-bench receipts, version {SCHEMA_VERSION}",
            "description": (__doc__ or "").strip(), "schema_version": SCHEMA_VERSION, **schema}
