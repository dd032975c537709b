"""The demo LLM as an ipnext model on the real stack: it streams over HTTP (server-sent events)
the tokens of the plain greedy loop, a client that goes away frees its KV blocks, and v2 rolls
out under streaming load with the `ttft_p99_ms` gate judging the new set. Served disaggregated,
the prefill part hands the KV to the decode part through the object store, same answers."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from ray import ObjectRef, serve

from ipnext.client.sdk import Client
from ipnext.contracts.model import ModelState
from ipnext.errors import ServingError
from ipnext.examples.llm.train import PART, train
from ipnext.names import RolloutState, poll_until
from ipnext.serving.control import connect
from ipnext.serving.llm.chat import checkpoint_codec
from ipnext.serving.llm.hf import folder_files, from_files
from ipnext.serving.llm.model import Decoder
from ipnext.serving.llm.text import TextCodec
from ipnext.spec.model import load_model_spec
from ipnext.spec.settings import Settings
from tests.docs_examples import example, substituted

from .conftest import keyed
from .test_doors import counted, counters

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

REPO = Path(__file__).resolve().parents[2]
# How long the stack may take to show what a test waits for (a push of the figures every second,
# a request counted): far above what it takes.
SHOWN_WITHIN_S = 30.0
# The streamed rollout of v2 under OpenAI traffic, every step baked, on a loaded 2-core machine.
STREAMED_ROLLOUT_S = 240.0


async def stream_events(http: httpx.AsyncClient, path: str, inputs: dict[str, Any]) -> list[dict[str, Any]]:
    events = []
    async with http.stream("POST", path, json={"inputs": inputs, "stream": True}) as reply:
        assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/event-stream")
        async for line in reply.aiter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line.removeprefix("data: ")))
    return events


@dataclass
class OpenAIStreamingLoad:
    """Closed-loop streaming chats through the OpenAI door with the official client; each
    answer's set is its chunks' `system_fingerprint`."""

    stack: Settings
    model: str
    workers: int = 3
    done: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)

    async def __aenter__(self) -> OpenAIStreamingLoad:
        self._tasks = [asyncio.create_task(self._worker(i)) for i in range(self.workers)]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)

    async def _worker(self, index: int) -> None:
        prompts = ["ada is a red", "two plus three is", "counting: one two", "bo lives by the"]
        client = openai_client(self.stack)
        n = index
        while not self._stop.is_set():
            n += 1
            try:
                stream = await client.chat.completions.create(
                    model=self.model,
                    messages=[{"role": "user", "content": prompts[n % len(prompts)]}],
                    max_tokens=12,
                    stream=True,
                )
                chunks = [chunk async for chunk in stream]
            except openai.OpenAIError as err:
                self.failed.append(f"{type(err).__name__}: {err}")
                continue
            ends = [c for c in chunks if c.choices and c.choices[0].finish_reason is not None]
            if len(ends) != 1:
                self.failed.append(f"{len(chunks)} chunks, {len(ends)} with a finish reason")
            else:
                self.done.append(str(ends[0].system_fingerprint))
        await client.close()


def openai_client(stack: Settings, region: str | None = None, key: str | None = None) -> openai.AsyncOpenAI:
    """The official client on the stack's OpenAI door (`/v1`, or a region's `/<region>/v1`)."""
    prefix = f"/{region}/v1" if region else "/v1"
    token = key if key is not None else keyed(stack)["Authorization"].removeprefix("Bearer ")
    return openai.AsyncOpenAI(base_url=stack.serve_url + prefix, api_key=token, max_retries=0, timeout=60)


async def openai_checks(stack: Settings, model: str, set_id: str, net: Decoder, codec: TextCodec) -> None:
    """models.list, a completion, a chat, a streamed chat equal to the unstreamed one (greedy),
    usage, the set in system_fingerprint, a bad field, a wrong key, a region's own door."""
    client = openai_client(stack)
    listed = [m.id async for m in client.models.list()]
    assert model in listed, listed
    completion = await client.completions.create(
        model=model, prompt="two plus three is", max_tokens=16, temperature=0
    )
    expected = net.generate(codec.prompt("two plus three is"), 16, stop_token=codec.eos)
    assert completion.choices[0].text == codec.decode(expected)
    assert completion.usage is not None and completion.usage.completion_tokens == len(expected)
    assert completion.system_fingerprint == set_id
    messages: list[Any] = [{"role": "user", "content": "counting: one two"}]
    chat = await client.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0)
    tokens = codec.chat_prompt(messages)
    answer = codec.decode(net.generate(tokens, 16, stop_token=codec.eos))
    assert chat.choices[0].message.content == answer and chat.usage is not None
    assert chat.usage.prompt_tokens == len(tokens)
    stream = await client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answer
    assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens == chat.usage.total_tokens
    with pytest.raises(openai.BadRequestError) as bad:
        await client.chat.completions.create(model=model, messages=messages, temperature=3)
    assert bad.value.param == "temperature" and "temperature" in bad.value.message
    with pytest.raises(openai.NotFoundError):
        await client.completions.create(model=f"{model}-nope", prompt="hi")
    regional = openai_client(stack, region="us-east")
    there = await regional.completions.create(
        model=model, prompt="two plus three is", max_tokens=16, temperature=0
    )
    assert there.choices[0].text == codec.decode(expected)
    with pytest.raises(openai.AuthenticationError):
        await openai_client(stack, key="ipn_not-a-key").models.list()
    print(
        f"OpenAI door: models {listed}; completion, chat and a streamed chat ({len(chunks)} chunks) "
        f"equal to the greedy reference; set {set_id} in system_fingerprint; 400 names temperature"
    )
    for c in (client, regional):
        await c.close()


async def vllm_metrics_check(stack: Settings, model: str) -> None:
    """GET /metrics (operator key): every vLLM name with the model's label, and after N OpenAI
    requests the token counters grew by their summed usage and the per-request histograms by N.
    The same scrape serves ipnext's own series: the router's requests grew by N too, and once
    the pushes settle they are the counts the gates read from the metrics actor."""
    from prometheus_client.parser import text_string_to_metric_families

    label = (("model_name", model),)

    def ipnext_requests(s: dict[str, dict[tuple[tuple[str, str], ...], float]]) -> dict[str, float]:
        """The model's `ipnext_requests_total` in us-east (where it serves) by set app."""
        rows = [(dict(k), v) for k, v in s.get("ipnext_requests_total", {}).items()]
        return {k["set_app"]: v for k, v in rows if (k["model"], k["region"]) == (model, "us-east")}

    async def scrape() -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
        reply = await http.get("/metrics", headers=keyed(stack))
        assert reply.status_code == 200, reply.text
        out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
        for family in text_string_to_metric_families(reply.text):
            for sample in family.samples:
                out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
        return out

    def total(s: dict[str, dict[tuple[tuple[str, str], ...], float]], name: str) -> float:
        return s.get(name, {}).get(label, -1.0)

    # The host replica's own figures: /metrics has every answer so far once its generated
    # tokens there are the replica's count (the host pushes every second).
    host = serve.get_deployment_handle("lm-cpu-std", app_name=f"{model}.us-east.s1.r1")

    async def scrape_and_replica() -> tuple[dict[str, dict[tuple[tuple[str, str], ...], float]], int]:
        generated = int((await describe(host))["completion_tokens"])
        return await scrape(), generated

    async with httpx.AsyncClient(base_url=stack.serve_url, timeout=30) as http:
        assert (await http.get("/metrics")).status_code == 401  # no key, no figures
        before, _ = await poll_until(
            scrape_and_replica,
            lambda read: total(read[0], "vllm:generation_tokens_total") == read[1],
            timeout_s=SHOWN_WITHIN_S,
            interval_s=0.5,
            what="every answer so far pushed to /metrics",
        )
        client = openai_client(stack)
        prompts = ["two plus three is", "ada is a red", "counting: one"]
        usages = []
        for i, prompt in enumerate(prompts):
            done = await client.completions.create(
                model=model, prompt=prompt, max_tokens=4 + i, temperature=0
            )
            assert done.usage is not None
            usages.append(done.usage)
        await client.close()
        n = len(prompts)
        after = await poll_until(
            scrape,
            lambda s: (
                total(s, "vllm:e2e_request_latency_seconds_count")
                >= total(before, "vllm:e2e_request_latency_seconds_count") + n
                and sum(ipnext_requests(s).values()) >= sum(ipnext_requests(before).values()) + n
            ),
            timeout_s=30,
            interval_s=0.5,
            what=f"{n} requests in vllm:e2e_request_latency_seconds and ipnext_requests_total",
        )

        # ipnext's series, beside vLLM's: typed families that parse, and, with no traffic now, the
        # router's requests per set app as the gates read them (both pushed every second).
        def settled(s: dict[str, dict[tuple[tuple[str, str], ...], float]]) -> bool:
            door = ipnext_requests(s)
            return bool(door) and all(counters(model, app).requests == v for app, v in door.items())

        settled_scrape = await poll_until(
            scrape, settled, timeout_s=SHOWN_WITHIN_S, interval_s=0.5, what="the door's requests = the gates'"
        )
        reply = await http.get("/metrics", headers=keyed(stack))
        kinds = {f.name: f.type for f in text_string_to_metric_families(reply.text)}
    assert {f: kinds.get(f) for f in ("ipnext_requests", "ipnext_latency_ms", "ipnext_ttft_ms")} == {
        "ipnext_requests": "counter",
        "ipnext_latency_ms": "histogram",
        "ipnext_ttft_ms": "histogram",
    }, sorted(kinds)
    assert settled_scrape["ipnext_metrics_actor_up"][(("model", model), ("region", "us-east"))] == 1
    names = {
        "vllm:time_to_first_token_seconds_count",
        "vllm:inter_token_latency_seconds_count",
        "vllm:e2e_request_latency_seconds_count",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
    }
    assert all(total(after, name) >= 0 for name in names), {n: total(after, n) for n in names}

    def grew(name: str) -> float:
        return total(after, name) - total(before, name)

    assert grew("vllm:prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert grew("vllm:generation_tokens_total") == sum(u.completion_tokens for u in usages)
    assert grew("vllm:time_to_first_token_seconds_count") == n
    assert grew("vllm:e2e_request_latency_seconds_count") == n
    print(
        f"GET /metrics: {len(names)} vLLM names for {model}; {n} requests added "
        f"{grew('vllm:prompt_tokens_total'):.0f} prompt and "
        f"{grew('vllm:generation_tokens_total'):.0f} generation "
        f"tokens, their usage summed; ipnext_requests_total {ipnext_requests(settled_scrape)}, "
        "the gates' counts"
    )


async def describe(host: Any) -> dict[str, Any]:
    """The LLM part's status, from its host replica (a blocking handle call, off the event loop)."""
    reply: dict[str, Any] = await asyncio.to_thread(lambda: host.describe.remote().result())
    return dict(reply["status"])


def reference(folder: Path) -> tuple[Decoder, TextCodec]:
    """The one-request-at-a-time module and the tokenizer of a checkpoint the trainer wrote."""
    files = folder_files(folder)
    checkpoint = from_files(files)
    return Decoder.from_weights(checkpoint.weights, checkpoint.config).eval(), checkpoint_codec(
        files, checkpoint
    )


async def test_llm_streams_frees_cancelled_blocks_and_rolls_out_under_streaming_load(
    stack: Settings, client: Client, model_name: str
) -> None:
    spec = load_model_spec(REPO / "examples" / "llm" / "model.yaml")
    rollout = spec.rollout.model_copy(update={"steps": [50, 100]})
    spec = spec.model_copy(update={"name": model_name, "rollout": rollout})
    await client.publish_model(spec)
    v1 = train(stack.snapshot_roots[0], model_name, "v1", steps=60)
    first = await client.publish_snapshot(model_name, v1.folder)
    await client.wait_until_serving(model_name, first.set_id, timeout_s=180)
    path = f"/us-east/models/{model_name}/predict"
    net, codec = reference(v1.folder)

    async with httpx.AsyncClient(base_url=stack.serve_url, headers=keyed(stack), timeout=60) as http:
        # 1. Streamed piece by piece, the greedy loop's text, in the envelope.
        events = await stream_events(http, path, {"prompt": "two plus three is", "max_tokens": 16})
        expected = codec.decode(net.generate(codec.prompt("two plus three is"), 16, stop_token=codec.eos))
        assert "".join(e["outputs"]["text"] for e in events) == expected
        assert len(events) > 2 and events[-1]["outputs"]["finish_reason"] in ("eos", "length")
        assert all(
            e["set"] == first.set_id and e["parts"] == {PART: f"{model_name}/{PART}@v1"} for e in events
        )
        whole = (
            await http.post(path, json={"inputs": {"prompt": "two plus three is", "max_tokens": 16}})
        ).json()
        assert whole["outputs"]["text"] == expected
        # A request that cannot run is the caller's mistake: 400 with the field, not a set error.
        connect(stack.ray_address())
        app = f"{model_name}.us-east.s1.r1"
        # The two answers above counted: nothing else moves the counters now.
        before = await counted(model_name, app, 2, "the answers so far counted")
        bad = await http.post(path, json={"inputs": {"prompt": "hi", "max_tokens": 0}})
        assert bad.status_code == 400 and bad.json()["message"].startswith("inputs.max_tokens"), bad.text
        too_long = await http.post(path, json={"inputs": {"prompt": "hi", "max_tokens": 5000}})
        assert too_long.status_code == 400 and "max_seq_len" in too_long.json()["message"], too_long.text
        bad_events = await stream_events(http, path, {"prompt": "hi", "max_tokens": 0})
        assert bad_events[0]["status"] == 400 and "inputs.max_tokens" in bad_events[0]["message"]
        # Poison values: a seed past 64 bits (it wedged the replica's engine) is refused naming
        # the field, a temperature below the floor is greedy; the replica answers on.
        # Both meet a replica busy with a good request, which they must not disturb.
        running = asyncio.create_task(
            http.post(path, json={"inputs": {"prompt": "two plus three is", "max_tokens": 16}})
        )
        poison = await http.post(path, json={"inputs": {"prompt": "hi", "seed": 2**64}})
        assert poison.status_code == 400 and poison.json()["message"].startswith("inputs.seed"), poison.text
        tiny = {"prompt": "two plus three is", "max_tokens": 16, "temperature": 1e-45}
        greedy = (await http.post(path, json={"inputs": tiny})).json()
        assert greedy["outputs"]["text"] == expected, greedy
        beside = await running
        assert beside.status_code == 200 and beside.json()["outputs"]["text"] == expected, beside.text
        await counted(model_name, app, before.requests + 2, "the greedy answer and the one beside it counted")
        # One more good answer, counted after every refusal: once its push is in, a counted
        # refusal would show in the same cumulative counters.
        last = await http.post(path, json={"inputs": {"prompt": "two plus three is", "max_tokens": 16}})
        assert last.status_code == 200 and last.json()["outputs"]["text"] == expected, last.text
        after = await counted(model_name, app, before.requests + 3, "the answer after the refusals counted")
        print(
            f"LLM poison inputs: 5 refused; set counters {before.requests}/{before.errors} -> "
            f"{after.requests}/{after.errors} (requests/errors)"
        )
        assert (after.requests, after.errors) == (before.requests + 3, before.errors)
    # The SDK streams the same pieces, and raises the part's error with its words.
    request = {"prompt": "two plus three is", "max_tokens": 16}
    pieces = [p async for p in client.predict_stream(model_name, request, source="us-east")]
    assert "".join(p.outputs["text"] for p in pieces) == expected and pieces[-1].set == first.set_id
    with pytest.raises(ServingError, match=r"inputs\.max_tokens"):
        async for _ in client.predict_stream(model_name, {"prompt": "hi", "max_tokens": 0}, source="us-east"):
            pass
    # The same model through the OpenAI door, with the official client; its figures under vLLM's names.
    await openai_checks(stack, model_name, first.set_id, net, codec)
    # The LLM guide's example, as its page writes it but for this stack's address, key and model.
    code = substituted(
        example("llm-openai-chat"),
        {
            "http://127.0.0.1:8000/v1": f"{stack.serve_url}/v1",
            'open(".ipnext/api-key")': f"open({str(stack.api_key_file())!r})",
            'model="tiny-lm"': f"model={model_name!r}",
        },
    )
    scope: dict[str, Any] = {}
    await asyncio.to_thread(exec, compile(code, "docs/guides/llm.md", "exec"), scope)
    assert scope["reply"].system_fingerprint == first.set_id and scope["reply"].usage.completion_tokens > 0
    await vllm_metrics_check(stack, model_name)
    async with httpx.AsyncClient(base_url=stack.serve_url, headers=keyed(stack), timeout=60) as http:
        # 2. A client that goes away mid-stream: its sequence stops and its blocks come back.
        connect(stack.ray_address())
        host = serve.get_deployment_handle("lm-cpu-std", app_name=f"{model_name}.us-east.s1.r1")
        # The handle's first call waits for Serve to list the replicas: make it before the
        # stream, so the look while the sequence runs is quick. The model is tiny: the whole
        # answer takes a few seconds, and the socket's buffers take it all without the reader.
        idle = await describe(host)
        assert idle["running"] == 0, idle
        async with http.stream(
            "POST",
            path,
            json={
                "inputs": {"prompt": "ada is a red", "max_tokens": 1000, "ignore_eos": True},
                "stream": True,
            },
        ) as reply:
            lines = reply.aiter_lines()
            pieces: list[dict[str, Any]] = []
            async for line in lines:
                if line.startswith("data: "):
                    pieces.append(json.loads(line.removeprefix("data: ")))
                if len(pieces) == 3:
                    break
            assert len(pieces) == 3 and not any("error_id" in p for p in pieces), pieces
            busy = await describe(host)
            assert busy["running"] == 1 and busy["kv_cache_used_blocks"] > 0, busy
        status = await poll_until(
            lambda: describe(host),
            lambda s: s["running"] == 0 and s["kv_cache_used_blocks"] == 0,
            timeout_s=30,
            interval_s=0.2,
            what="the cancelled stream's blocks freed",
        )
        assert status["cancelled"] >= 1

    # 3. v2 rolls out under streamed OpenAI traffic: no stream fails, and the TTFT gate judged it.
    v2 = train(stack.snapshot_roots[0], model_name, "v2", seed=2, steps=60)
    compared: list[Any] = []  # TTFT readings of the 50% step: the new set against the old
    async with OpenAIStreamingLoad(stack, model_name) as load:
        second = await client.publish_snapshot(model_name, v2.folder)

        async def model_reading_gates() -> ModelState:
            live = await client.rollout_status(model_name)
            if live is not None and live.set_id == second.set_id:
                compared.extend(
                    g for g in live.gates if g.metric == "ttft_p99_ms" and g.old_value is not None
                )
            return await client.get_model(model_name)

        state = await poll_until(
            model_reading_gates,
            lambda s: s.serving_set == second.set_id,
            timeout_s=STREAMED_ROLLOUT_S,
            interval_s=0.3,
            what=f"{second.set_id} serving",
        )
    assert load.failed == [], load.failed[:3]
    assert first.set_id in load.done and second.set_id in load.done
    assert state.rollout is not None and state.rollout.state == RolloutState.COMPLETED
    judged = [g for g in compared if g.judged and g.limit is not None]
    assert judged and not any(g.breached for g in compared), compared
    print(
        f"LLM rollout under streamed OpenAI traffic: {len(load.done)} streams, none failed; TTFT gate at 50% "
        f"(new p99, old p99, limit ms): {sorted({(g.value, g.old_value, g.limit) for g in judged})}"
    )
    await client.delete_model(model_name)


async def test_disaggregated_prefill_hands_kv_to_decode_through_the_object_store(
    stack: Settings, client: Client, model_name: str
) -> None:
    spec = load_model_spec(REPO / "examples" / "llm" / "model-disaggregated.yaml")
    spec = spec.model_copy(update={"name": model_name})
    await client.publish_model(spec)
    v1 = train(stack.snapshot_roots[0], model_name, "v1", steps=60, parts=("prefill", "decode"))
    published = await client.publish_snapshot(model_name, v1.folder)
    await client.wait_until_serving(model_name, published.set_id, timeout_s=180)
    net, codec = reference(v1.folder)
    path = f"/us-east/models/{model_name}/predict"
    async with httpx.AsyncClient(base_url=stack.serve_url, headers=keyed(stack), timeout=60) as http:
        for prompt, n in (("two plus three is", 16), ("bo lives by the", 24)):
            expected = codec.decode(net.generate(codec.prompt(prompt), n, stop_token=codec.eos))
            events = await stream_events(http, path, {"prompt": prompt, "max_tokens": n})
            assert "".join(e["outputs"]["text"] for e in events) == expected
            assert events[-1]["parts"] == {p: f"{model_name}/{p}@v1" for p in ("prefill", "decode")}
    # The prefill part's answer holds a reference into the object store, not the tensor.
    connect(stack.ray_address())
    app = f"{model_name}.us-east.s1.r1"
    prefill = serve.get_deployment_handle("prefill-cpu-std", app_name=app)
    handed = await asyncio.to_thread(
        lambda: prefill.remote({"input": {"prompt": "ada is a red", "max_tokens": 8}}).result()
    )
    assert isinstance(handed["output"]["kv"], ObjectRef)
    # ... and holds one itself, so the object outlives the answer until decode fetches it.
    described = await asyncio.to_thread(lambda: prefill.describe.remote().result())
    assert described["status"]["handed_kv_held"] >= 1  # one replica: 10 QPS planned at 20 per replica
    decode = serve.get_deployment_handle("decode-cpu-std", app_name=app)
    answer = await asyncio.to_thread(lambda: decode.remote({"prefill": handed["output"]}).result())
    assert answer["output"]["text"] == codec.decode(
        net.generate(codec.prompt("ada is a red"), 8, stop_token=codec.eos)
    )
    await client.delete_model(model_name)


async def test_a_hugging_face_checkpoint_serves_what_transformers_generates(
    stack: Settings, client: Client, model_name: str
) -> None:
    """A random Mistral checkpoint written by transformers (sliding window 8, shorter than the
    prompts), imported as a download job's folder would be, published, and asked through the
    OpenAI door: its completion and its chat are transformers' own greedy generation."""
    import torch
    import transformers

    from ipnext.store.snapshots import import_checkpoint
    from tests.llm.hf_checkpoints import write_checkpoint

    folder = write_checkpoint(stack.snapshot_roots[0] / model_name / "v1", "mistral-window")
    import_checkpoint(folder, model_name, PART, "v1")
    spec = load_model_spec(REPO / "examples" / "llm" / "model.yaml").model_copy(update={"name": model_name})
    await client.publish_model(spec)
    published = await client.publish_snapshot(model_name, folder)
    await client.wait_until_serving(model_name, published.set_id, timeout_s=180)

    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()

    def generate(ids: list[int], n: int) -> str:
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )[0, len(ids) :]
        return str(tokenizer.decode(out, skip_special_tokens=True))

    door = openai_client(stack)
    prompt = "the quick brown fox jumps over the lazy dog and"
    done = await door.completions.create(model=model_name, prompt=prompt, max_tokens=12, temperature=0)
    assert done.choices[0].text == generate(tokenizer(prompt).input_ids, 12)
    messages: list[Any] = [{"role": "user", "content": "hello world, how are you today?"}]
    chat = await door.chat.completions.create(
        model=model_name, messages=messages, max_tokens=12, temperature=0
    )
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert chat.choices[0].message.content == generate(ids, 12)
    assert chat.system_fingerprint == published.set_id
    await door.close()
    print("a Mistral checkpoint (window 8) served: completion and chat equal transformers' greedy generate")
    await client.delete_model(model_name)
