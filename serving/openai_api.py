"""OpenAI's API for generative models, as data: the bodies of `POST /v1/completions` and
`POST /v1/chat/completions` checked and turned into an LLM part's inputs, and the router's
answers turned into OpenAI's responses, stream chunks and errors. Pure (no Ray, no HTTP): the
OpenAI door calls it, and unit tests check its output against the `openai` client's own types.

What is accepted: `model`, `prompt` (a string, or a list of one) or `messages` (roles with text
or text parts), `max_tokens` / `max_completion_tokens` (absent: the rest of the model's context
for a chat, 16 for a completion, as OpenAI does), `temperature` (0 to 2, default 1), `top_p`,
`seed`, `stop` (a string or up to 16), `stream` with `stream_options.include_usage`, and
`n`, `best_of`, penalties, `logprobs`, `echo`, `logit_bias`, `response_format`, `tool_choice`
only at their neutral values (`n: 1`, `response_format: {"type": "text"}`, ...); `user`,
`metadata` and `store` are read and ignored. Anything else, or another value, is a 400 in
OpenAI's error shape naming the field (`param`) and what is served.

The set that answered goes in `system_fingerprint` (and the door adds it as a response header),
so a caller sees a rollout's sets as it sees them on every other route.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any, Literal

__all__ = [
    "OpenAIError",
    "OpenAIRequest",
    "chunk_events",
    "error_body",
    "parse_request",
    "response_body",
]

Kind = Literal["completion", "chat"]
MAX_STOP = 16
# Fields OpenAI defines that are served only at their neutral value: (the neutral values, what to say).
_NEUTRAL: dict[str, tuple[tuple[Any, ...], str]] = {
    "n": ((1, None), "1 (one choice per request)"),
    "best_of": ((1, None), "1"),
    "presence_penalty": ((0, 0.0, None), "0"),
    "frequency_penalty": ((0, 0.0, None), "0"),
    "logprobs": ((None, False), "null or false"),
    "top_logprobs": ((None, 0), "null"),
    "echo": ((False, None), "false"),
    "logit_bias": ((None,), "null"),
    "suffix": ((None,), "null"),
    "tools": ((None,), "null (no tool calls)"),
    "tool_choice": ((None, "none"), '"none"'),
    "parallel_tool_calls": ((None, False), "false"),
    "response_format": ((None, {"type": "text"}), '{"type": "text"}'),
}
_IGNORED = {"user", "metadata", "store", "service_tier"}
_COMMON = {"model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options"}
_FIELDS: dict[str, set[str]] = {
    "completion": _COMMON | {"prompt"},
    "chat": _COMMON | {"messages", "max_completion_tokens"},
}
_FINISH = {"eos": "stop", "stop": "stop", "length": "length"}


class OpenAIError(Exception):
    """A request answered with OpenAI's error shape: `{"error": {message, type, param, code}}`."""

    TYPES = {
        400: "invalid_request_error",
        401: "authentication_error",
        403: "permission_error",
        404: "invalid_request_error",
        429: "rate_limit_error",
        500: "server_error",
        503: "server_error",
        504: "server_error",
    }

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.code)


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    kind = OpenAIError.TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class OpenAIRequest:
    """A checked request: the model it names, the part's inputs, and how to answer."""

    def __init__(
        self, kind: Kind, model: str, inputs: dict[str, Any], stream: bool, include_usage: bool
    ) -> None:
        self.kind = kind
        self.model = model
        self.inputs = inputs
        self.stream = stream
        self.include_usage = include_usage


def _bad(param: str, what: str, got: Any = None) -> OpenAIError:
    shown = "" if got is None else f" (got {json.dumps(got)[:80]})"
    return OpenAIError(400, f"{param}: {what}{shown}", param=param)


def _number(body: Mapping[str, Any], key: str, low: float, high: float, default: float) -> float:
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise _bad(key, f"a number in [{low:g}, {high:g}]", value)
    if not low <= value <= high:
        raise _bad(key, f"a number in [{low:g}, {high:g}]", value)
    return float(value)


def _positive_int(body: Mapping[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _bad(key, "an integer >= 1", value)
    return value


def _stop(body: Mapping[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if (
        not isinstance(stops, list)
        or not all(isinstance(s, str) and s for s in stops)
        or len(stops) > MAX_STOP
    ):
        raise _bad("stop", f"a non-empty string or a list of at most {MAX_STOP} of them", stop)
    return list(stops)


def _messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "a non-empty list of {role, content}", messages)
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise _bad(where, "an object with a role (a string) and content", message)
        content = message.get("content")
        if isinstance(content, list):
            for j, part in enumerate(content):
                if (
                    not isinstance(part, dict)
                    or part.get("type") != "text"
                    or not isinstance(part.get("text"), str)
                ):
                    raise _bad(
                        f"{where}.content[{j}]",
                        'a text part {"type": "text", "text": "..."} (text only)',
                        part,
                    )
            content = [{"type": "text", "text": p["text"]} for p in content]
        elif not isinstance(content, str):
            raise _bad(f"{where}.content", "a string or a list of text parts", content)
        unknown = sorted(set(message) - {"role", "content", "name"})
        if unknown:
            raise _bad(f"{where}.{unknown[0]}", "not served (role, content and name are)")
        out.append({"role": message["role"], "content": content})
    return out


def parse_request(kind: Kind, body: Any) -> OpenAIRequest:
    """Check a request body; raise OpenAIError (400) naming the first field that is wrong."""
    if not isinstance(body, dict):
        raise OpenAIError(400, "the body must be a JSON object")
    for key, value in body.items():
        if key in _NEUTRAL:
            allowed, say = _NEUTRAL[key]
            if value not in allowed:
                raise _bad(key, f"only {say} is served", value)
        elif key not in _FIELDS[kind] and key not in _IGNORED:
            raise _bad(
                key,
                f"not a field of {'chat/completions' if kind == 'chat' else 'completions'} that is served",
            )
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("model", "the name of an ipnext model", model)
    stream = body.get("stream", False)
    if not isinstance(stream, bool | None):
        raise _bad("stream", "true or false", stream)
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or set(options) - {"include_usage"}):
        raise _bad("stream_options", '{"include_usage": true|false}', options)
    include_usage = bool(options and options.get("include_usage"))
    if options is not None and not stream:
        raise _bad("stream_options", "only with stream: true")
    inputs: dict[str, Any] = {
        "temperature": _number(body, "temperature", 0, 2, 1.0),
        "top_p": _number(body, "top_p", 0, 1, 1.0),
        "stop": _stop(body),
    }
    if inputs["top_p"] == 0:
        raise _bad("top_p", "a number in (0, 1]", 0)
    seed = body.get("seed")
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, int) or not -(2**63) <= seed < 2**63:
            raise _bad("seed", "an integer in [-2**63, 2**63) or null", seed)
        inputs["seed"] = seed
    if kind == "chat":
        inputs["messages"] = _messages(body)
        given = [k for k in ("max_completion_tokens", "max_tokens") if body.get(k) is not None]
        if len(given) == 2 and body["max_tokens"] != body["max_completion_tokens"]:
            raise _bad("max_completion_tokens", "give it or max_tokens (the same), not two values")
        inputs["max_tokens"] = (
            _positive_int(body, given[0]) if given else None
        )  # None: the rest of the context
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise _bad("prompt", "a non-empty string (or a list of one)", prompt)
        inputs["prompt"] = prompt
        inputs["max_tokens"] = _positive_int(body, "max_tokens") or 16
    return OpenAIRequest(kind, model, inputs, bool(stream), include_usage)


def _usage(outputs: Mapping[str, Any]) -> dict[str, int]:
    prompt, completion = int(outputs.get("prompt_tokens", 0)), int(outputs.get("completion_tokens", 0))
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _head(request: OpenAIRequest, id_: str, created: int, set_id: str) -> dict[str, Any]:
    kind = "chat.completion" if request.kind == "chat" else "text_completion"
    return {
        "id": id_,
        "object": kind,
        "created": created,
        "model": request.model,
        "system_fingerprint": set_id,
    }


def _new_id(request: OpenAIRequest) -> str:
    return f"{'chatcmpl' if request.kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"


def response_body(request: OpenAIRequest, envelope: Mapping[str, Any]) -> dict[str, Any]:
    """OpenAI's answer to an unstreamed request, from the router's envelope (`outputs`: the
    LLM part's text, finish reason and token counts; `set`)."""
    outputs = envelope["outputs"]
    finish = _FINISH.get(str(outputs.get("finish_reason")), "stop")
    head = _head(request, _new_id(request), int(time.time()), str(envelope.get("set", "")))
    if request.kind == "chat":
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": outputs["text"]},
            "finish_reason": finish,
            "logprobs": None,
        }
    else:
        choice = {"index": 0, "text": outputs["text"], "finish_reason": finish, "logprobs": None}
    return {**head, "choices": [choice], "usage": _usage(outputs)}


def _event(payload: Mapping[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"


async def chunk_events(
    request: OpenAIRequest, envelopes: AsyncIterator[Mapping[str, Any]]
) -> AsyncIterator[str]:
    """Server-sent events of a streamed answer, from the router's stream of envelopes: a
    `chat.completion.chunk` (the first carrying the assistant role) or `text_completion` per
    piece, the last with its finish reason, then the usage chunk when asked for, then
    `data: [DONE]`. A failure mid-stream is an error event in OpenAI's shape, then [DONE]."""
    id_, created = _new_id(request), int(time.time())
    kind = "chat.completion.chunk" if request.kind == "chat" else "text_completion"
    try:
        async for event in _chunks(request, envelopes, id_, created, kind):
            yield event
    finally:  # the caller went away (or all was sent): close the source, which stops its work
        close = getattr(envelopes, "aclose", None)
        if close is not None:
            await close()
    yield "data: [DONE]\n\n"


async def _chunks(
    request: OpenAIRequest, envelopes: AsyncIterator[Mapping[str, Any]], id_: str, created: int, kind: str
) -> AsyncIterator[str]:
    first = True
    async for envelope in envelopes:
        if "error_id" in envelope:
            status = int(envelope.get("status", 500))
            yield _event(error_body(status, str(envelope.get("message", "the request failed"))))
            break
        outputs, set_id = envelope["outputs"], str(envelope.get("set", ""))
        head = {
            "id": id_,
            "object": kind,
            "created": created,
            "model": request.model,
            "system_fingerprint": set_id,
        }
        finish = _FINISH.get(str(outputs["finish_reason"]), "stop") if "finish_reason" in outputs else None
        if request.kind == "chat":
            delta: dict[str, Any] = {"content": outputs.get("text", "")}
            if first:
                delta["role"] = "assistant"
            choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": 0, "text": outputs.get("text", ""), "finish_reason": finish, "logprobs": None}
        first = False
        yield _event({**head, "choices": [choice]})
        if finish is not None and request.include_usage:
            yield _event({**head, "choices": [], "usage": _usage(outputs)})
