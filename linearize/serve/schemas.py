"""The bodies of the OpenAI-compatible API: the part of OpenAI's completions and chat completions that
`linearize serve` implements, as pydantic models.

Requests validate strictly (a number sent as a string is refused, as OpenAI refuses it). Fields they do
not name are ignored, since OpenAI's clients send some that change nothing here (`user`, ...), but the
ones that would change the answer and are not implemented (`UNSUPPORTED`) are refused when set, so
that a client never gets an answer to a question it did not ask.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from ..cli_args import lone_surrogate_at

MAX_STOP_STRINGS = 16
# The most alternatives a token's log-probabilities list: vLLM's bound (`max_logprobs`) for completions'
# `logprobs`, and OpenAI's for chat's `top_logprobs`.
MAX_LOGPROBS = 20
# What torch's generators take as a seed.
SEED_MIN, SEED_END = -(2**63), 2**64

# Fields of OpenAI's API that this server does not implement, with the values that ask for nothing
# (sent by some clients by default); any other value is refused.
UNSUPPORTED: dict[str, tuple] = {
    "best_of": (1,),
    "echo": (False,),  # chat's (vLLM's); completions take it
    "top_logprobs": (0,),  # completions' (chat takes it)
    "suffix": ("",),
    "logit_bias": ({},),
    "presence_penalty": (0,),
    "frequency_penalty": (0,),
    "tools": ([],),
    "functions": ([],),
    "response_format": ({"type": "text"},),
}

FinishReason = Literal["stop", "length"]


def _not_none(value) -> bool:
    return value is None


def _same(value, harmless) -> bool:
    # A bool is an int to ==, but logprobs=0 asks for log-probabilities where logprobs=false does not.
    if isinstance(value, bool) or isinstance(harmless, bool):
        return value is harmless
    return value == harmless


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


def _lone_surrogate(value, path: tuple = ()) -> tuple[str, str, int] | None:
    """The first string in a JSON value that is no Unicode text: (its path, as `a.0.b`, the lone UTF-16
    surrogate it holds, the character's index); None if every string is text. JSON's `\\udXXX` escapes
    can spell half a surrogate pair (`lone_surrogate_at`)."""
    if isinstance(value, str):
        index = lone_surrogate_at(value)
        return None if index is None else (".".join(str(p) for p in path), value[index], index)
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        found = _lone_surrogate(item, (*path, key))
        if found is not None:
            return found
    return None


class StreamOptions(_Body):
    include_usage: bool = False


class _GenerationRequest(_Body):
    """The fields completions and chat completions share."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2, allow_inf_nan=False)  # OpenAI's default; 0 is greedy
    top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    stop: list[str] = Field(default_factory=list)
    seed: int | None = Field(None, ge=SEED_MIN, lt=SEED_END)
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # vLLM's: generate past the end-of-sequence token (benchmarks)

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, body):
        found = _lone_surrogate(body)
        if found is not None:
            param, char, index = found
            raise PydanticCustomError("lone_surrogate", "character {index} is a lone UTF-16 surrogate (\\u{code}), "
                                      "which is no Unicode text: send valid UTF-8",
                                      {"param": param, "index": index, "code": f"{ord(char):04x}"})
        return body

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_strings(cls, value):
        if value is None:
            return []
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
            raise PydanticCustomError("stop_type", "stop must be a string or a list of strings")
        if len(value) > MAX_STOP_STRINGS:
            raise PydanticCustomError("stop_count", "stop takes at most {most} strings, got {got}",
                                      {"most": MAX_STOP_STRINGS, "got": len(value)})
        if "" in value:
            raise PydanticCustomError("stop_empty", "stop strings must not be empty")
        return value

    @field_validator("n")
    @classmethod
    def _one_choice(cls, value: int) -> int:
        if value != 1:
            raise PydanticCustomError("n_unsupported", "n must be 1: this server returns one choice a request")
        return value

    @model_validator(mode="after")
    def _refuse_unsupported(self):
        for name, harmless in UNSUPPORTED.items():
            value = (self.model_extra or {}).get(name)
            if value is not None and not any(_same(value, h) for h in harmless):
                raise PydanticCustomError("unsupported", "{param} is not supported by this server", {"param": name})
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def _no_streamed_logprobs(self, asked: bool):
        if asked and self.stream:
            raise PydanticCustomError("stream_logprobs", "logprobs cannot be streamed by this server: send "
                                      "stream false to get them", {"param": "logprobs"})
        return self


class CompletionRequest(_GenerationRequest):
    # A string or token ids, or a list of several of either: one choice each, in order (OpenAI's and vLLM's
    # batch; lm-eval's `local-completions` sends `[[ids], ...]`, `batch_size` lists at a time).
    prompt: list[str | list[int]]
    max_tokens: int | None = Field(None, ge=0)  # 0 with `echo`: the prompt's log-probabilities alone
    # The log-probability of each token, and of this many most likely alternatives; None: none.
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False  # the prompt before the text (and, with `logprobs`, its tokens' log-probabilities)

    @model_validator(mode="after")
    def _logprobs_and_echo(self):
        if self.max_tokens == 0 and not self.echo:
            raise PydanticCustomError("nothing_asked", "max_tokens is 0, which asks for nothing without echo",
                                      {"param": "max_tokens"})
        if self.stream and len(self.prompt) > 1:
            raise PydanticCustomError("stream_batch", "a batch of {count} prompts cannot be streamed by this "
                                      "server: send them one a request, or stream false",
                                      {"param": "stream", "count": len(self.prompt)})
        return self._no_streamed_logprobs(self.logprobs is not None)

    @field_validator("prompt", mode="plain")
    @classmethod
    def _prompts(cls, value) -> list[str | list[int]]:
        batch = isinstance(value, list) and bool(value) and all(isinstance(p, str | list) for p in value)
        prompts = value if batch else [value]
        for prompt in prompts:
            if prompt == "" or prompt == []:
                raise PydanticCustomError("prompt_empty", "prompt is empty: give the text to continue")
            # `type(...) is int`: a bool is an int to isinstance, and true is no token id.
            if not (isinstance(prompt, str) or (isinstance(prompt, list) and all(type(t) is int for t in prompt))):
                raise PydanticCustomError("prompt_type", "prompt must be a string, a list of token ids, or a "
                                          "list of several of those")
        return prompts


class ContentPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name for max_tokens

    @property
    def requested_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    logprobs: bool = False  # each generated token's log-probability
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # and this many most likely alternatives'

    @model_validator(mode="after")
    def _logprobs_asked(self):
        if self.top_logprobs and not self.logprobs:
            raise PydanticCustomError("top_logprobs_alone", "top_logprobs needs logprobs true",
                                      {"param": "top_logprobs"})
        return self._no_streamed_logprobs(self.logprobs)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy completions' log-probabilities: one entry a token, the first prompt token's None."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]  # the most likely tokens' texts, and the chosen one's
    text_offset: list[int]  # where each token's text starts in the concatenation of `tokens`


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None


class CompletionResponse(BaseModel):
    """A whole completion, and also each chunk of a streamed one (OpenAI streams the same shape)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None  # the UTF-8 bytes of `token`


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    # Left out when unset, as OpenAI's chunks leave them out: the last chunk's delta is {}.
    role: Literal["assistant"] | None = Field(None, exclude_if=_not_none)
    content: str | None = Field(None, exclude_if=_not_none)


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "linearize"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail
