"""Refusals and load errors: each is one line naming the field and the values involved."""

from __future__ import annotations


class DFlashBenchError(Exception):
    """Base for errors reported to the user as one line, with a non-zero exit."""

    def line(self) -> str:
        return f"{type(self).__name__}: {self}"


class BadTargetConfig(DFlashBenchError):
    """A target config.json (or GGUF metadata) is missing a field or holds a malformed one."""


class BadDraftConfig(DFlashBenchError):
    """A drafter config.json is missing a field or holds a malformed one."""


class DraftForAnotherTarget(DFlashBenchError):
    """The drafter was trained for another target: taps past its layers, another hidden size or vocab."""


class NotStockDFlash2(DFlashBenchError):
    """A DFlash2 layout outside what the engine runs."""


class CheckpointError(DFlashBenchError):
    """A checkpoint's files are missing, unreadable, or hold tensors that do not match the config."""


class ContextExceeded(ValueError):
    """A prompt plus max_tokens past the window: refused before it takes a lane."""

    def __init__(self, prompt_tokens: int, max_tokens: int, context: int):
        self.prompt_tokens, self.max_tokens, self.context = prompt_tokens, max_tokens, context
        super().__init__(
            f"prompt ({prompt_tokens} tokens) plus max_tokens ({max_tokens}) is {prompt_tokens + max_tokens}, "
            f"past the context window of {context}"
        )
