"""Chat messages -> prompt token ids, through the chat template of the model's signed tokenizer_config.json, or of
its signed chat_template.jinja (which transformers 5 writes instead, and which wins when both are present, as
transformers loads them).

Rendered as transformers renders it (its chat template utilities): jinja2's ImmutableSandboxedEnvironment with
trim_blocks, lstrip_blocks and the loopcontrols extension; `raise_exception`, `strftime_now`, a `tojson` that
does not HTML-escape, a `namespace` that refuses underscore names; the `{% generation %}` tag (kept as plain
text); the special tokens as variables; `add_generation_prompt=True`. The rendered text is encoded with
add_special_tokens=False: the template writes every special token itself.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any, Sequence

from shardtool.errors import InvalidRequestError, VerificationError

SOURCE = "tokenizer_config.json"
JINJA = "chat_template.jinja"
MAX_TEMPLATE_CHARS = 1 << 20
MAX_RENDERED_CHARS = 4 << 20  # a template may add text around the messages; not without bound
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class ChatTemplate:
    """Built once at start; `problem` says why chat cannot be served (the error each chat request gets)."""

    def __init__(self, source: str | None, special_tokens: dict[str, str], problem: Exception | None = None,
                 where: str = SOURCE):
        self.source = source
        self.where = where  # the signed file the template came from, named in its errors
        self.special_tokens = dict(special_tokens)
        self.problem = problem
        self._template = None
        if problem is None and source is not None:
            try:
                self._template = _environment().from_string(source)
            except Exception as e:  # noqa: BLE001 - jinja raises many kinds; all mean "does not compile"
                self.problem = VerificationError(f"the chat template in signed {where} does not compile: "
                                                 f"{_one_line(e)}", path=where)
        elif problem is None:
            self.problem = InvalidRequestError(
                f"this model has no chat template (its signed {SOURCE} has no chat_template and it ships no "
                f"{JINJA}): use /v1/completions", param="messages", code="no_chat_template")

    @classmethod
    def from_tokenizer_config(cls, config: dict | None, jinja: str | None = None) -> "ChatTemplate":
        """From the signed tokenizer_config.json and the signed chat_template.jinja's text (None: the manifest
        lists none); the .jinja file's template wins over the config's. Never raises: a template the server
        cannot use becomes `problem`."""
        if config is None and jinja is None:
            return cls(None, {})
        where = SOURCE if jinja is None else JINJA
        try:
            special = _special_tokens(config or {})
            source = _select((config or {}).get("chat_template") if jinja is None else jinja, where)
        except (InvalidRequestError, VerificationError) as e:
            return cls(None, {}, e, where)
        return cls(source, special, where=where)

    def render(self, messages: Sequence[dict[str, Any]]) -> str:
        if self.problem is not None:
            raise self.problem
        try:
            # Produced piece by piece, so the cap stops a template that writes without end (the worker process's
            # deadline and memory limit stop one that loops or builds one huge string: serve/_render.py).
            pieces, size = [], 0
            for piece in self._template.generate(messages=list(messages), tools=None, documents=None,
                                                 add_generation_prompt=True, **self.special_tokens):
                size += len(piece)
                if size > MAX_RENDERED_CHARS:
                    raise InvalidRequestError(f"the chat template rendered more than the cap of {MAX_RENDERED_CHARS} "
                                              f"characters", param="messages")
                pieces.append(piece)
            text = "".join(pieces)
        except InvalidRequestError:
            raise
        except _TemplateRefusal as e:
            raise InvalidRequestError(f"the model's chat template refused these messages: {_one_line(e)}",
                                      param="messages") from None
        except Exception as e:  # noqa: BLE001 - the template's own failure, on any input: the server's fault
            raise VerificationError(f"the chat template in signed {self.where} failed: {type(e).__name__}: "
                                    f"{_one_line(e)}", path=self.where) from None
        try:
            text.isascii() or text.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate from the template's own strings: no tokenizer takes it
            raise VerificationError(f"the chat template in signed {self.where} rendered text that is not Unicode (a "
                                    f"lone UTF-16 surrogate)", path=self.where) from None
        return text

    def prompt_ids(self, tokenizer, messages: Sequence[dict[str, Any]]) -> list[int]:
        return encode_rendered(tokenizer, self.render(messages))


def encode_rendered(tokenizer, text: str) -> list[int]:
    """A rendered chat prompt -> ids: the template wrote every special token itself."""
    return list(tokenizer.encode(text, add_special_tokens=False).ids)


def _select(value: Any, where: str = SOURCE) -> str | None:
    """`chat_template` is a string, or a list of {"name", "template"} of which "default" is used; `where` names
    the signed file it came from."""
    if value is None:
        return None
    if isinstance(value, list):
        named = {}
        for item in value:
            if not (isinstance(item, dict) and isinstance(item.get("name"), str)
                    and isinstance(item.get("template"), str)):
                raise VerificationError(f"signed {where}: chat_template is a list whose items are not "
                                        f"{{\"name\": string, \"template\": string}}", path=where)
            named[item["name"]] = item["template"]
        if "default" not in named:
            raise InvalidRequestError(f"this model's chat templates ({', '.join(sorted(named))[:200]}) include none "
                                      f"named \"default\"", param="messages", code="no_chat_template")
        value = named["default"]
    if not isinstance(value, str):
        raise VerificationError(f"signed {where}: chat_template is neither a string nor a list of named templates",
                                path=where)
    if len(value) > MAX_TEMPLATE_CHARS:
        raise VerificationError(f"signed {where}: chat_template is {len(value)} characters, more than the cap of "
                                f"{MAX_TEMPLATE_CHARS}", path=where)
    return value


def _special_tokens(config: dict) -> dict[str, str]:
    """bos_token, eos_token, ... as strings; tokenizer_config writes each as a string or an AddedToken object."""
    out = {}
    for key in SPECIAL_TOKEN_KEYS:
        value = config.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if value is None:
            continue
        if not isinstance(value, str):
            raise VerificationError(f"signed {SOURCE}: {key} is not a string", path=SOURCE)
        out[key] = value
    return out


class _TemplateRefusal(Exception):
    """raise_exception() in a template: the template's verdict on the messages (a 400, not a server fault)."""


def _environment():
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _TemplateError(_TemplateRefusal, jinja2.exceptions.TemplateError):
        pass

    def raise_exception(message):
        raise _TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # jinja's own tojson escapes HTML characters; chat templates want the JSON text itself.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    class Namespace(jinja2.utils.Namespace):
        # Namespaces store attributes: no underscore names, so nothing reaches Python's internals.
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a namespace attribute may not start with '_': {name!r}")

    class Generation(jinja2.ext.Extension):
        # `{% generation %}...{% endgeneration %}` marks the assistant's text for training masks: rendered as is.
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["namespace"] = Namespace
    env.globals["dict"] = lambda *args, **kwargs: dict(*args, **kwargs)
    return env


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split())[:300]
