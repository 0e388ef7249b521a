"""Translation between OpenAI request/response bodies and the engine's ``Request`` / ``Completion``.

Everything here is pure (no I/O, no engine calls), so the shapes are easy to test and to read in one place.
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from edgespec.engine import Completion, Request
from edgespec.errors import RequestError
from edgespec.loading.images import ImageRef
from edgespec.plan import SamplingDefaults
from edgespec.speculative.sampling import GREEDY_BELOW, SamplingParams

from .errors import APIError
from .schemas import ChatCompletionRequest, ChatMessage, CommonFields, CompletionRequest, ContentPart
from .tools import Delta, OutputSplitter


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


# ---- requests ----------------------------------------------------------------------------------------------


def _tool_arguments(text: str, param: str) -> dict[str, Any]:
    try:
        args = json.loads(text) if text.strip() else {}
    except ValueError:
        raise APIError(400, f"{param} is not valid JSON", param=param, code="invalid_tool_call") from None
    if not isinstance(args, dict):
        raise APIError(400, f"{param} must be a JSON object", param=param, code="invalid_tool_call")
    return args


def _content(content: list[ContentPart], i: int, images: list[ImageRef]) -> str | list[dict[str, Any]]:
    """A content list as the template takes it: the text parts joined, or, with images, text and
    ``{"type": "image"}`` parts in order (the image itself goes to ``images``, decoded by the engine)."""
    pieces: list[str | dict[str, Any]] = []
    for j, part in enumerate(content):
        where = f"messages[{i}].content[{j}]"
        if part.type == "image_url":
            if part.image_url is None:
                raise APIError(400, "an image_url part needs image_url.url", param=where, code="invalid_image")
            images.append(ImageRef(part.image_url.url, where))
            pieces.append({"type": "image"})
        elif part.type == "text" and part.text is not None:
            pieces.append(part.text)
        else:
            raise APIError(400, f"content part of type {part.type!r} is not supported (text and image_url)",
                           param=where, code="unsupported_content")
    if all(isinstance(p, str) for p in pieces):
        return "".join(p for p in pieces if isinstance(p, str))
    return [{"type": "text", "text": p} if isinstance(p, str) else p for p in pieces]


def chat_messages(messages: list[ChatMessage], images: list[ImageRef] | None = None) -> list[dict[str, Any]]:
    """Messages as the chat template expects them: role + string content (text parts joined; with image parts, a
    list of text and image parts, each image appended to ``images``); assistant tool calls with their arguments as
    objects (Qwen templates iterate them), tool results with their call id."""
    out = []
    found: list[ImageRef] = [] if images is None else images
    for i, m in enumerate(messages):
        content = m.content
        if content is None:
            text: str | list[dict[str, Any]] = ""
        elif isinstance(content, str):
            text = content
        else:
            before = len(found)
            text = _content(content, i, found)
            if images is None and len(found) > before:
                raise APIError(400, "image parts are only served on chat completions", param=f"messages[{i}]",
                               code="unsupported_content")
        role = "system" if m.role == "developer" else m.role
        msg: dict[str, Any] = {"role": role, "content": text}
        if m.name:
            msg["name"] = m.name
        if m.tool_calls:
            if m.role != "assistant":
                raise APIError(400, "only assistant messages carry tool_calls", param=f"messages[{i}].tool_calls",
                               code="invalid_request")
            msg["tool_calls"] = [
                {"id": c.id or f"call_{i}_{j}", "type": "function",
                 "function": {"name": c.function.name,
                              "arguments": _tool_arguments(c.function.arguments,
                                                           f"messages[{i}].tool_calls[{j}].function.arguments")}}
                for j, c in enumerate(m.tool_calls)]
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if m.reasoning_content:
            msg["reasoning_content"] = m.reasoning_content
        out.append(msg)
    return out


@dataclass
class ToolPlan:
    """What a chat request asks of tools: render them, parse calls out of the output, force a call."""

    specs: list[dict[str, Any]]                 # the tools as the template gets them (OpenAI shape)
    by_name: dict[str, dict[str, Any]]          # function name -> {"name", "description", "parameters"}
    parse: bool                                 # parse <tool_call> blocks into tool_calls
    forced: list[dict[str, Any]] | None         # required / named: the calls the grammar allows


def tool_plan(body: ChatCompletionRequest) -> ToolPlan | None:
    """None without tools; a 400 for a tool_choice that names no declared tool or asks for a call without tools."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none", "auto"):
            raise APIError(400, "tool_choice asks for a tool call but no tools are given", param="tool_choice",
                           code="invalid_request")
        return None
    by_name: dict[str, dict[str, Any]] = {}
    for i, t in enumerate(body.tools):
        fn = t.function.model_dump(exclude_none=True)
        params = fn.get("parameters")
        if params is not None and params.get("type", "object") != "object":
            raise APIError(400, "function parameters must be a JSON schema of type object",
                           param=f"tools[{i}].function.parameters", code="invalid_schema")
        if fn["name"] in by_name:
            raise APIError(400, f"tool {fn['name']!r} is declared twice", param=f"tools[{i}].function.name",
                           code="invalid_request")
        by_name[fn["name"]] = fn
    specs = [t.model_dump(exclude_none=True) for t in body.tools]
    forced = None
    if choice == "required":
        forced = list(by_name.values())
    elif choice is not None and not isinstance(choice, str):
        name = choice.function.name
        if name not in by_name:
            raise APIError(400, f"tool_choice names {name!r}, which is not in tools", param="tool_choice",
                           code="invalid_request")
        forced = [by_name[name]]
    return ToolPlan(specs, by_name, parse=choice != "none", forced=forced)


def parallel_calls(body: ChatCompletionRequest | CompletionRequest) -> bool:
    """True when ``tool_choice: "required"`` may give several calls: only with ``parallel_tool_calls: true`` sent
    (without it a forced call is exactly one; a weak model would otherwise repeat it until max_tokens)."""
    if not isinstance(body, ChatCompletionRequest) or body.tool_choice != "required":
        return False
    return (body.model_extra or {}).get("parallel_tool_calls") is True


def _stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def sampling_params(body: CommonFields, defaults: SamplingDefaults) -> SamplingParams:
    """Request values over server defaults; an out-of-range combination is a 400."""
    temperature = defaults.temperature if body.temperature is None else body.temperature
    if temperature < GREEDY_BELOW:
        temperature = 0.0
    try:
        return SamplingParams(
            temperature=temperature,
            top_p=defaults.top_p if body.top_p is None else body.top_p,
            top_k=defaults.top_k if body.top_k is None else body.top_k,
            seed=defaults.seed if body.seed is None else body.seed)
    except RequestError as exc:
        raise APIError(400, str(exc), code="invalid_sampling") from None


def bounded_max_tokens(body: ChatCompletionRequest | CompletionRequest, defaults: SamplingDefaults,
                       prompt_tokens: int, max_len: int) -> int:
    """``max_tokens`` within the context left after the prompt: an explicit value that does not fit is a 400 (as
    OpenAI and vLLM answer), the server default is cut to fit. Without this bound one request asking for 10**9
    tokens would hold the engine until its timeout."""
    room = max_len - prompt_tokens
    asked = (body.max_completion_tokens if isinstance(body, ChatCompletionRequest) else None) or body.max_tokens
    if asked is None:
        return min(defaults.max_tokens, room)
    if asked > room:
        raise APIError(400, f"max_tokens {asked} does not fit the context: the prompt of {prompt_tokens} tokens "
                       f"leaves {room} of max_seq_len {max_len}; ask for at most {room}", param="max_tokens",
                       code="context_length_exceeded")
    return asked


def client_key(tenant: str, host: str | None, body: CommonFields) -> str:
    """Whose prompt this is, for the prefix cache (reused only within one key): the tenant (its API key, see
    serving.tenants) and the client's host, with OpenAI's ``prompt_cache_key`` or, failing that, ``user``. A tenant
    never shares a key with another, whatever ``user`` it sends. Hashed, so no secret sits in the engine."""
    tag = body.prompt_cache_key if body.prompt_cache_key is not None else body.user
    raw = json.dumps([tenant, host or "", tag or ""])
    return hashlib.sha256(raw.encode("utf-8", "surrogatepass")).hexdigest()


def engine_request(body: ChatCompletionRequest | CompletionRequest, defaults: SamplingDefaults,
                   vocab_size: int) -> Request:
    """The engine request for a chat or completion body (prompt not yet tokenised, no constraint yet)."""
    sampling = sampling_params(body, defaults)
    num_draft = body.edgespec.num_draft_tokens if body.edgespec is not None else None
    stop = _stop_list(body.stop)
    if isinstance(body, ChatCompletionRequest):
        max_tokens = body.max_completion_tokens or body.max_tokens or defaults.max_tokens
        thinking = body.chat_template_kwargs.enable_thinking if body.chat_template_kwargs else None
        plan = tool_plan(body)
        images: list[ImageRef] = []
        return Request(messages=chat_messages(body.messages, images), max_tokens=max_tokens, sampling=sampling,
                       stop=stop, enable_thinking=thinking, num_draft_tokens=num_draft,
                       tools=plan.specs if plan is not None else None, images=images)
    max_tokens = body.max_tokens or defaults.max_tokens
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, int) for p in prompt):
        bad = [p for p in prompt if not 0 <= p < vocab_size]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})",
                           param="prompt", code="invalid_token_id")
        return Request(prompt_ids=list(prompt), max_tokens=max_tokens, sampling=sampling, stop=stop,
                       num_draft_tokens=num_draft)
    if isinstance(prompt, list):
        if len(prompt) != 1:
            raise APIError(400, f"prompt lists of {len(prompt)} strings are not supported (batch 1: send "
                           "one)", param="prompt", code="unsupported_batch")
        prompt = prompt[0]
    return Request(prompt=str(prompt), max_tokens=max_tokens, sampling=sampling, stop=stop,
                   num_draft_tokens=num_draft)


# ---- responses ---------------------------------------------------------------------------------------------


def finish_reason(completion: Completion, timed_out: bool, tool_calls: bool = False) -> str:
    """OpenAI finish reason: a deadline hit mid-generation reads as ``length`` (the text was cut short); an answer
    that ended with tool calls reads ``tool_calls``."""
    if timed_out or completion.finish_reason == "length":
        return "length"
    return "tool_calls" if tool_calls else "stop"


def usage(completion: Completion) -> dict[str, Any]:
    return {
        "prompt_tokens": completion.prompt_tokens,
        "completion_tokens": completion.completion_tokens,
        "total_tokens": completion.prompt_tokens + completion.completion_tokens,
        "completion_tokens_details": {"reasoning_tokens": completion.reasoning_tokens},
        "prompt_tokens_details": {"cached_tokens": completion.cached_tokens},
    }


def telemetry(completion: Completion, *, queue_ms: float, timed_out: bool) -> dict[str, Any]:
    """The ``edgespec`` block: drafter, acceptance and timing of this request."""
    t = completion.telemetry
    stages = {k: round(v, 3) for k, v in t.stage_ms.items()}
    return {
        "drafter": t.drafter,
        "cycles": t.cycles,
        "drafts": t.drafts,
        "draft_tokens": t.draft_tokens,
        "accepted_tokens": t.accepted_tokens,
        "acceptance_length": round(t.acceptance_length, 4),
        "acceptance_rate": round(t.acceptance_rate, 4),
        "accepted_per_pos": list(t.accepted_per_pos),
        "per_position_rate": [round(x, 4) for x in t.per_position_rate],
        "prefill_ms": round(t.stage_ms.get("prefill", 0.0), 3),
        "cached_tokens": completion.cached_tokens,
        "decode_ms": round(t.decode_ms, 3),
        "decode_tok_s": round(t.decode_tok_s, 2),
        "queue_ms": round(queue_ms, 3),
        "stage_ms": stages,
        "timed_out": timed_out,
        "energy": energy(completion),
        **({"vision": t.vision} if t.vision else {}),
    }


def energy(completion: Completion) -> dict[str, Any] | None:
    """Device energy of the generation (None without a meter, e.g. on CPU): joules, joules per generated token and
    average watts."""
    e = completion.energy
    if e is None:
        return None
    per_token = e.per_token(completion.completion_tokens)
    return {"joules": round(e.joules, 4), "joules_per_token": None if per_token is None else round(per_token, 5),
            "avg_watts": round(e.watts, 2), "seconds": round(e.seconds, 4)}


def _response(rid: str, created: int, model: str, obj: str, content: dict[str, Any], completion: Completion,
              extra: dict[str, Any], timed_out: bool, tool_calls: bool = False) -> dict[str, Any]:
    """The envelope chat and text completions share; ``content`` is the choice's message or text field."""
    return {
        "id": rid,
        "object": obj,
        "created": created,
        "model": model,
        "choices": [{"index": 0, **content, "logprobs": None,
                     "finish_reason": finish_reason(completion, timed_out, tool_calls)}],
        "usage": usage(completion),
        "edgespec": extra,
    }


def chat_message(split: OutputSplitter) -> dict[str, Any]:
    """The assistant message of a finished chat answer split into content, reasoning and tool calls."""
    content = "".join(split.content)
    msg: dict[str, Any] = {"role": "assistant", "content": content if content or not split.calls else None}
    if split.reasoning:
        msg["reasoning_content"] = "".join(split.reasoning)
    if split.calls:
        msg["tool_calls"] = [c.to_openai() for c in split.calls]
    return msg


def chat_response(rid: str, created: int, model: str, completion: Completion, extra: dict[str, Any],
                  timed_out: bool, split: OutputSplitter) -> dict[str, Any]:
    split.feed(completion.text)
    split.finish()
    return _response(rid, created, model, "chat.completion", {"message": chat_message(split)}, completion, extra,
                     timed_out, tool_calls=bool(split.calls))


def text_response(rid: str, created: int, model: str, completion: Completion, extra: dict[str, Any],
                  timed_out: bool) -> dict[str, Any]:
    return _response(rid, created, model, "text_completion", {"text": completion.text}, completion, extra,
                     timed_out)


class ChunkMaker:
    """Builds the SSE chunks of one streamed response (chat or text completion)."""

    def __init__(self, chat: bool, rid: str, created: int, model: str, include_usage: bool) -> None:
        self.chat, self.rid, self.created, self.model = chat, rid, created, model
        self.include_usage = include_usage
        self.n_calls = 0

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        out: dict[str, Any] = {"id": self.rid, "object": kind, "created": self.created, "model": self.model,
                               "choices": choices}
        if self.include_usage:
            out["usage"] = None
        out.update(extra)
        return out

    def _choice(self, text: str | None, finish: str | None, role: bool = False) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}

    def first(self) -> dict[str, Any] | None:
        """Chat streams open with the assistant role (and empty content), as OpenAI's do."""
        return self._chunk([self._choice("", None, role=True)]) if self.chat else None

    def text(self, piece: str) -> dict[str, Any]:
        return self._chunk([self._choice(piece, None)])

    def deltas(self, deltas: list[Delta]) -> list[dict[str, Any]]:
        """Chat chunks for split output: reasoning_content, content, or one whole tool call per chunk (OpenAI's
        tool-call delta shape: index, id, type, function name and arguments)."""
        out = []
        for d in deltas:
            if d.tool_call is not None:
                call = d.tool_call.to_openai()
                call["index"] = self.n_calls
                self.n_calls += 1
                delta: dict[str, Any] = {"tool_calls": [call]}
            elif d.reasoning is not None:
                delta = {"reasoning_content": d.reasoning}
            else:
                delta = {"content": d.content}
            out.append(self._chunk([{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}]))
        return out

    def final(self, completion: Completion, extra: dict[str, Any], timed_out: bool) -> dict[str, Any]:
        reason = finish_reason(completion, timed_out, self.n_calls > 0)
        return self._chunk([self._choice(None if self.chat else "", reason)], edgespec=extra)

    def usage(self, completion: Completion, extra: dict[str, Any]) -> dict[str, Any]:
        out = self._chunk([], edgespec=extra)
        out["usage"] = usage(completion)
        return out
