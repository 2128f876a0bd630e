"""serve/_chat.py: chat messages -> prompt ids through the signed chat template. Rendered text and ids are
compared with transformers' own apply_chat_template on the same tokenizer files (the `oracle` tests), and the
ways a template can fail are refused with the right class (400: the template's verdict; 500: its fault)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from examples import make_tiny_moe as mtm
from shardtool.errors import InvalidRequestError, VerificationError
from shardtool.serve._chat import ChatTemplate

# Real-world shapes of template: ChatML with a default system prompt, tojson, a namespace, loop controls,
# strftime_now, the {% generation %} tag, special tokens as variables.
TEMPLATES = {
    "tiny-default": mtm.CHAT_TEMPLATE,
    "chatml-system-default": (
        "{% if messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\nYou are helpful.<|im_end|>\\n' }}{% endif %}"
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
        "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"),
    "llama-like": (
        "{{ bos_token }}{% for message in messages %}\n"
        "{% if message['role'] == 'user' %}[INST] {{ message['content'] | trim }} [/INST]\n"
        "{% elif message['role'] == 'assistant' %} {{ message['content'] | trim }}{{ eos_token }}\n"
        "{% else %}<<SYS>>{{ message['content'] }}<</SYS>>\n{% endif %}\n{% endfor %}"),
    "tojson-namespace-loopcontrols": (
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% if m['role'] == 'system' %}{% continue %}{% endif %}"
        "{% set ns.n = ns.n + 1 %}{{ ns.n }}:{{ m | tojson }}\n{% if ns.n > 3 %}{% break %}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}A:{% endif %}"),
    "generation-tag": (
        "{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}{{ eos_token }}"
        "{% endgeneration %}{% else %}{{ m['role'] }}: {{ m['content'] }}\n{% endif %}{% endfor %}"),
    "date": "{{ strftime_now('%Y') }}|{% for m in messages %}{{ m['content'] }}|{% endfor %}",
}

CONVERSATIONS = {
    "one-user": [{"role": "user", "content": "Hi there"}],
    "system-first": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why?"}],
    "multi-turn": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                   {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"},
                   {"role": "user", "content": "  e  "}],
    "unicode-and-quotes": [{"role": "user", "content": "ünïcödé \"quoted\" <b> & </b> 😀\n\ttab", "name": "x"}],
    "special-token-text": [{"role": "user", "content": "</s> and <s> typed by a user"}],
    "empty-content": [{"role": "user", "content": ""}],
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return mtm.make_checkpoint(tmp_path_factory.mktemp("chat") / "ck", "mixtral", layers=1)


@pytest.fixture(scope="module")
def tok(checkpoint):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(checkpoint / "tokenizer.json"))


def config_of(checkpoint: Path) -> dict:
    return json.loads((checkpoint / "tokenizer_config.json").read_text())


def with_template(checkpoint: Path, tmp: Path, template) -> tuple[Path, dict]:
    out = Path(shutil.copytree(checkpoint, tmp / "ck", ignore=shutil.ignore_patterns("*.safetensors")))
    config = config_of(checkpoint)
    config["chat_template"] = template
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out, config


@pytest.mark.oracle
@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("template", TEMPLATES)
def test_rendering_and_ids_match_transformers(checkpoint, tok, tmp_path, template, conversation):
    transformers = pytest.importorskip("transformers", reason="the chat oracle needs transformers")
    directory, config = with_template(checkpoint, tmp_path, TEMPLATES[template])
    hf = transformers.AutoTokenizer.from_pretrained(str(directory))
    messages = CONVERSATIONS[conversation]
    ours = ChatTemplate.from_tokenizer_config(config)
    assert ours.problem is None
    expected_text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.render(messages) == expected_text
    expected_ids = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert ours.prompt_ids(tok, messages) == list(expected_ids)


@pytest.mark.oracle
def test_named_templates_use_default_as_transformers_does(checkpoint, tok, tmp_path):
    transformers = pytest.importorskip("transformers", reason="the chat oracle needs transformers")
    named = [{"name": "tool_use", "template": "TOOLS {{ messages[0]['content'] }}"},
             {"name": "default", "template": TEMPLATES["chatml-system-default"]}]
    directory, config = with_template(checkpoint, tmp_path, named)
    hf = transformers.AutoTokenizer.from_pretrained(str(directory))
    messages = CONVERSATIONS["multi-turn"]
    assert ChatTemplate.from_tokenizer_config(config).render(messages) == hf.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)


def test_the_tiny_models_template_renders_as_documented(checkpoint):
    chat = ChatTemplate.from_tokenizer_config(config_of(checkpoint))
    assert chat.render([{"role": "user", "content": "Hi"}]) == "<s><|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_special_tokens_written_as_added_token_objects(checkpoint):
    config = {**config_of(checkpoint), "bos_token": {"content": "<s>", "lstrip": False}, "chat_template": "{{ bos_token }}"}
    assert ChatTemplate.from_tokenizer_config(config).render([]) == "<s>"


# name -> (tokenizer_config changes, messages, error class, status (InvalidRequestError), words)
FAILURES = {
    "no-tokenizer-config": (None, CONVERSATIONS["one-user"], InvalidRequestError, 400, "no chat template"),
    "no-chat-template": ({"chat_template": None}, CONVERSATIONS["one-user"], InvalidRequestError, 400,
                         "no chat template"),
    "named-without-default": ({"chat_template": [{"name": "rag", "template": "x"}]}, CONVERSATIONS["one-user"],
                              InvalidRequestError, 400, "none named \"default\""),
    "named-malformed": ({"chat_template": [{"name": "default"}]}, CONVERSATIONS["one-user"], VerificationError, None,
                        "whose items are not"),
    "template-not-a-string": ({"chat_template": 5}, CONVERSATIONS["one-user"], VerificationError, None,
                              "neither a string"),
    "bos-not-a-string": ({"bos_token": 5}, CONVERSATIONS["one-user"], VerificationError, None,
                         "bos_token is not a string"),
    "does-not-compile": ({"chat_template": "{% for m in messages %}"}, CONVERSATIONS["one-user"], VerificationError,
                         None, "does not compile"),
    "raise-exception": ({}, [{"role": "user", "content": "a"}, {"role": "system", "content": "late"}],
                        InvalidRequestError, 400, "refused these messages: a system message must come first"),
    "runtime-error": ({"chat_template": "{{ messages[0]['content'].nope() }}"}, CONVERSATIONS["one-user"],
                      VerificationError, None, "failed: UndefinedError"),
    "sandbox-escape": ({"chat_template": "{{ ''.__class__.__mro__ }}"}, CONVERSATIONS["one-user"], VerificationError,
                       None, "failed"),
    "namespace-underscore": ({"chat_template": "{% set ns = namespace(_x=1) %}"}, CONVERSATIONS["one-user"],
                             VerificationError, None, "may not start with '_'"),
    "rendered-too-long": ({"chat_template": "{% for i in range(100000) %}{{ messages[0]['content'] }}{% endfor %}"},
                          [{"role": "user", "content": "x" * 100}], InvalidRequestError, 400, "more than the cap"),
}


@pytest.mark.parametrize("name", FAILURES)
def test_template_failures(name, checkpoint, tok, raises_exactly):
    changes, messages, cls, status, words = FAILURES[name]
    config = None if changes is None else {**config_of(checkpoint), **changes}
    chat = ChatTemplate.from_tokenizer_config(config)
    with raises_exactly(cls) as info:
        chat.prompt_ids(tok, messages)
    assert words in info.value.message, info.value.message
    if status is not None:
        assert info.value.status == status
    assert "\n" not in info.value.one_line()


# transformers 5 saves the template as chat_template.jinja (and none in tokenizer_config.json); loading, it takes
# the .jinja file's template over the config's. name -> (config's chat_template, .jinja text, rendered text)
JINJA_CASES = {
    "jinja-only": (None, "J{{ messages[0]['content'] }}", "JHi"),
    "jinja-wins-over-config": ("C{{ messages[0]['content'] }}", "J{{ messages[0]['content'] }}", "JHi"),
    "config-only": ("C{{ messages[0]['content'] }}", None, "CHi"),
}


@pytest.mark.parametrize("case", JINJA_CASES)
def test_the_signed_chat_template_jinja_is_read(checkpoint, case):
    in_config, jinja, expected = JINJA_CASES[case]
    config = {k: v for k, v in config_of(checkpoint).items() if k != "chat_template"}
    if in_config is not None:
        config["chat_template"] = in_config
    assert ChatTemplate.from_tokenizer_config(config, jinja).render([{"role": "user", "content": "Hi"}]) == expected


def test_a_jinja_file_without_a_tokenizer_config_is_used():
    assert ChatTemplate.from_tokenizer_config(None, "X{{ messages|length }}").render([]) == "X0"


# name -> (.jinja text, error class): the errors name the .jinja file, not tokenizer_config.json
JINJA_FAILURES = {
    "does-not-compile": ("{% if %}", VerificationError),
    "over-the-cap": ("x" * ((1 << 20) + 1), VerificationError),
}


@pytest.mark.parametrize("case", JINJA_FAILURES)
def test_a_bad_chat_template_jinja_is_named(checkpoint, case):
    jinja, error = JINJA_FAILURES[case]
    chat = ChatTemplate.from_tokenizer_config(config_of(checkpoint), jinja)
    with pytest.raises(error) as e:
        chat.render([{"role": "user", "content": "Hi"}])
    assert type(e.value) is error and "chat_template.jinja" in e.value.message
    assert "tokenizer_config.json" not in e.value.message


@pytest.mark.oracle
def test_a_checkpoint_saved_with_chat_template_jinja_renders_as_transformers(checkpoint, tmp_path):
    transformers = pytest.importorskip("transformers", reason="the chat oracle needs transformers")
    config = {k: v for k, v in config_of(checkpoint).items() if k != "chat_template"}
    directory, _ = with_template(checkpoint, tmp_path, None)
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    (directory / "chat_template.jinja").write_text(TEMPLATES["chatml-system-default"])
    hf = transformers.AutoTokenizer.from_pretrained(str(directory))
    messages = CONVERSATIONS["multi-turn"]
    ours = ChatTemplate.from_tokenizer_config(config, (directory / "chat_template.jinja").read_text())
    assert ours.render(messages) == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
