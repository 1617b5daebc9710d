"""Text end to end through the official openai client: chat and text completions over sim workers that
announce the tiny model's real tokenizer (served as "tiny"), beside a colocated worker of another model
("tetri-sim", the built-in byte tokenizer) on the same daemon."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from daemon.tokenizer import HfTokenizer, render
from workers.engines.vllm.tinymodel import write_tiny_tokenizer

from .harness import LiveCluster, start_cluster

pytestmark = pytest.mark.slow
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Grüße 🙂 — what is a KV cache?"}]
NO_EOS = {"ignore_eos": True}  # the sim's tokens are hashes: one may be the tiny model's EOS


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LiveCluster, Path]]:
    root = tmp_path_factory.mktemp("chat")
    tok = write_tiny_tokenizer(root / "tok")
    c = start_cluster(root, [])
    try:
        for role in ("prefill", "decode"):
            c.add_worker(role, extra=["--tokenizer", str(tok), "--served-model-name", "tiny"])
        c.add_worker("colocated")
        yield c, tok
    finally:
        c.stop()


@pytest.fixture
def client(tiny: tuple[LiveCluster, Path]) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=tiny[0].url + "/v1", api_key="x", max_retries=0, timeout=60) as c:
        yield c


def test_models_lists_each_served_model(client: openai.OpenAI) -> None:
    assert sorted(m.id for m in client.models.list().data) == ["tetri-sim", "tiny"]


def test_chat_streaming_and_not_give_the_same_text_and_usage(tiny, client: openai.OpenAI) -> None:
    tok = HfTokenizer(str(tiny[1]))
    whole = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=24, extra_body=NO_EOS)
    text = whole.choices[0].message.content
    assert whole.object == "chat.completion" and whole.id.startswith("chatcmpl-")
    assert text and whole.choices[0].message.role == "assistant" and whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 24
    assert whole.usage.prompt_tokens == len(tok.encode(render(tok, CHAT), add_special_tokens=False))

    async def streamed() -> tuple[str, list]:
        async with openai.AsyncOpenAI(base_url=tiny[0].url + "/v1", api_key="x", max_retries=0) as a:
            chunks = [
                c
                async for c in await a.chat.completions.create(
                    model="tiny",
                    messages=CHAT,
                    max_tokens=24,
                    stream=True,
                    stream_options={"include_usage": True},
                    extra_body=NO_EOS,
                )
            ]
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks

    got, chunks = asyncio.run(streamed())
    assert got == text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24


def test_text_completion_tokenizes_the_prompt_and_returns_text(tiny, client: openai.OpenAI) -> None:
    tok = HfTokenizer(str(tiny[1]))
    r = client.completions.create(model="tiny", prompt="Tetri serves 🙂", max_tokens=12, extra_body=NO_EOS)
    assert r.usage.prompt_tokens == len(tok.encode("Tetri serves 🙂")) and r.usage.completion_tokens == 12
    assert r.choices[0].text  # (random ids: invalid UTF-8 byte runs read as U+FFFD, as in vLLM)
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model="tiny", prompt="Tetri serves 🙂", max_tokens=12, stream=True, extra_body=NO_EOS
        )
        if c.choices
    )
    assert streamed == r.choices[0].text


def test_stop_strings_end_the_answer_before_them(client: openai.OpenAI) -> None:
    full = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=40, extra_body=NO_EOS)
    text = full.choices[0].message.content or ""
    stop = text[12:15]
    want = text[: text.find(stop)]
    for stream in (False, True):
        if stream:
            chunks = list(
                client.chat.completions.create(
                    model="tiny", messages=CHAT, max_tokens=40, stop=[stop, "\x00never"], stream=True,
                    stream_options={"include_usage": True}, extra_body=NO_EOS,
                )
            )  # fmt: skip
            got = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            reason = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
            used = chunks[-1].usage.completion_tokens
        else:
            r = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=40, stop=stop, extra_body=NO_EOS)
            got, reason, used = r.choices[0].message.content, r.choices[0].finish_reason, r.usage.completion_tokens
        assert (got, reason) == (want, "stop"), stream
        assert used < 40


def test_each_model_is_served_by_its_own_instances(tiny, client: openai.OpenAI) -> None:
    a = client.chat.completions.create(model="tetri-sim", messages=CHAT, max_tokens=5, extra_body=NO_EOS)
    b = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=5, extra_body=NO_EOS)
    url = tiny[0].url
    ra = httpx.get(f"{url}/api/v1/requests/{a.id}", timeout=10).json()
    rb = httpx.get(f"{url}/api/v1/requests/{b.id}", timeout=10).json()
    c = tiny[0]
    assert ra["model"] == "tetri-sim" and [ra["prefill_instance"]] == c.started_as("colocated")
    assert rb["model"] == "tiny" and [rb["prefill_instance"]] == c.started_as("prefill")
    assert [rb["decode_instance"]] == c.started_as("decode")


def test_unknown_model_unsupported_fields_and_sampling_knobs(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-nope", messages=CHAT)
    assert e.value.code == "model_not_found" and e.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError, match="logprobs are not supported"):
        client.chat.completions.create(model="tiny", messages=CHAT, logprobs=True)
    with pytest.raises(openai.BadRequestError, match="only n=1"):
        client.chat.completions.create(model="tiny", messages=CHAT, n=2)
    r = client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=4, temperature=0.7, top_p=0.9, seed=3,
        extra_body={"top_k": 20, **NO_EOS},
    )  # fmt: skip
    assert r.usage.completion_tokens == 4


def test_chat_without_max_tokens_may_use_the_rest_of_the_context(client: openai.OpenAI, tiny) -> None:
    r = httpx.post(
        tiny[0].url + "/v1/chat/completions",
        json={"model": "tiny", "messages": CHAT, "max_tokens": 10**6},
        timeout=30,
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def test_a_worker_with_an_unloadable_tokenizer_does_not_start(tiny, tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text("{broken")
    p, _ = tiny[0].add_worker("decode", expect_ready=False, extra=["--tokenizer", str(tmp_path)])
    out, _ = p.communicate(timeout=60)
    assert p.returncode == 2
    assert "cannot load" in json.loads(out.splitlines()[-1])["error"]
