"""Request bodies of the OpenAI-style API, validated field by field into typed requests (pure: a parsed JSON
object in, a frozen dataclass or an InvalidRequestError out).

Every field is known: an unknown one is refused by name, as is a known one of the wrong type or out of its
range. OpenAI fields this server does not implement (penalties, best_of, suffix, a JSON response_format, ...) are
accepted only at their neutral value, so a client never gets silently different semantics from the ones it asked
for. Scores are implemented: completions' `logprobs` (0 to 20 alternatives) and `echo` (the prompt scored too;
`max_tokens: 0` with it scores the prompt only), chat's `logprobs` and `top_logprobs` (0 to 20). Two vLLM
extensions that load generators send are implemented too: `ignore_eos` (the model's end-of-sequence tokens do not
end the answer; `max_tokens` and `stop` strings still do) and `stream_options.continuous_usage_stats` (with
`include_usage`, every streamed chunk carries the counts so far).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from shardtool.errors import InvalidRequestError
from shardtool.runtime import MAX_TOP_LOGPROBS

MAX_TOKENS = 1 << 20  # new tokens one request may ask for; the engine refuses what its context cannot hold
MAX_PROMPT_CHARS = 1 << 20  # a prompt (or all messages together), in characters
MAX_PROMPT_IDS = 1 << 20
MAX_TOKEN_ID = (1 << 31) - 1  # the largest id any vocabulary may have (the engine checks the model's own)
MAX_STOP_STRINGS = 4  # as OpenAI
MAX_STOP_CHARS = 256
MAX_MESSAGES = 1024
MAX_CONTENT_PARTS = 256
MAX_NAME_CHARS = 256  # model, user, message name
MAX_SEED = 2**64 - 1
MAX_TEMPERATURE = 2.0  # as OpenAI
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
DEFAULT_TEMPERATURE = 1.0  # OpenAI's default: a request that names no temperature samples
CHAT_ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class Sampling:
    """`max_tokens` None: as many as the context leaves after the prompt (chat's default, as OpenAI's)."""

    max_tokens: int | None
    temperature: float = DEFAULT_TEMPERATURE
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False  # the model's end-of-sequence tokens do not end the answer (vLLM's extension)


@dataclass(frozen=True)
class StreamUsage:
    """stream_options: `include_usage` adds a last chunk with the counts; `continuous` (vLLM's
    `continuous_usage_stats`, only with `include_usage`) puts the counts so far in every chunk too."""

    include: bool = False
    continuous: bool = False


@dataclass(frozen=True)
class CompletionRequest:
    prompt: str | tuple[int, ...]  # text, or token ids
    sampling: Sampling  # max_tokens 0 only with echo
    stream: bool = False
    usage: StreamUsage = StreamUsage()
    logprobs: int | None = None  # score each token, with this many alternatives (None: no scores)
    echo: bool = False  # the answer's text starts with the prompt's (and its scores with the prompt's)


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str
    name: str | None = None

    def as_template_dict(self) -> dict[str, str]:
        out = {"role": self.role, "content": self.content}
        if self.name is not None:
            out["name"] = self.name
        return out


@dataclass(frozen=True)
class ChatRequest:
    messages: tuple[ChatMessage, ...]
    sampling: Sampling
    stream: bool = False
    usage: StreamUsage = StreamUsage()
    top_logprobs: int | None = None  # `logprobs: true`: score each token with this many alternatives (else None)


def parse_completion(body: Any, model_id: str) -> CompletionRequest:
    """POST /v1/completions: `body` is the parsed JSON; `model_id` the one model this server serves."""
    fields = _Fields(body)
    _model(fields, model_id)
    prompt = _prompt(fields.take("prompt", required=True))
    logprobs = fields.take("logprobs")
    if logprobs is not None:
        logprobs = _integer(logprobs, "logprobs", 0, MAX_TOP_LOGPROBS)
    echo = fields.take("echo")
    echo = False if echo is None else _boolean(echo, "echo")
    # OpenAI fields at their neutral value only (their defaults: null, 1).
    fields.neutral("best_of", (None, 1), "1")
    fields.neutral("suffix", (None,), "null")
    # max_tokens 0 asks for no new token: only with echo (the prompt scored, as evaluation harnesses ask).
    sampling, stream, usage = _common(fields, fields.take("max_tokens"), COMPLETION_DEFAULT_MAX_TOKENS, "max_tokens",
                                      least=0 if echo else 1)
    fields.done()
    return CompletionRequest(prompt, sampling, stream, usage, logprobs, echo)


def parse_chat(body: Any, model_id: str) -> ChatRequest:
    """POST /v1/chat/completions."""
    fields = _Fields(body)
    _model(fields, model_id)
    messages = _messages(fields.take("messages", required=True))
    logprobs = fields.take("logprobs")
    logprobs = False if logprobs is None else _boolean(logprobs, "logprobs")
    top = fields.take("top_logprobs")
    if top is not None:
        top = _integer(top, "top_logprobs", 0, MAX_TOP_LOGPROBS)
        if not logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs: true", param="top_logprobs")
    elif logprobs:
        top = 0
    max_tokens, name = fields.take("max_tokens"), "max_tokens"
    newer = fields.take("max_completion_tokens")
    if newer is not None:
        if max_tokens is not None and max_tokens != newer:
            raise InvalidRequestError("give max_completion_tokens or max_tokens, not both with different values",
                                      param="max_completion_tokens")
        max_tokens, name = newer, "max_completion_tokens"
    sampling, stream, usage = _common(fields, max_tokens, None, name)
    fields.done()
    return ChatRequest(messages, sampling, stream, usage, top)


# ---------------------------------------------------------------------------------------------------------


class _Fields:
    """The body's fields, taken one by one; whatever is left at `done()` is an unknown field."""

    def __init__(self, body: Any):
        if not isinstance(body, dict):
            raise InvalidRequestError(f"the request body must be a JSON object, got {_kind(body)}")
        self.left = dict(body)

    def take(self, name: str, *, required: bool = False) -> Any:
        if required and self.left.get(name) is None:
            raise InvalidRequestError(f"{name} is required", param=name)
        return self.left.pop(name, None)

    def neutral(self, name: str, allowed: tuple, shown: str) -> None:
        value = self.take(name)
        if not any(value is a or (_same_number(value, a)) for a in allowed):
            raise InvalidRequestError(f"{name} is not supported by this server: only {shown} is accepted, got "
                                      f"{_shown(value)}", param=name)

    def done(self) -> None:
        if self.left:
            name = sorted(self.left)[0]
            raise InvalidRequestError(f"unknown field {_clip(name)!r}", param=_clip(name))


def _same_number(value: Any, neutral: Any) -> bool:
    """0 == 0.0 == 0 for the penalties, but a boolean is never a number (True == 1 in Python)."""
    return (isinstance(neutral, int) and not isinstance(neutral, bool) and _is_number(value)
            and value == neutral)


def _model(fields: _Fields, model_id: str) -> None:
    model = _string(fields.take("model", required=True), "model", MAX_NAME_CHARS)
    if model != model_id:
        raise InvalidRequestError(f"The model `{model}` does not exist: this server serves `{model_id}`",
                                  status=404, param="model", code="model_not_found")


def _common(fields: _Fields, max_tokens: Any, default_max: int | None, max_name: str, *,
            least: int = 1) -> tuple[Sampling, bool, StreamUsage]:
    """The sampling and streaming fields both endpoints share."""
    if max_tokens is not None:
        max_tokens = _integer(max_tokens, max_name, least, MAX_TOKENS)
    else:
        max_tokens = default_max
    temperature = fields.take("temperature")
    temperature = DEFAULT_TEMPERATURE if temperature is None else _number(temperature, "temperature", 0.0, MAX_TEMPERATURE)
    top_p = fields.take("top_p")
    top_p = 1.0 if top_p is None else _number(top_p, "top_p", 0.0, 1.0, open_low=True)
    seed = fields.take("seed")
    seed = None if seed is None else _integer(seed, "seed", 0, MAX_SEED)
    stop = _stop(fields.take("stop"))
    ignore_eos = fields.take("ignore_eos")
    ignore_eos = False if ignore_eos is None else _boolean(ignore_eos, "ignore_eos")
    stream = fields.take("stream")
    stream = False if stream is None else _boolean(stream, "stream")
    usage = _stream_options(fields.take("stream_options"), stream)
    fields.neutral("n", (None, 1), "1")
    fields.neutral("presence_penalty", (None, 0), "0")
    fields.neutral("frequency_penalty", (None, 0), "0")
    bias = fields.take("logit_bias")
    if bias is not None and bias != {}:
        raise InvalidRequestError(f"logit_bias is not supported by this server: only null or {{}} is accepted, got "
                                  f"{_shown(bias)}", param="logit_bias")
    user = fields.take("user")
    if user is not None:
        _string(user, "user", MAX_NAME_CHARS)
    _response_format(fields.take("response_format"))
    return Sampling(max_tokens, temperature, top_p, seed, stop, ignore_eos), stream, usage


def _response_format(value: Any) -> None:
    """Only {"type": "text"}, the default: this server does not constrain its output to JSON."""
    if value is None:
        return
    if not isinstance(value, dict):
        raise InvalidRequestError(f"response_format must be an object {{\"type\": \"text\"}}, got {_shown(value)}",
                                  param="response_format")
    options = dict(value)
    kind = options.pop("type", None)
    if kind in ("json_object", "json_schema"):
        raise InvalidRequestError(f"response_format {kind} is not supported by this server (it does not constrain "
                                  f"its output): only {{\"type\": \"text\"}} is accepted",
                                  param="response_format.type")
    if kind != "text":
        raise InvalidRequestError(f"response_format.type must be \"text\", got {_shown(kind)}",
                                  param="response_format.type")
    if options:
        name = sorted(options)[0]
        raise InvalidRequestError(f"unknown field {_clip(name)!r} in response_format",
                                  param=f"response_format.{_clip(name)}")


def _stream_options(value: Any, stream: bool) -> StreamUsage:
    if value is None:
        return StreamUsage()
    if not stream:
        raise InvalidRequestError("stream_options is only allowed when stream is true", param="stream_options")
    if not isinstance(value, dict):
        raise InvalidRequestError(f"stream_options must be an object, got {_shown(value)}", param="stream_options")
    options = dict(value)
    usage = options.pop("include_usage", None)
    usage = False if usage is None else _boolean(usage, "stream_options.include_usage")
    continuous = options.pop("continuous_usage_stats", None)
    continuous = False if continuous is None else _boolean(continuous, "stream_options.continuous_usage_stats")
    if options:
        name = sorted(options)[0]
        raise InvalidRequestError(f"unknown field {_clip(name)!r} in stream_options",
                                  param=f"stream_options.{_clip(name)}")
    # As vLLM: the counts so far in every chunk only when the counts were asked for at all.
    return StreamUsage(usage, usage and continuous)


def _prompt(value: Any) -> str | tuple[int, ...]:
    if isinstance(value, str):
        return _text(value, "prompt")
    if not isinstance(value, list):
        raise InvalidRequestError(f"prompt must be a string or an array of token ids, got {_shown(value)}",
                                  param="prompt")
    if not value:
        raise InvalidRequestError("prompt is empty", param="prompt")
    if all(isinstance(x, (str, list)) for x in value):  # a batch of prompts: one is fine
        if len(value) > 1:
            raise InvalidRequestError(f"this server takes one prompt per request, got {len(value)} prompts",
                                      param="prompt")
        return _prompt(value[0])
    if len(value) > MAX_PROMPT_IDS:
        raise InvalidRequestError(f"prompt has {len(value)} token ids, more than the cap of {MAX_PROMPT_IDS}",
                                  param="prompt")
    for i, x in enumerate(value):
        _integer(x, f"prompt[{i}]", 0, MAX_TOKEN_ID, what="a token id")
    return tuple(value)


def _messages(value: Any) -> tuple[ChatMessage, ...]:
    if not isinstance(value, list):
        raise InvalidRequestError(f"messages must be an array of messages, got {_shown(value)}", param="messages")
    if not value:
        raise InvalidRequestError("messages is empty", param="messages")
    if len(value) > MAX_MESSAGES:
        raise InvalidRequestError(f"messages has {len(value)} messages, more than the cap of {MAX_MESSAGES}",
                                  param="messages")
    out = tuple(_message(m, f"messages[{i}]") for i, m in enumerate(value))
    total = sum(len(m.content) for m in out)
    if total > MAX_PROMPT_CHARS:
        raise InvalidRequestError(f"the messages hold {total} characters, more than the cap of {MAX_PROMPT_CHARS}",
                                  param="messages")
    return out


def _message(value: Any, where: str) -> ChatMessage:
    if not isinstance(value, dict):
        raise InvalidRequestError(f"{where} must be an object with role and content, got {_shown(value)}", param=where)
    left = dict(value)
    role = left.pop("role", None)
    if role is None:
        raise InvalidRequestError(f"{where}.role is required", param=f"{where}.role")
    if role not in CHAT_ROLES:
        raise InvalidRequestError(f"{where}.role must be one of {', '.join(CHAT_ROLES)}, got {_shown(role)}",
                                  param=f"{where}.role")
    if left.get("content") is None:
        raise InvalidRequestError(f"{where}.content is required", param=f"{where}.content")
    content = _content(left.pop("content"), f"{where}.content")
    name = left.pop("name", None)
    if name is not None:
        name = _string(name, f"{where}.name", MAX_NAME_CHARS)
    if left:
        key = sorted(left)[0]
        raise InvalidRequestError(f"unknown field {_clip(key)!r} in {where}", param=f"{where}.{_clip(key)}")
    return ChatMessage(role, content, name)


def _content(value: Any, where: str) -> str:
    """A string, or an array of text parts (joined with newlines, as vLLM does)."""
    if isinstance(value, str):
        return _text(value, where, allow_empty=True)
    if not isinstance(value, list):
        raise InvalidRequestError(f"{where} must be a string or an array of text parts, got {_shown(value)}",
                                  param=where)
    if len(value) > MAX_CONTENT_PARTS:
        raise InvalidRequestError(f"{where} has {len(value)} parts, more than the cap of {MAX_CONTENT_PARTS}",
                                  param=where)
    texts = []
    for i, part in enumerate(value):
        at = f"{where}[{i}]"
        if not isinstance(part, dict):
            raise InvalidRequestError(f"{at} must be an object {{\"type\": \"text\", \"text\": ...}}, got "
                                      f"{_shown(part)}", param=at)
        left = dict(part)
        kind = left.pop("type", None)
        if kind != "text":
            raise InvalidRequestError(f"{at}.type must be \"text\" (this server reads text only), got {_shown(kind)}",
                                      param=f"{at}.type")
        if left.get("text") is None:
            raise InvalidRequestError(f"{at}.text is required", param=f"{at}.text")
        texts.append(_text(left.pop("text"), f"{at}.text", allow_empty=True))
        if left:
            key = sorted(left)[0]
            raise InvalidRequestError(f"unknown field {_clip(key)!r} in {at}", param=f"{at}.{_clip(key)}")
    return "\n".join(texts)


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list):
        raise InvalidRequestError(f"stop must be a string or an array of strings, got {_shown(value)}", param="stop")
    if len(items) > MAX_STOP_STRINGS:
        raise InvalidRequestError(f"stop has {len(items)} strings, more than the cap of {MAX_STOP_STRINGS}",
                                  param="stop")
    out = []
    for i, s in enumerate(items):
        where = "stop" if isinstance(value, str) else f"stop[{i}]"
        s = _string(s, where, MAX_STOP_CHARS)
        if not s:
            raise InvalidRequestError(f"{where} is an empty string", param=where)
        out.append(s)
    return tuple(out)


# ---------------------------------------------------------------------------------------------------------
# Scalars. A JSON boolean is never a number (Python's bool is an int).


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _integer(value: Any, name: str, lo: int, hi: int, *, what: str = "an integer") -> int:
    # An integral float (1.0) is what some JSON encoders write for an integer: accepted, as OpenAI does.
    number = int(value) if isinstance(value, float) and value.is_integer() else value
    if not (isinstance(number, int) and not isinstance(number, bool) and lo <= number <= hi):
        raise InvalidRequestError(f"{name} must be {what} from {lo} to {hi}, got {_shown(value)}", param=name)
    return number


def _number(value: Any, name: str, lo: float, hi: float, *, open_low: bool = False) -> float:
    # An integer is compared exactly (math.isfinite would overflow on a huge one).
    ok = _is_number(value) and (isinstance(value, int) or math.isfinite(value)) and (lo < value if open_low else lo <= value) and value <= hi
    if not ok:
        low = f"greater than {lo:g}" if open_low else f"from {lo:g}"
        raise InvalidRequestError(f"{name} must be a number {low} {'and at most' if open_low else 'to'} {hi:g}, got "
                                  f"{_shown(value)}", param=name)
    return float(value)


def _boolean(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise InvalidRequestError(f"{name} must be true or false, got {_shown(value)}", param=name)
    return value


def _string(value: Any, name: str, cap: int) -> str:
    """Every string field of every request comes through here: a type, a length cap, and Unicode text."""
    if not isinstance(value, str):
        raise InvalidRequestError(f"{name} must be a string, got {_shown(value)}", param=name)
    if len(value) > cap:
        raise InvalidRequestError(f"{name} is {len(value)} characters long, more than the cap of {cap}", param=name)
    if not value.isascii():
        # JSON's \ud800 escape decodes to a lone UTF-16 surrogate, which no UTF-8 text (a tokenizer's input, a
        # response body) can hold.
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise InvalidRequestError(f"{name} holds a lone UTF-16 surrogate (U+{ord(value[e.start]):04X} at "
                                      f"character {e.start}), which is not Unicode text", param=name) from None
    return value


def _text(value: str, name: str, *, allow_empty: bool = False) -> str:
    text = _string(value, name, MAX_PROMPT_CHARS)
    if not text and not allow_empty:
        raise InvalidRequestError(f"{name} is empty", param=name)
    return text


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def _shown(value: Any) -> str:
    """What was found, short: a number as itself (clipped), other values by their JSON type."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if _is_number(value):
        text = repr(value)
        return text if len(text) <= 40 else f"an integer of {len(text)} digits" if isinstance(value, int) else text[:40]
    if isinstance(value, str):
        return f"the string {_clip(value)!r}"
    return _kind(value)


def _clip(text: str, n: int = 40) -> str:
    """Short, and always UTF-8 text: an unknown field's name may hold a lone surrogate, and is echoed."""
    text = text if len(text) <= n else text[:n] + "..."
    return text if text.isascii() else text.encode("utf-8", "backslashreplace").decode("utf-8")
