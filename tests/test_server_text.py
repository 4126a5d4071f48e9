"""The server's text side: incremental detokenization and stop strings (no server, the default model's tokenizer)."""

from __future__ import annotations

import pytest

import dflash_bench  # noqa: F401
from dflash_bench.engine import gguf
from dflash_bench.engine.checkpoint import resolve
from dflash_bench.engine.textstream import TextStream
from dflash_bench.engine.tokenizer import Tokenizer

TEXT = "Héllo wörld 🦊 café, the fox.\nNext line: 日本語 and more text."


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_gguf_metadata(gguf.read_header(resolve("default")).metadata)


def run(tok: Tokenizer, ids: list[int], stop: list[str] | None, step: int) -> tuple[str, list[int], TextStream]:
    """Feed `ids` `step` at a time, as rounds would; return what was sent."""
    stream = TextStream(tok.backend, stop)
    text, sent = "", []
    for i in range(0, len(ids), step):
        d = stream.feed(ids[i : i + step])
        text, sent = text + d.text, sent + d.tokens
        if stream.stopped:
            break
    d = stream.finish()
    return text + d.text, sent + d.tokens, stream


@pytest.mark.parametrize("step", [1, 3, 7])
def test_streamed_text_equals_decoding_all_ids(tok: Tokenizer, step: int) -> None:
    ids = tok.encode(TEXT)
    text, sent, _ = run(tok, ids, None, step)
    assert text == tok.decode(ids) == TEXT
    assert sent == ids


def test_no_chunk_ends_inside_a_multibyte_character(tok: Tokenizer) -> None:
    ids = tok.encode("🦊🦊 日本語")
    stream = TextStream(tok.backend)
    pieces = [stream.feed([i]).text for i in ids]
    assert "\ufffd" not in "".join(pieces)
    assert "".join(pieces) == "🦊🦊 日本語"
    assert any(p == "" for p in pieces)  # a token ending inside a character waits for the next one


@pytest.mark.parametrize("step", [1, 2, 5, 100])
@pytest.mark.parametrize("stop", ["fox", "ox.", "\n", "日本", "wörld 🦊"])
def test_stop_string_ends_the_text_right_before_it(tok: Tokenizer, stop: str, step: int) -> None:
    ids = tok.encode(TEXT)
    text, sent, stream = run(tok, ids, [stop, "never appears"], step)
    assert stream.stopped
    assert text == TEXT[: TEXT.find(stop)]
    assert sent == stream.tokens == ids[: len(sent)]
    assert tok.decode(sent).startswith(text)  # the tokens carry the text ...
    without_last = TextStream(tok.backend)
    without_last.feed(sent[:-1])
    assert len(without_last.text) < len(text)  # ... and the last of them is needed for it


def test_earliest_stop_string_wins(tok: Tokenizer) -> None:
    text, _, _ = run(tok, tok.encode(TEXT), ["line", "café"], 4)
    assert text == TEXT[: TEXT.find("café")]


def test_text_that_may_start_a_stop_string_is_held_back(tok: Tokenizer) -> None:
    ids = tok.encode("the fox jumps")
    stream = TextStream(tok.backend, ["fox den"])
    sent = ""
    for i in ids:
        sent += stream.feed([i]).text
        assert len(sent) <= max(0, len(stream.text) - len("fox den") + 1)  # the tail that may still grow into it
    assert not stream.stopped
    assert sent + stream.finish().text == "the fox jumps"


def test_stop_at_the_very_start_returns_nothing(tok: Tokenizer) -> None:
    text, sent, stream = run(tok, tok.encode(TEXT), ["Hé"], 2)
    assert (text, sent, stream.stopped) == ("", [], True)


def test_a_reply_ending_inside_a_character_ends_as_decoding_all_ids_does(tok: Tokenizer) -> None:
    ids = tok.encode("ok 🦊")[:-1]  # the fox's last byte is missing
    text, sent, _ = run(tok, ids, None, 1)
    assert text == tok.decode(ids) and text.endswith("\ufffd")
    assert sent == ids
