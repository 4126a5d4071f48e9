"""The default model's tokenizer, rebuilt from GGUF metadata, round-trips text and renders chats."""

from __future__ import annotations

import json

import jinja2
import pytest

from dflash_bench.engine import gguf
from dflash_bench.engine.checkpoint import default_model_path
from dflash_bench.engine.errors import CheckpointError
from dflash_bench.engine.tokenizer import Tokenizer

LIGHTHOUSE = " ".join(["A lighthouse keeper writes in the log as the boats cross the bay."] * 12)

ROUND_TRIP = [
    LIGHTHOUSE,
    "def square(x):\n    return x ** 2  # 12345\n\n\tprint(square(3.14159))\n",
    "Numbers: 0 7 42 2024 -3.5e10 1,000,000 and 007.",
    "Unicode: héllo wörld, naïve café, 日本語, Ελληνικά, emoji 🚀🙂, — “quotes”.",
    "   leading spaces, trailing spaces   \n\n\nand blank lines\r\n",
    "<|im_start|>user\nhi<|im_end|>",
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_gguf_metadata(gguf.read_header(default_model_path()).metadata)


@pytest.mark.parametrize("text", ROUND_TRIP)
def test_text_round_trips_through_encode_and_decode(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_common_words_are_single_tokens(tok):
    for word in ["The", " lighthouse", " keeper", " the", " boats", " return", "Hello"]:
        assert len(tok.encode(word)) == 1, word
    assert len(tok.encode(LIGHTHOUSE)) == 12 * 14  # 13 words and the full stop, per sentence


def test_digits_are_split_one_by_one_as_in_smollm2(tok):
    pieces = [tok.backend.id_to_token(i) for i in tok.encode(" 2024 x42")]
    assert pieces == ["Ġ", "2", "0", "2", "4", "Ġx", "4", "2"]


def test_special_tokens_and_ids(tok):
    assert tok.encode("<|im_start|>") == [1]
    assert tok.encode("<|im_end|>") == [2]
    assert tok.eos_ids == (2,)
    assert tok.bos_id == 1
    assert tok.special_tokens["<|endoftext|>"] == 0
    assert tok.encode("hi", add_special_tokens=True) == tok.encode("hi")  # add_bos_token is false
    assert tok.decode(tok.encode("a<|im_end|>"), skip_special_tokens=True) == "a"


def test_chat_template_renders_a_two_message_chat(tok):
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"}],
        add_generation_prompt=False,
    )
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
    )
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi there"}])
    assert prompt.endswith("<|im_start|>assistant\n")
    assert tok.encode(prompt).count(1) == 3  # three <|im_start|> markers, each one token


def _tokenizer_dir(tmp_path, tok: Tokenizer, template: str, **tok_cfg):
    tok.backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, **tok_cfg}))
    return tmp_path


def test_tokenizer_dir_gives_the_same_ids_and_its_own_template(tmp_path, tok):
    template = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] | tojson }}{% endfor %}{{ bos_token }}"
    path = _tokenizer_dir(tmp_path, tok, template, bos_token="<|im_start|>", eos_token="<|im_end|>")
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    from_dir = Tokenizer.from_dir(path)
    for text in ROUND_TRIP:
        assert from_dir.encode(text) == tok.encode(text)
    assert from_dir.eos_ids == (2, 0)
    assert from_dir.bos_id == 1
    assert from_dir.apply_chat_template([{"role": "user", "content": "<é>"}]) == '[user]"<é>"<|im_start|>'


def test_templates_can_raise_and_a_missing_template_is_refused(tmp_path, tok):
    path = _tokenizer_dir(tmp_path, tok, "{{ raise_exception('only user turns') }}")
    with pytest.raises(jinja2.exceptions.TemplateError, match="only user turns"):
        Tokenizer.from_dir(path).apply_chat_template([{"role": "user", "content": "x"}])
    bare = Tokenizer(tok.backend, eos_ids=(2,), bos_id=None, chat_template=None)
    with pytest.raises(CheckpointError, match="no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "x"}])


def test_only_byte_level_bpe_gguf_vocabularies_are_accepted():
    with pytest.raises(CheckpointError, match="tokenizer.ggml.model is 'llama'"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["a"]})
