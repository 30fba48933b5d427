"""The OpenAI wire format `eft serve` speaks: request models, response and stream-chunk bodies,
server-sent events and error bodies, as the `openai` client reads them.

Only what the CPU engine honours is accepted; a parameter it would silently ignore (n > 1,
logprobs, echo, tools) is a 400 naming it, so a client never mistakes an ignored setting for one
applied. Defaults are OpenAI's: temperature 1 and top_p 1 (sampling; pass temperature 0 for greedy,
deterministic answers), `max_tokens` 16 for completions and, for chat, up to the server's limit.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal, Optional, Union

from openai.types import Completion, CompletionChoice, CompletionUsage, ErrorObject, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk, ChatCompletionMessage
from openai.types.chat.chat_completion import Choice as ChatChoice
from openai.types.chat.chat_completion_chunk import Choice as ChunkChoice
from openai.types.chat.chat_completion_chunk import ChoiceDelta
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

MAX_STOP_SEQUENCES = 4  # as OpenAI allows
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


class RequestError(ValueError):
    """A request the server cannot honour: status, message and the parameter at fault."""

    def __init__(self, message: str, param: Optional[str] = None, status: int = 400,
                 kind: str = "invalid_request_error", code: Optional[str] = None):
        super().__init__(message)
        self.status, self.param, self.kind, self.code = status, param, kind, code


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class SamplingRequest(BaseModel):
    """What both endpoints share."""

    model_config = ConfigDict(extra="ignore")  # unknown fields, as OpenAI's own server, are not errors
    model: str
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    stop: Union[str, list[str], None] = None
    seed: Optional[int] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    n: int = 1
    user: Optional[str] = None

    @field_validator("stop")
    @classmethod
    def check_stop(cls, value):
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences")
        if any(not s for s in stops):
            raise ValueError("a stop sequence is empty")
        return stops

    def check_supported(self) -> None:
        if self.n != 1:
            raise RequestError("only n=1 is supported", param="n")

    def sampling(self, default_max_tokens: int) -> dict:
        return {"max_tokens": self.max_tokens or default_max_tokens,
                "temperature": 1.0 if self.temperature is None else self.temperature,
                "top_p": 1.0 if self.top_p is None else self.top_p,
                "stop": tuple(self.stop or ()), "seed": self.seed}

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # e.g. `name`: passed to the template as apply_chat_template would
    role: Literal[CHAT_ROLES]
    content: Union[str, list[TextPart], None] = None

    def as_template_message(self) -> dict:
        """A message as the chat template takes it: content a string (text parts joined), and
        OpenAI's `developer` role under the name chat templates know, `system`."""
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])
        extra = {k: v for k, v in (self.model_extra or {}).items() if v is not None}
        return {**extra, "role": "system" if self.role == "developer" else self.role, "content": content}


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)  # the newer name for max_tokens
    logprobs: Optional[bool] = None
    tools: Optional[list[Any]] = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.logprobs:
            raise RequestError("logprobs are not supported", param="logprobs")
        if self.tools:
            raise RequestError("tools are not supported", param="tools")

    def sampling(self, default_max_tokens: int) -> dict:
        return super().sampling(self.max_completion_tokens or default_max_tokens)


class CompletionRequest(SamplingRequest):
    prompt: Union[str, list[str]]
    echo: bool = False
    logprobs: Optional[int] = None
    suffix: Optional[str] = None

    def check_supported(self) -> None:
        super().check_supported()
        for name in ("echo", "logprobs", "suffix"):
            if getattr(self, name):
                raise RequestError(f"{name} is not supported", param=name)
        if isinstance(self.prompt, list) and len(self.prompt) != 1:
            raise RequestError("give one prompt (a string, or a list of one string)", param="prompt")

    @property
    def prompt_text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]


def parse_request(model: type[SamplingRequest], body: Any) -> SamplingRequest:
    """A JSON body → the request model, or RequestError naming the first bad field."""
    try:
        request = model.model_validate(body)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        raise RequestError(f"{where}: {first['msg']}" if where else first["msg"], param=where or None) from None
    request.check_supported()
    return request


# -- responses --------------------------------------------------------------------------------
# Built from the `openai` package's own models (what its client parses), validated as they are
# built, so the wire schema cannot drift from what clients read. `to_dict()` keeps the fields set
# here and nothing else: the bodies are the ones this server has always sent.


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> CompletionUsage:
    return CompletionUsage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                           total_tokens=prompt_tokens + completion_tokens)


def chat_response(rid: str, model: str, text: str, finish_reason: str, used: CompletionUsage) -> dict:
    choice = ChatChoice(index=0, message=ChatCompletionMessage(role="assistant", content=text), logprobs=None,
                        finish_reason=finish_reason)
    return ChatCompletion(id=rid, object="chat.completion", created=int(time.time()), model=model, choices=[choice],
                          usage=used).to_dict(mode="json")


def chat_chunk(rid: str, model: str, delta: dict, finish_reason: Optional[str] = None,
               used: Optional[CompletionUsage] = None) -> dict:
    """One streamed piece: a delta (role first, then content), the last one with finish_reason; with
    stream_options.include_usage, a final chunk of no choices carries the usage."""
    choices = [] if used is not None else [ChunkChoice(index=0, delta=ChoiceDelta(**delta), logprobs=None,
                                                       finish_reason=finish_reason)]
    return ChatCompletionChunk(id=rid, object="chat.completion.chunk", created=int(time.time()), model=model,
                               choices=choices, **({"usage": used} if used is not None else {})).to_dict(mode="json")


def completion_response(rid: str, model: str, text: str, finish_reason: str, used: CompletionUsage) -> dict:
    choice = CompletionChoice(index=0, text=text, logprobs=None, finish_reason=finish_reason)
    return Completion(id=rid, object="text_completion", created=int(time.time()), model=model, choices=[choice],
                      usage=used).to_dict(mode="json")


def completion_chunk(rid: str, model: str, text: str, finish_reason: Optional[str] = None,
                     used: Optional[CompletionUsage] = None) -> dict:
    """A streamed completion is a series of `Completion`s, as OpenAI's is."""
    if used is not None:
        choices = []
    elif finish_reason is None:
        # OpenAI streams `finish_reason: null` until the last piece, which the type (written for
        # the whole answer) does not allow; its client reads stream chunks without validating.
        choices = [CompletionChoice.model_construct(index=0, text=text, logprobs=None, finish_reason=None)]
    else:
        choices = [CompletionChoice(index=0, text=text, logprobs=None, finish_reason=finish_reason)]
    return Completion(id=rid, object="text_completion", created=int(time.time()), model=model, choices=choices,
                      **({"usage": used} if used is not None else {})).to_dict(mode="json")


def models_response(model: str, created: int, root: str) -> dict:
    """GET /v1/models: a list of one `Model` (`root`, the export's URI, is an extra field OpenAI's
    type keeps); the list's envelope has no type of its own in the package."""
    entry = Model(id=model, object="model", created=created, owned_by="eft", root=root)
    return {"object": "list", "data": [entry.to_dict(mode="json")]}


def error_body(message: str, kind: str = "invalid_request_error", param: Optional[str] = None,
               code: Optional[str] = None) -> dict:
    return {"error": ErrorObject(message=message, type=kind, param=param, code=code).to_dict(mode="json")}


def sse(data: Union[dict, str]) -> str:
    """One server-sent event; the stream ends with the literal `[DONE]`, as OpenAI's does."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


SSE_DONE = sse("[DONE]")
