"""The target's tokenizer and chat template, from GGUF metadata or a checkpoint's tokenizer files.

Both sources become one `tokenizers.Tokenizer`. A GGUF carries a byte-level BPE vocabulary
("gpt2": tokens, merges, token types) plus a pre-tokenizer name; we rebuild the pipeline that name
stands for in llama.cpp. The chat template is rendered with jinja2 in a sandbox, set up the way
Hugging Face's `apply_chat_template` sets it up, so prompts match what the model was trained on.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
from tokenizers import AddedToken, Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors

from dflash_bench.engine.errors import CheckpointError

# llama.cpp token types (tokenizer.ggml.token_type).
_CONTROL, _USER_DEFINED = 3, 4

# GGUF `tokenizer.ggml.pre` names whose llama.cpp regex is "\p{N}" then GPT-2's: every digit is
# its own piece, the rest splits like GPT-2 (StarCoder's tokenizer, which SmolLM2 uses).
_DIGITS_THEN_GPT2 = {"smollm", "starcoder", "refact", "codeshell"}
_GPT2 = {"gpt2", "default", "mpt", "olmo"}


class TooManyTokens(ValueError):
    """A text that encodes to more tokens than the caller's limit."""

    def __init__(self, count: int) -> None:
        super().__init__(f"{count} tokens")
        self.count = count


class Tokenizer:
    """Text <-> token ids, special tokens, and the chat template."""

    def __init__(
        self,
        backend: HFTokenizer,
        *,
        eos_ids: tuple[int, ...],
        bos_id: int | None,
        chat_template: str | None,
    ):
        self.backend = backend
        self.eos_ids = eos_ids
        self.bos_id = bos_id
        self.chat_template = chat_template
        self._template: jinja2.Template | None = None
        self._longest: int | None = None

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def special_tokens(self) -> dict[str, int]:
        """Special (control) tokens by text."""
        return {t.content: i for i, t in self.backend.get_added_tokens_decoder().items() if t.special}

    @property
    def bos_token(self) -> str:
        return self.backend.id_to_token(self.bos_id) if self.bos_id is not None else ""

    @property
    def eos_token(self) -> str:
        return self.backend.id_to_token(self.eos_ids[0]) if self.eos_ids else ""

    def encode(self, text: str, add_special_tokens: bool = False, limit: int | None = None) -> list[int]:
        """Token ids of `text`; past `limit` tokens raises TooManyTokens before the ids are built.

        Through `encode_batch`, which releases the GIL while it runs (tokenizers' `encode` holds it
        throughout), so a long text tokenized in a worker thread leaves the server's event loop free."""
        encoding = self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0]
        if limit is not None and len(encoding) > limit:
            raise TooManyTokens(len(encoding))
        return encoding.ids

    @property
    def longest_token(self) -> int:
        """Characters in the longest vocabulary entry (special tokens included). A byte-level entry of
        L characters stands for L bytes, so no text of more than n * longest_token characters encodes to
        n tokens or fewer (unless a normalizer drops characters; the GGUF pipelines have none), and a
        text that long can be refused unread."""
        if self._longest is None:
            self._longest = max(len(t) for t in self.backend.get_vocab(with_added_tokens=True))
        return self._longest

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render `messages` with the model's chat template (extra kwargs reach the template,
        e.g. `enable_thinking`), as Hugging Face renders it; encode the result without specials."""
        if not self.chat_template:
            raise CheckpointError("the tokenizer has no chat template (tokenizer.chat_template / chat_template)")
        if self._template is None:
            self._template = _jinja_env().from_string(self.chat_template)
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            **kwargs,
        )

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any]) -> Tokenizer:
        """Build from a GGUF's `tokenizer.ggml.*` keys (byte-level BPE only)."""
        kind = meta.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise CheckpointError(f"GGUF tokenizer.ggml.model is {kind!r}, expected 'gpt2' (byte-level BPE)")
        pre = meta.get("tokenizer.ggml.pre", "default")
        if pre not in _DIGITS_THEN_GPT2 | _GPT2:
            raise CheckpointError(
                f"GGUF tokenizer.ggml.pre is {pre!r}, expected one of {sorted(_DIGITS_THEN_GPT2 | _GPT2)}"
            )
        tokens = list(meta["tokenizer.ggml.tokens"])
        types = [int(t) for t in meta.get("tokenizer.ggml.token_type", [1] * len(tokens))]
        merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
        vocab = {tok: i for i, tok in enumerate(tokens)}
        backend = HFTokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if pre in _DIGITS_THEN_GPT2:
            backend.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Digits(individual_digits=True), byte_level]
            )
        else:
            backend.pre_tokenizer = byte_level
        backend.decoder = decoders.ByteLevel()
        backend.add_special_tokens(
            [AddedToken(tokens[i], special=True, normalized=False) for i, t in enumerate(types) if t == _CONTROL]
        )
        backend.add_tokens(
            [AddedToken(tokens[i], special=False, normalized=False) for i, t in enumerate(types) if t == _USER_DEFINED]
        )
        bos = _as_int(meta.get("tokenizer.ggml.bos_token_id"))
        if bos is not None and meta.get("tokenizer.ggml.add_bos_token", False):
            backend.post_processor = processors.TemplateProcessing(
                single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A {tokens[bos]} $B", special_tokens=[(tokens[bos], bos)]
            )
        eos_ids = [_as_int(meta.get(k)) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")]
        return cls(
            backend,
            eos_ids=tuple(dict.fromkeys(i for i in eos_ids if i is not None)),
            bos_id=bos,
            chat_template=meta.get("tokenizer.chat_template"),
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Build from a checkpoint directory: tokenizer.json, tokenizer_config.json (special tokens,
        chat_template), chat_template.jinja if present, and the eos ids of config.json and
        generation_config.json."""
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise CheckpointError(f"{path}: no tokenizer.json")
        backend = HFTokenizer.from_file(str(path / "tokenizer.json"))
        tok_cfg = _read_json(path / "tokenizer_config.json")
        template = tok_cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text()

        def token_id(value: Any) -> int | None:
            text = value.get("content") if isinstance(value, dict) else value
            return backend.token_to_id(text) if isinstance(text, str) else None

        eos: list[int] = []
        if (i := token_id(tok_cfg.get("eos_token"))) is not None:
            eos.append(i)
        for name in ("generation_config.json", "config.json"):
            cfg = _read_json(path / name)
            text_cfg = cfg.get("text_config")
            value = cfg.get("eos_token_id", text_cfg.get("eos_token_id") if isinstance(text_cfg, dict) else None)
            eos.extend(value if isinstance(value, list) else [value] if isinstance(value, int) else [])
        return cls(
            backend,
            eos_ids=tuple(dict.fromkeys(eos)),
            bos_id=token_id(tok_cfg.get("bos_token")),
            chat_template=template,
        )


def _as_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: unreadable JSON ({e})") from None
    return data if isinstance(data, dict) else {}


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False) -> str:
    # Hugging Face's tojson: no HTML escaping (jinja's own escapes <, >, & and ').
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _jinja_env() -> jinja2.Environment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env
