"""Request bodies of the OpenAI-compatible endpoints (pydantic), and the check for fields we do not serve.

Types and ranges are checked here (a violation is a 422 naming the field). Top-level fields the models do not
declare are kept (``extra="allow"``) so that :func:`unsupported_fields` can answer a 400 that names them: a
robot controller asking for ``logprobs`` or ``n: 3`` must hear that it did not get them rather than be silently
ignored. Fields with their neutral value (``n: 1``, ``logprobs: false``, ...) are accepted.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from edgespec.config import MAX_DRAFT_TOKENS

# ---- pieces ------------------------------------------------------------------------------------------------


class StrictModel(BaseModel):
    """Strict types everywhere: ``"max_tokens": "10"``, ``"strict": 0`` or ``"prompt": [false]`` are 422s naming the
    field, not silently read as 10, False or token 0 (a robot controller's bug should surface, not be guessed at)."""

    model_config = ConfigDict(strict=True)


class ImageURL(StrictModel):
    """``image_url`` of an image part: a ``data:image/png|jpeg|webp;base64,...`` URL (remote URLs are refused)."""

    model_config = ConfigDict(extra="allow")
    url: str = Field(examples=["data:image/jpeg;base64,/9j/4AAQ..."])
    detail: str | None = None


class ContentPart(StrictModel):
    """One part of a message's content list: ``{"type": "text", "text": ...}`` or, for a vision-language model,
    ``{"type": "image_url", "image_url": {"url": "data:..."}}``."""

    model_config = ConfigDict(extra="allow")
    type: str = Field(examples=["text"])
    text: str | None = Field(None, examples=["Where is the cup?"])
    image_url: ImageURL | None = None


class FunctionCall(StrictModel):
    """``function`` of an assistant tool call: ``arguments`` is a JSON object as text."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=128)
    arguments: str = "{}"


class AssistantToolCall(StrictModel):
    """A tool call the assistant made in an earlier turn (sent back in the history)."""

    model_config = ConfigDict(extra="forbid")
    id: str | None = Field(None, max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(StrictModel):
    """A chat turn. ``developer`` is treated as ``system``; ``tool`` carries a tool's result."""

    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[AssistantToolCall] | None = None
    tool_call_id: str | None = Field(None, max_length=256)
    reasoning_content: str | None = None


class FunctionSpec(StrictModel):
    """A callable function: ``parameters`` is the JSON schema of its arguments object."""

    model_config = ConfigDict(extra="allow")
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(StrictModel):
    """One entry of ``tools``."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(StrictModel):
    model_config = ConfigDict(extra="forbid")
    name: str


class NamedToolChoice(StrictModel):
    """``tool_choice: {"type": "function", "function": {"name": ...}}``: call exactly this function."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(StrictModel):
    """``stream_options``: ``include_usage`` adds a last chunk with ``choices: []`` and the usage."""

    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class TextFormat(StrictModel):
    type: Literal["text"]


class JsonObjectFormat(StrictModel):
    type: Literal["json_object"]


class JsonSchemaSpec(StrictModel):
    """``response_format.json_schema``: the schema the output must validate against."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)
    name: str = Field("response", max_length=64)
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class JsonSchemaFormat(StrictModel):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")]


class ChatTemplateKwargs(StrictModel):
    """Variables passed to the chat template (vLLM's ``chat_template_kwargs``); only the thinking switch."""

    model_config = ConfigDict(extra="forbid")
    enable_thinking: bool | None = None


class EdgespecOptions(StrictModel):
    """edgespec's per-request extension block (``extra_body={"edgespec": {...}}`` in the openai SDK)."""

    model_config = ConfigDict(extra="forbid")
    num_draft_tokens: int | None = Field(
        None, ge=0, le=MAX_DRAFT_TOKENS, description="drafts per cycle for this request (<= the server's K); 0 = none")


StopList = Annotated[list[str], Field(max_length=4)]
StopField = Annotated[str | StopList | None, Field(None, description="a stop string or up to 4")]


class CommonFields(StrictModel):
    """Fields shared by chat and text completions."""

    model_config = ConfigDict(extra="allow")
    model: str | None = Field(None, description="must name the served model when given")
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=5.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=0, description="vLLM-style extension; 0 = off")
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)
    stop: StopField
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    edgespec: EdgespecOptions | None = None
    # Client identity for the prefix cache (reused only within one key); see protocol.client_key.
    prompt_cache_key: str | None = Field(None, max_length=256)
    user: str | None = Field(None, max_length=256)


# ---- endpoints ---------------------------------------------------------------------------------------------


class ChatCompletionRequest(CommonFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    chat_template_kwargs: ChatTemplateKwargs | None = None
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None


class CompletionRequest(CommonFields):
    """``POST /v1/completions``: a raw prompt (text, a one-element list of text, or token ids)."""

    prompt: str | list[str] | list[int] = Field(description="text, [text] or token ids")


# ---- fields we do not serve --------------------------------------------------------------------------------

# Accepted and ignored whatever their value (bookkeeping fields that change nothing about the answer).
_IGNORED = frozenset({"metadata", "store", "service_tier", "parallel_tool_calls", "safety_identifier"})
# Accepted only with their neutral value.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "n": (1,),
    "best_of": (1,),
    "echo": (False,),
    "logprobs": (False, 0),
    "top_logprobs": (0,),
    "presence_penalty": (0,),
    "frequency_penalty": (0,),
    "repetition_penalty": (1,),
    "function_call": ("none",),
    "modalities": (["text"],),
    "suffix": ("",),
}


def unsupported_fields(req: BaseModel) -> list[str]:
    """Names of undeclared fields of ``req`` that ask for something edgespec does not do, sorted."""
    bad = []
    for name, value in (req.model_extra or {}).items():
        if name in _IGNORED or value is None or value == [] or value == {}:
            continue
        if name in _NEUTRAL and value in _NEUTRAL[name]:
            continue
        bad.append(name)
    return sorted(bad)
