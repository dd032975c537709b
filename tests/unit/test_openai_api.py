"""OpenAI's API as data (serving/openai_api.py): requests checked into an LLM part's inputs, and
answers, stream chunks and errors that the official `openai` client's own types parse."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from typing import Any

import openai
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from ipnext.serving.openai_api import OpenAIError, chunk_events, parse_request, response_body

CHAT = {"model": "chat-lm", "messages": [{"role": "user", "content": "hi"}]}


def test_a_chat_request_becomes_the_parts_inputs() -> None:
    request = parse_request(
        "chat",
        {
            **CHAT,
            "messages": [
                {"role": "system", "content": "be brief"},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "two "}, {"type": "text", "text": "plus"}],
                },
            ],
            "max_completion_tokens": 12,
            "temperature": 0,
            "seed": 3,
            "stop": "\n",
            "n": 1,
            "user": "ann",
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert request.model == "chat-lm" and request.stream and request.include_usage
    assert request.inputs == {
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "two "}, {"type": "text", "text": "plus"}]},
        ],
        "max_tokens": 12,
        "temperature": 0.0,
        "top_p": 1.0,
        "stop": ["\n"],
        "seed": 3,
    }
    # OpenAI's defaults: temperature 1; a chat runs to the end of the context, a completion 16 tokens.
    assert parse_request("chat", CHAT).inputs["max_tokens"] is None
    completion = parse_request("completion", {"model": "m", "prompt": ["once upon"]})
    assert completion.inputs == {
        "prompt": "once upon",
        "max_tokens": 16,
        "temperature": 1.0,
        "top_p": 1.0,
        "stop": [],
    }


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({**CHAT, "n": 2}, "n"),
        ({**CHAT, "temperature": 2.5}, "temperature"),
        ({**CHAT, "temperature": "hot"}, "temperature"),
        ({**CHAT, "max_tokens": 0}, "max_tokens"),
        ({**CHAT, "messages": []}, "messages"),
        (
            {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages[0].content[0]",
        ),
        ({**CHAT, "tools": [{"type": "function"}]}, "tools"),
        ({**CHAT, "logprobs": True}, "logprobs"),
        ({**CHAT, "stop": ["a"] * 17}, "stop"),
        ({**CHAT, "frobnicate": 1}, "frobnicate"),
        ({**CHAT, "stream_options": {"include_usage": True}}, "stream_options"),
        ({"messages": CHAT["messages"]}, "model"),
        ({**CHAT, "max_tokens": 5, "max_completion_tokens": 6}, "max_completion_tokens"),
    ],
)
def test_a_bad_field_is_a_400_naming_it_in_openais_shape(body: dict[str, Any], param: str) -> None:
    with pytest.raises(OpenAIError) as refused:
        parse_request("chat", body)
    assert refused.value.status == 400 and refused.value.param == param
    error = refused.value.body()["error"]
    assert error["type"] == "invalid_request_error" and error["message"].startswith(param)


def test_an_unstreamed_answer_parses_as_the_clients_own_types() -> None:
    envelope = {
        "outputs": {"text": "four", "finish_reason": "eos", "prompt_tokens": 7, "completion_tokens": 2},
        "set": "chat-lm@3",
    }
    chat = ChatCompletion.model_validate(response_body(parse_request("chat", CHAT), envelope))
    assert chat.choices[0].message.content == "four" and chat.choices[0].finish_reason == "stop"
    assert chat.usage is not None and chat.usage.total_tokens == 9 and chat.system_fingerprint == "chat-lm@3"
    request = parse_request("completion", {"model": "m", "prompt": "2+2="})
    done = Completion.model_validate(
        response_body(request, {**envelope, "outputs": {**envelope["outputs"], "finish_reason": "length"}})
    )
    assert done.choices[0].text == "four" and done.choices[0].finish_reason == "length"


async def _envelopes(*items: Mapping[str, Any]) -> AsyncIterator[Mapping[str, Any]]:
    for item in items:
        yield item


async def _events(request: Any, *items: Mapping[str, Any]) -> list[str]:
    return [event async for event in chunk_events(request, _envelopes(*items))]


async def test_stream_chunks_join_to_the_answer_end_with_usage_and_done() -> None:
    request = parse_request("chat", {**CHAT, "stream": True, "stream_options": {"include_usage": True}})
    events = await _events(
        request,
        {"outputs": {"text": "fo"}, "set": "chat-lm@3"},
        {"outputs": {"text": "ur"}, "set": "chat-lm@3"},
        {
            "outputs": {"text": "", "finish_reason": "eos", "prompt_tokens": 7, "completion_tokens": 2},
            "set": "chat-lm@3",
        },
    )
    assert (
        all(e.startswith("data: ") and e.endswith("\n\n") for e in events)
        and events[-1] == "data: [DONE]\n\n"
    )
    chunks = [ChatCompletionChunk.model_validate(json.loads(e[6:])) for e in events[:-1]]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "four"
    assert chunks[2].choices[0].finish_reason == "stop"
    assert (
        chunks[-1].choices == [] and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 2
    )
    assert len({c.id for c in chunks}) == 1


async def test_a_failure_mid_stream_is_an_error_event_then_done() -> None:
    request = parse_request("completion", {"model": "m", "prompt": "x", "stream": True})
    events = await _events(
        request,
        {"outputs": {"text": "a"}, "set": "m@1"},
        {"error_id": "e1", "message": "part lm failed", "status": 500, "set": "m@1"},
    )
    # A text_completion chunk mid-stream has finish_reason null, as OpenAI's own stream does (the
    # client builds its objects without validation; its type says only a final one's values).
    first = json.loads(events[0][6:])
    assert first["object"] == "text_completion" and first["choices"][0]["text"] == "a"
    assert first["choices"][0]["finish_reason"] is None
    assert json.loads(events[1][6:]) == {
        "error": {"message": "part lm failed", "type": "server_error", "param": None, "code": None}
    }
    assert events[2] == "data: [DONE]\n\n"


def test_error_bodies_are_what_the_client_raises_from() -> None:
    """The client maps the status to its exception class and reads `error.message`."""
    body = OpenAIError(404, "model 'nope' is not served here", param="model", code="model_not_found").body()
    response = openai._base_client.httpx.Response(
        404, json=body, request=openai._base_client.httpx.Request("POST", "http://x/v1/chat/completions")
    )
    client = openai.OpenAI(api_key="k", base_url="http://x/v1")
    err = client._make_status_error_from_response(response)
    assert isinstance(err, openai.NotFoundError) and err.code == "model_not_found" and err.param == "model"
    assert "is not served here" in err.message


def test_openai_paths_and_the_region_they_name() -> None:
    from ipnext.serving.openai_door import openai_route

    assert openai_route("/v1/chat/completions") == (None, "chat/completions")
    assert openai_route("/v1/models") == (None, "models")
    assert openai_route("/eu-west/v1/completions") == ("eu-west", "completions")
    assert openai_route("/models/feed-ranker/routing") is None
    assert openai_route("/us-east/models/m/predict") is None
    assert openai_route("/Not A Region/v1/models") is None


def test_a_model_is_generative_when_an_llm_part_answers() -> None:
    from pathlib import Path

    from ipnext.spec.model import load_model_spec

    examples = Path(__file__).resolve().parents[2] / "examples"
    assert load_model_spec(examples / "llm" / "model.yaml").generative()
    assert load_model_spec(examples / "llm" / "model-disaggregated.yaml").generative()
    assert not load_model_spec(examples / "click_ranker" / "model.yaml").generative()


async def test_a_caller_going_away_closes_the_routers_stream() -> None:
    """Starlette closes the events generator when the client disconnects: the source (the
    router's stream, which cancels the part's generation) must be closed with it, at once."""
    closed: list[bool] = []

    async def endless() -> AsyncIterator[Mapping[str, Any]]:
        try:
            while True:
                yield {"outputs": {"text": "x"}, "set": "m@1"}
        finally:
            closed.append(True)

    events = chunk_events(
        parse_request("completion", {"model": "m", "prompt": "x", "stream": True}), endless()
    )
    assert (await anext(events)).startswith("data: ")
    await events.aclose()
    assert closed == [True]
