"""serve/_protocol.py: request bodies -> typed requests; every bad body is refused with its exact status,
error class and the field it names."""

from __future__ import annotations

import pytest

from shardtool.errors import InvalidRequestError
from shardtool.serve._protocol import (COMPLETION_DEFAULT_MAX_TOKENS, DEFAULT_TEMPERATURE, MAX_STOP_CHARS, MAX_TOKENS,
                                       ChatMessage, StreamUsage, parse_chat, parse_completion)

MODEL = "acme/tiny"


def completion(**fields):
    return {"model": MODEL, "prompt": "Hi", **fields}


def chat(**fields):
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], **fields}


def test_a_minimal_completion_takes_openai_defaults():
    req = parse_completion(completion(), MODEL)
    assert req.prompt == "Hi"
    assert req.sampling.max_tokens == COMPLETION_DEFAULT_MAX_TOKENS
    assert req.sampling.temperature == DEFAULT_TEMPERATURE and req.sampling.top_p == 1.0
    assert req.sampling.seed is None and req.sampling.stop == ()
    assert (req.stream, req.usage.include) == (False, False)


def test_every_supported_completion_field():
    req = parse_completion(completion(
        prompt=[5, 6, 7], max_tokens=9, temperature=0, top_p=0.5, seed=2**64 - 1, stop=["\n", "END"], stream=True,
        stream_options={"include_usage": True}, n=1, user="u1", logprobs=None, echo=False, presence_penalty=0,
        frequency_penalty=0.0, best_of=1, logit_bias={}, suffix=None), MODEL)
    assert req.prompt == (5, 6, 7)
    s = req.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.seed, s.stop) == (9, 0.0, 0.5, 2**64 - 1, ("\n", "END"))
    assert req.stream and req.usage.include


@pytest.mark.parametrize("parse, make", [(parse_completion, completion), (parse_chat, chat)])
@pytest.mark.parametrize("fields, ignore_eos, usage", [
    ({}, False, StreamUsage(False, False)),
    ({"ignore_eos": True, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
     True, StreamUsage(True, True)),
    ({"ignore_eos": False, "stream": True, "stream_options": {"include_usage": False, "continuous_usage_stats": True}},
     False, StreamUsage(False, False)),  # as vLLM: the counts so far only when the counts are asked for at all
    ({"stream": True, "stream_options": {"continuous_usage_stats": False, "include_usage": True}}, False,
     StreamUsage(True, False)),
])
def test_the_vllm_extensions_load_generators_send(parse, make, fields, ignore_eos, usage):
    req = parse(make(**fields), MODEL)
    assert (req.sampling.ignore_eos, req.usage) == (ignore_eos, usage)


@pytest.mark.parametrize("fields, logprobs, echo, max_tokens", [
    ({}, None, False, COMPLETION_DEFAULT_MAX_TOKENS),
    ({"logprobs": 0}, 0, False, COMPLETION_DEFAULT_MAX_TOKENS),
    ({"logprobs": 20, "echo": True}, 20, True, COMPLETION_DEFAULT_MAX_TOKENS),
    ({"logprobs": 1, "echo": True, "max_tokens": 0}, 1, True, 0),  # as evaluation harnesses score a prompt
    ({"echo": True, "max_tokens": 0, "response_format": {"type": "text"}}, None, True, 0),
])
def test_completion_scores(fields, logprobs, echo, max_tokens):
    req = parse_completion(completion(**fields), MODEL)
    assert (req.logprobs, req.echo, req.sampling.max_tokens) == (logprobs, echo, max_tokens)


@pytest.mark.parametrize("fields, top", [
    ({}, None), ({"logprobs": False}, None), ({"logprobs": True}, 0), ({"logprobs": True, "top_logprobs": 20}, 20),
    ({"logprobs": True, "top_logprobs": None, "response_format": {"type": "text"}}, 0),
])
def test_chat_scores(fields, top):
    assert parse_chat(chat(**fields), MODEL).top_logprobs == top


@pytest.mark.parametrize("prompt, expected", [
    ("text", "text"), (["text"], "text"), ([3], (3,)), ([[3, 4]], (3, 4)), ([0, 2**31 - 1], (0, 2**31 - 1)),
    ([1.0, 2], (1, 2)),  # an integral float is an integer, as JSON encoders may write one
])
def test_prompt_forms(prompt, expected):
    assert parse_completion(completion(prompt=prompt), MODEL).prompt == expected


def test_a_chat_request():
    req = parse_chat(chat(messages=[
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "name": "ann"},
        {"role": "assistant", "content": ""}], max_completion_tokens=5, temperature=0.3), MODEL)
    assert req.messages == (ChatMessage("system", "Be brief."), ChatMessage("user", "a\nb", "ann"),
                            ChatMessage("assistant", ""))
    assert req.sampling.max_tokens == 5 and req.sampling.temperature == 0.3
    assert req.messages[1].as_template_dict() == {"role": "user", "content": "a\nb", "name": "ann"}


def test_chat_max_tokens_defaults_to_the_rest_of_the_context():
    assert parse_chat(chat(), MODEL).sampling.max_tokens is None
    assert parse_chat(chat(max_tokens=7, max_completion_tokens=7), MODEL).sampling.max_tokens == 7


# name -> (parser, body, status, param, code, words the message must contain)
BAD = {
    "body-not-an-object": (parse_completion, ["prompt"], 400, None, None, "must be a JSON object"),
    "unknown-field": (parse_completion, completion(tools=[]), 400, "tools", None, "unknown field 'tools'"),
    "unknown-field-among-several": (parse_completion, completion(zeta=1, alpha=2), 400, "alpha", None, "alpha"),
    "model-missing": (parse_completion, {"prompt": "x"}, 400, "model", None, "model is required"),
    "model-null": (parse_completion, completion(model=None), 400, "model", None, "model is required"),
    "model-wrong-type": (parse_completion, completion(model=3), 400, "model", None, "got 3"),
    "model-other": (parse_completion, completion(model="other/model"), 404, "model", "model_not_found",
                    "`other/model` does not exist"),
    "prompt-missing": (parse_completion, {"model": MODEL}, 400, "prompt", None, "prompt is required"),
    "prompt-empty-string": (parse_completion, completion(prompt=""), 400, "prompt", None, "prompt is empty"),
    "prompt-empty-list": (parse_completion, completion(prompt=[]), 400, "prompt", None, "prompt is empty"),
    "prompt-several": (parse_completion, completion(prompt=["a", "b"]), 400, "prompt", None, "got 2 prompts"),
    "prompt-several-id-lists": (parse_completion, completion(prompt=[[1], [2]]), 400, "prompt", None, "2 prompts"),
    "prompt-number": (parse_completion, completion(prompt=5), 400, "prompt", None, "got 5"),
    "prompt-object": (parse_completion, completion(prompt={}), 400, "prompt", None, "got an object"),
    "prompt-negative-id": (parse_completion, completion(prompt=[1, -1]), 400, "prompt[1]", None,
                           "token id from 0 to 2147483647, got -1"),
    "prompt-huge-id": (parse_completion, completion(prompt=[2**40]), 400, "prompt[0]", None, "got 1099511627776"),
    "prompt-bool-id": (parse_completion, completion(prompt=[True]), 400, "prompt[0]", None, "got true"),
    "prompt-fraction-id": (parse_completion, completion(prompt=[1.5]), 400, "prompt[0]", None, "got 1.5"),
    "prompt-mixed": (parse_completion, completion(prompt=[1, "a"]), 400, "prompt[1]", None, "the string 'a'"),
    "max-tokens-zero": (parse_completion, completion(max_tokens=0), 400, "max_tokens", None, "from 1 to"),
    "max-tokens-negative": (parse_completion, completion(max_tokens=-5), 400, "max_tokens", None, "got -5"),
    "max-tokens-huge": (parse_completion, completion(max_tokens=MAX_TOKENS + 1), 400, "max_tokens", None,
                        f"got {MAX_TOKENS + 1}"),
    "max-tokens-enormous": (parse_completion, completion(max_tokens=10**100), 400, "max_tokens", None,
                            "an integer of 101 digits"),
    "max-tokens-string": (parse_completion, completion(max_tokens="16"), 400, "max_tokens", None, "the string '16'"),
    "max-tokens-float": (parse_completion, completion(max_tokens=2.5), 400, "max_tokens", None, "got 2.5"),
    "max-tokens-bool": (parse_completion, completion(max_tokens=True), 400, "max_tokens", None, "got true"),
    "temperature-negative": (parse_completion, completion(temperature=-0.1), 400, "temperature", None, "from 0 to 2"),
    "temperature-high": (parse_completion, completion(temperature=2.5), 400, "temperature", None, "got 2.5"),
    "temperature-string": (parse_completion, completion(temperature="hot"), 400, "temperature", None, "string"),
    "temperature-huge-int": (parse_completion, completion(temperature=10**400), 400, "temperature", None,
                             "digits"),
    "top-p-zero": (parse_completion, completion(top_p=0), 400, "top_p", None, "greater than 0"),
    "top-p-above-one": (parse_completion, completion(top_p=1.01), 400, "top_p", None, "got 1.01"),
    "seed-negative": (parse_completion, completion(seed=-1), 400, "seed", None, "got -1"),
    "seed-huge": (parse_completion, completion(seed=2**64), 400, "seed", None, "from 0 to"),
    "stop-number": (parse_completion, completion(stop=3), 400, "stop", None, "string or an array"),
    "stop-too-many": (parse_completion, completion(stop=list("abcde")), 400, "stop", None, "5 strings"),
    "stop-empty-string": (parse_completion, completion(stop=""), 400, "stop", None, "empty string"),
    "stop-item-empty": (parse_completion, completion(stop=["a", ""]), 400, "stop[1]", None, "empty string"),
    "stop-item-number": (parse_completion, completion(stop=["a", 1]), 400, "stop[1]", None, "must be a string"),
    "stop-item-long": (parse_completion, completion(stop=["x" * (MAX_STOP_CHARS + 1)]), 400, "stop[0]", None,
                       "more than the cap"),
    "stream-string": (parse_completion, completion(stream="yes"), 400, "stream", None, "true or false"),
    "stream-options-without-stream": (parse_completion, completion(stream_options={"include_usage": True}), 400,
                                      "stream_options", None, "only allowed when stream is true"),
    "stream-options-unknown": (parse_completion, completion(stream=True, stream_options={"x": 1}), 400,
                               "stream_options.x", None, "unknown field"),
    "stream-options-usage-type": (parse_completion, completion(stream=True, stream_options={"include_usage": 1}),
                                  400, "stream_options.include_usage", None, "true or false"),
    "ignore-eos-string": (parse_completion, completion(ignore_eos="true"), 400, "ignore_eos", None, "true or false"),
    "ignore-eos-int": (parse_completion, completion(ignore_eos=1), 400, "ignore_eos", None, "got 1"),
    "chat-ignore-eos-string": (parse_chat, chat(ignore_eos="yes"), 400, "ignore_eos", None, "true or false"),
    "continuous-usage-int": (parse_completion, completion(stream=True, stream_options={
        "include_usage": True, "continuous_usage_stats": 1}), 400, "stream_options.continuous_usage_stats", None,
        "true or false, got 1"),
    "chat-continuous-usage-string": (parse_chat, chat(stream=True, stream_options={"continuous_usage_stats": "y"}),
                                     400, "stream_options.continuous_usage_stats", None, "true or false"),
    "n-two": (parse_completion, completion(n=2), 400, "n", None, "only 1 is accepted, got 2"),
    "n-true": (parse_completion, completion(n=True), 400, "n", None, "got true"),
    "best-of-two": (parse_completion, completion(best_of=2), 400, "best_of", None, "only 1"),
    "logprobs-21": (parse_completion, completion(logprobs=21), 400, "logprobs", None, "from 0 to 20, got 21"),
    "logprobs-negative": (parse_completion, completion(logprobs=-1), 400, "logprobs", None, "got -1"),
    "logprobs-true": (parse_completion, completion(logprobs=True), 400, "logprobs", None, "got true"),
    "echo-string": (parse_completion, completion(echo="yes"), 400, "echo", None, "true or false"),
    "max-tokens-zero-without-echo": (parse_completion, completion(max_tokens=0), 400, "max_tokens", None,
                                     "from 1 to"),
    "max-tokens-negative-with-echo": (parse_completion, completion(max_tokens=-1, echo=True), 400, "max_tokens",
                                      None, "from 0 to"),
    "response-format-json": (parse_completion, completion(response_format={"type": "json_object"}), 400,
                             "response_format.type", None, "json_object is not supported"),
    "response-format-string": (parse_completion, completion(response_format="text"), 400, "response_format", None,
                               "must be an object"),
    "response-format-extra": (parse_completion, completion(response_format={"type": "text", "x": 1}), 400,
                              "response_format.x", None, "unknown field"),
    "suffix-set": (parse_completion, completion(suffix="x"), 400, "suffix", None, "only null"),
    "presence-penalty": (parse_completion, completion(presence_penalty=0.5), 400, "presence_penalty", None, "got 0.5"),
    "frequency-penalty": (parse_completion, completion(frequency_penalty=-1), 400, "frequency_penalty", None, "-1"),
    "logit-bias": (parse_completion, completion(logit_bias={"5": 100}), 400, "logit_bias", None, "only null or {}"),
    "user-number": (parse_completion, completion(user=5), 400, "user", None, "must be a string"),
    "chat-messages-missing": (parse_chat, {"model": MODEL}, 400, "messages", None, "messages is required"),
    "chat-messages-empty": (parse_chat, chat(messages=[]), 400, "messages", None, "messages is empty"),
    "chat-messages-string": (parse_chat, chat(messages="hi"), 400, "messages", None, "array of messages"),
    "chat-message-not-object": (parse_chat, chat(messages=["hi"]), 400, "messages[0]", None, "must be an object"),
    "chat-role-missing": (parse_chat, chat(messages=[{"content": "x"}]), 400, "messages[0].role", None, "required"),
    "chat-role-unknown": (parse_chat, chat(messages=[{"role": "tool", "content": "x"}]), 400, "messages[0].role",
                          None, "system, user, assistant"),
    "chat-content-missing": (parse_chat, chat(messages=[{"role": "user"}]), 400, "messages[0].content", None,
                             "required"),
    "chat-content-number": (parse_chat, chat(messages=[{"role": "user", "content": 1}]), 400, "messages[0].content",
                            None, "string or an array of text parts"),
    "chat-content-image": (parse_chat, chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), 400,
                           "messages[0].content[0].type", None, "text only"),
    "chat-content-part-extra": (parse_chat, chat(messages=[{"role": "user", "content": [
        {"type": "text", "text": "a", "x": 1}]}]), 400, "messages[0].content[0].x", None, "unknown field"),
    "chat-message-extra": (parse_chat, chat(messages=[{"role": "user", "content": "a", "tool_calls": []}]), 400,
                           "messages[0].tool_calls", None, "unknown field"),
    "chat-second-message-bad": (parse_chat, chat(messages=[{"role": "user", "content": "a"},
                                                           {"role": "user", "content": None}]), 400,
                                "messages[1].content", None, "required"),
    "chat-both-max-differ": (parse_chat, chat(max_tokens=3, max_completion_tokens=4), 400, "max_completion_tokens",
                             None, "not both"),
    "chat-max-completion-zero": (parse_chat, chat(max_completion_tokens=0), 400, "max_completion_tokens", None,
                                 "from 1 to"),
    "chat-logprobs-number": (parse_chat, chat(logprobs=1), 400, "logprobs", None, "true or false, got 1"),
    "chat-top-logprobs-without-logprobs": (parse_chat, chat(top_logprobs=3), 400, "top_logprobs", None,
                                           "needs logprobs: true"),
    "chat-top-logprobs-21": (parse_chat, chat(logprobs=True, top_logprobs=21), 400, "top_logprobs", None,
                             "from 0 to 20, got 21"),
    "chat-response-format-schema": (parse_chat, chat(response_format={"type": "json_schema", "json_schema": {}}), 400,
                                    "response_format.type", None, "json_schema is not supported"),
    "chat-response-format-type-missing": (parse_chat, chat(response_format={}), 400, "response_format.type", None,
                                          "must be \"text\", got null"),
    "chat-prompt-field": (parse_chat, chat(prompt="x"), 400, "prompt", None, "unknown field 'prompt'"),
    "chat-model-other": (parse_chat, chat(model="gpt-4o"), 404, "model", "model_not_found", "does not exist"),
    # A lone UTF-16 surrogate (JSON's "\ud800", valid JSON) in any string field: no tokenizer or response body
    # can carry it.
    **{f"surrogate-{name}": (parse, body, 400, param, None, "lone UTF-16 surrogate") for name, (parse, body, param) in {
        "model": (parse_completion, completion(model="acme\ud800"), "model"),
        "prompt": (parse_completion, completion(prompt="Hi \ud800"), "prompt"),
        "prompt-in-a-batch": (parse_completion, completion(prompt=["\udfff"]), "prompt"),
        "stop": (parse_completion, completion(stop="\ud800"), "stop"),
        "stop-item": (parse_completion, completion(stop=["a", "b\udc00"]), "stop[1]"),
        "user": (parse_completion, completion(user="\ud800"), "user"),
        "chat-model": (parse_chat, chat(model="\ud800"), "model"),
        "chat-content": (parse_chat, chat(messages=[{"role": "user", "content": "x\ud800y"}]), "messages[0].content"),
        "chat-content-part": (parse_chat, chat(messages=[{"role": "user", "content": [
            {"type": "text", "text": "ok"}, {"type": "text", "text": "\ud83d"}]}]), "messages[0].content[1].text"),
        "chat-name": (parse_chat, chat(messages=[{"role": "user", "content": "a", "name": "\ud800"}]),
                      "messages[0].name"),
        "chat-stop": (parse_chat, chat(stop=["\ud800"]), "stop[0]"),
        "chat-user": (parse_chat, chat(user="\udbff"), "user"),
    }.items()},
}


@pytest.mark.parametrize("name", BAD)
def test_bad_bodies(name, raises_exactly):
    parse, body, status, param, code, words = BAD[name]
    with raises_exactly(InvalidRequestError) as info:
        parse(body, MODEL)
    err = info.value
    assert (err.status, err.param, err.code) == (status, param, code)
    assert words in err.message, err.message
    assert "\n" not in err.one_line()


def test_long_values_are_clipped_in_messages():
    with pytest.raises(InvalidRequestError) as info:
        parse_completion(completion(model="m" * 10_000), MODEL)
    assert len(info.value.message) < 200
    with pytest.raises(InvalidRequestError) as info:
        parse_completion(completion(**{"k" * 10_000: 1}), MODEL)
    assert len(info.value.message) < 200 and len(info.value.param) < 50


def test_surrogates_in_names_and_values_are_echoed_as_utf8_text():
    """An unknown field named with a lone surrogate, or a role that is one: the error still encodes as UTF-8."""
    for parse, body in ((parse_completion, completion(**{"\ud800x": 1})),
                        (parse_chat, chat(messages=[{"role": "\ud800", "content": "x"}]))):
        with pytest.raises(InvalidRequestError) as info:
            parse(body, MODEL)
        info.value.one_line().encode("utf-8")
        (info.value.param or "").encode("utf-8")


def test_text_beyond_the_bmp_is_accepted():
    assert parse_chat(chat(messages=[{"role": "user", "content": "\U0001F600 \u00e9"}]), MODEL).messages[0].content \
        == "\U0001F600 \u00e9"


def test_the_body_is_not_changed():
    body = completion(stop=["a"])
    parse_completion(body, MODEL)
    assert body == completion(stop=["a"])
