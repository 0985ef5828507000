"""The K2.5 chat format (k25jax/data/chat.py): rendered byte for byte against strings written
out here, the loss mask, the parser's round trip and its errors on malformed output."""
import json
import random
import re

import pytest

from k25jax.data import chat, tokenizer, tool_declaration

SYSTEM = "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather.",
    "parameters": {"type": "object", "required": ["city", "days"], "properties": {
        "city": {"type": "string", "description": "City name", "maxLength": 40},
        "unit": {"type": "string", "enum": ["c", "f"], "default": "c"},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "hours": {"type": "array", "items": {"type": "integer"}}}}}}
PYTHON = {"type": "function", "function": {
    "name": "python", "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}
DECLARED = ("# Tools\n\n## functions\nnamespace functions {\n"
            "// Get the weather.\n"
            "type get_weather = (_: {\n"
            "  // City name\n  // maxLength: 40\n  city: string,\n"
            "  // maximum: 7, minimum: 1\n  days: number,\n"
            "  hours?: Array<number>,\n"
            "  // Default: \"c\"\n  unit?: \"c\" | \"f\"\n"
            "}) => any;\n"
            "type python = (_: {\n  code: string\n}) => any;\n"
            "}\n")
TWO_CALLS = [
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "functions.get_weather:0", "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}},
        {"function": {"name": "get_weather", "arguments": '{"city": "Rome", "days": 1}'}}]},
    {"role": "tool", "name": "get_weather", "tool_call_id": "functions.get_weather:0", "content": "18C"},
    {"role": "tool", "name": "get_weather", "tool_call_id": "functions.get_weather:1", "content": "21C"},
    {"role": "assistant", "content": "Paris 18C, Rome 21C."}]
MULTI_TURN = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "reasoning_content": "two and two", "content": "4"},
    {"role": "user", "content": "and 3+3?"},
    {"role": "assistant", "reasoning_content": "three and three", "content": "6"}]
THINKING_TOOL = [
    {"role": "user", "content": "Sum 1..10 with Python."},
    {"role": "assistant", "reasoning_content": "a loop", "content": "Running it.", "tool_calls": [
        {"id": "functions.python:0", "function": {"name": "python", "arguments": {"code": "print(sum(range(11)))"}}}]},
    {"role": "tool", "tool_call_id": "functions.python:0", "content": "55"},
    {"role": "assistant", "reasoning_content": "it printed 55", "content": "55"}]


@pytest.fixture(scope="module")
def tok():
  return tokenizer.ByteTokenizer(media=True, chat=True)


def test_the_default_system_turn_and_the_generation_prompts():
  messages = [{"role": "user", "content": "Hello"}]
  prompt = SYSTEM + "<|im_user|>user<|im_middle|>Hello<|im_end|><|im_assistant|>assistant<|im_middle|>"
  assert chat.render_text(messages, add_generation_prompt=True) == prompt + "<think></think>"
  assert chat.render_text(messages, thinking=True, add_generation_prompt=True) == prompt + "<think>"
  assert chat.render_text([]) == SYSTEM


def test_thinking_is_kept_in_the_current_round_only():
  assert chat.render_text(MULTI_TURN, thinking=True) == (
      "<|im_system|>system<|im_middle|>Be brief.<|im_end|>"
      "<|im_user|>user<|im_middle|>2+2?<|im_end|>"
      "<|im_assistant|>assistant<|im_middle|><think></think>4<|im_end|>"
      "<|im_user|>user<|im_middle|>and 3+3?<|im_end|>"
      "<|im_assistant|>assistant<|im_middle|><think>three and three</think>6<|im_end|>")
  assert chat.render_text(MULTI_TURN[:4], thinking=True, add_generation_prompt=True).endswith(
      "<think></think>4<|im_end|><|im_user|>user<|im_middle|>and 3+3?<|im_end|>"
      "<|im_assistant|>assistant<|im_middle|><think>")
  # the calls since the last answer are the current round: their reasoning stays
  assert "<think>a loop</think>Running it." in chat.render_text(THINKING_TOOL[:3], thinking=True,
                                                                add_generation_prompt=True)


def test_the_tool_declaration_is_a_typescript_namespace():
  assert tool_declaration.declare([WEATHER, PYTHON]) == DECLARED
  assert tool_declaration.declare([]) == ""
  nested = {"name": "f", "parameters": {"type": "object", "properties": {
      "opts": {"type": "object", "description": "Options", "properties": {"k": {"type": ["string", "null"]}},
               "additionalProperties": False},
      "tags": {"type": "array", "items": {"type": "string", "description": "a tag"}, "maxItems": 3},
      "mode": {"anyOf": [{"type": "string"}, {"type": "boolean"}], "default": True}}}}
  assert tool_declaration.declare([nested]) == (
      "# Tools\n\n## functions\nnamespace functions {\ntype f = (_: {\n"
      "  // Default: True\n  mode?: string | boolean,\n"
      "  // Options\n  opts?: {\n    k?: string | null,\n    [k: string]: never\n  },\n"
      "  // maxItems: 3\n  tags?: Array<\n    // a tag\n    string\n  >\n"
      "}) => any;\n}\n")
  with pytest.raises(ValueError, match="name"):
    tool_declaration.declare([{"type": "function", "function": {"parameters": {}}}])


def test_two_calls_and_their_results():
  assistant = ("<|im_assistant|>assistant<|im_middle|><think></think><|tool_calls_section_begin|>"
               "<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{\"city\": \"Paris\", \"days\": 1}"
               "<|tool_call_end|><|tool_call_begin|>functions.get_weather:1<|tool_call_argument_begin|>"
               "{\"city\": \"Rome\", \"days\": 1}<|tool_call_end|><|tool_calls_section_end|><|im_end|>")
  assert chat.render_text(TWO_CALLS, tools=[WEATHER, PYTHON]) == (
      f"<|im_system|>tool_declare<|im_middle|>{DECLARED}<|im_end|>" + SYSTEM
      + "<|im_user|>user<|im_middle|>Weather in Paris and Rome?<|im_end|>" + assistant
      + "<|im_system|>get_weather<|im_middle|>## Return of functions.get_weather:0\n18C<|im_end|>"
      + "<|im_system|>get_weather<|im_middle|>## Return of functions.get_weather:1\n21C<|im_end|>"
      + "<|im_assistant|>assistant<|im_middle|><think></think>Paris 18C, Rome 21C.<|im_end|>")


def test_an_image_and_its_placeholders(tok):
  messages = [{"role": "user", "content": [{"type": "image", "tokens": 3}, {"type": "text", "text": "Dots?"}]}]
  user = ("<|im_user|>user<|im_middle|><|media_begin|>image<|media_content|>"
          + "<|media_pad|>" * 3 + "<|media_end|>\nDots?<|im_end|>")
  assert chat.render_text(messages) == SYSTEM + user
  ids, _ = chat.render_ids(tok, messages)
  assert ids.count(tok.media.pad) == 3 and tok.decode(ids) == SYSTEM + user
  assert chat.render_text([{"role": "user", "content": [{"type": "image"}]}]).count("<|media_pad|>") == 1


@pytest.mark.parametrize("messages, thinking", [(TWO_CALLS, False), (MULTI_TURN, True), (THINKING_TOOL, True)])
def test_the_mask_covers_exactly_what_the_model_writes(tok, messages, thinking):
  """Mask 1: every assistant turn after its prefill (`<think>`, or `<think></think>` with
  thinking off) through its <|im_end|>; nothing else."""
  text = chat.render_text(messages, tools=[WEATHER, PYTHON], thinking=thinking)
  ids, mask = chat.render_ids(tok, messages, tools=[WEATHER, PYTHON], thinking=thinking)
  assert tok.decode(ids) == text and len(mask) == len(ids)
  prefill = re.escape("<|im_assistant|>assistant<|im_middle|><think>" + ("" if thinking else "</think>"))
  written = re.findall(prefill + r"(.*?<\|im_end\|>)", text, flags=re.DOTALL)
  assert len(written) == sum(m["role"] == "assistant" for m in messages)
  learned = [i for i, m in zip(ids, mask) if m]
  assert tok.decode(learned) == "".join(written)
  assert learned.count(tok.special["<|im_end|>"]) == len(written)     # each turn's end, no other


@pytest.mark.parametrize("messages, thinking", [(TWO_CALLS, False), (MULTI_TURN, True), (THINKING_TOOL, True),
                                                (THINKING_TOOL, False)])
def test_every_rendered_assistant_turn_parses_back(tok, messages, thinking):
  tools = [WEATHER, PYTHON]
  for k, message in enumerate(messages):
    if message["role"] != "assistant":
      continue
    prompt, _ = chat.render_ids(tok, messages[:k], tools, thinking, add_generation_prompt=True)
    full, mask = chat.render_ids(tok, messages[:k + 1], tools, thinking)
    assert full[:len(prompt)] == prompt and set(mask[len(prompt):]) == {1.0}   # the prompt is a prefix
    turn = chat.parse_assistant(tok, full[len(prompt):] + tok.encode("after the end"), thinking, tools)
    assert turn.error is None and turn.content == message["content"]
    assert turn.reasoning == (message.get("reasoning_content", "") if thinking else "")
    calls = message.get("tool_calls", [])
    assert [c.name for c in turn.tool_calls] == [c["function"]["name"] for c in calls]
    assert [c.arguments for c in turn.tool_calls] == [
        a if isinstance(a, dict) else json.loads(a) for a in (c["function"]["arguments"] for c in calls)]
    assert [c.id for c in turn.tool_calls] == [c.get("id") or f"functions.{c['function']['name']}:{i}"
                                              for i, c in enumerate(calls)]
    assert list(turn.tokens) == full[len(prompt):]
    assert chat.render_text(messages[:k] + [turn.message()], tools, thinking) == chat.render_text(
        messages[:k + 1], tools, thinking)


def _malformed(tok):
  """(ids the model wrote, thinking, expected error): twenty kinds of broken turns."""
  s, e = tok.special, tok.encode
  end, sb, se, cb, ab, ce = (s[n] for n in ("<|im_end|>", "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>",
                                            "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"))

  def call(call_id="functions.python:0", arguments='{"code": "print(1)"}'):
    return [cb, *e(call_id), ab, *e(arguments), ce]

  return [
      ("truncated answer", e("The answer is"), False, "truncated"),
      ("truncated call", [sb, cb, *e("functions.python:0"), ab, *e('{"code":')], False, "truncated"),
      ("truncated reasoning", e("let me think"), True, "truncated"),
      ("no </think>", [*e("hmm"), end], True, "unfinished_thinking"),
      ("role token in content", [*e("hi"), s["<|im_user|>"], *e("x"), end], False, "stray_token"),
      ("<think> in content", [s["<think>"], *e("x"), end], False, "stray_token"),
      ("media token in content", [*e("a"), tok.media.pad, end], False, "stray_token"),
      ("<|im_middle|> in content", [*e("a"), s["<|im_middle|>"], *e("b"), end], False, "stray_token"),
      ("call outside a section", [*call(), end], False, "stray_token"),
      ("role token in reasoning", [*e("r"), s["<|im_system|>"], s["</think>"], *e("a"), end], True, "stray_token"),
      ("role token in a section", [sb, *call(), s["<|im_assistant|>"], se, end], False, "stray_token"),
      ("unclosed section", [sb, *call(), end], False, "unclosed_section"),
      ("empty section", [sb, se, end], False, "empty_section"),
      ("text between calls", [sb, *call(), *e(" "), *call("functions.python:1"), se, end], False, "malformed_call"),
      ("no argument marker", [sb, cb, *e('functions.python:0{"code": "1"}'), ce, se, end], False, "malformed_call"),
      ("call without its end", [sb, cb, *e("functions.python:0"), ab, *e("{}"), se, end], False, "malformed_call"),
      ("two argument markers", [sb, cb, *e("functions.python:0"), ab, ab, *e("{}"), ce, se, end], False,
       "malformed_call"),
      ("id without namespace", [sb, *call("python:0"), se, end], False, "bad_call_id"),
      ("id without index", [sb, *call("functions.python:x"), se, end], False, "bad_call_id"),
      ("bad JSON", [sb, *call(arguments='{"code": "print(1)"'), se, end], False, "bad_arguments"),
      ("JSON not an object", [sb, *call(arguments="[1, 2]"), se, end], False, "arguments_not_object"),
      ("undeclared tool", [sb, *call("functions.shell:0"), se, end], False, "unknown_tool"),
      ("text after the section", [sb, *call(), se, *e(" done"), end], False, "text_after_calls"),
      ("a second section", [sb, *call(), se, sb, *call(), se, end], False, "text_after_calls"),
      ("nothing", [end], False, "empty"),
      ("only spaces", [*e("  \n"), end], False, "empty"),
  ]


def test_malformed_output_becomes_an_error_turn(tok):
  cases = _malformed(tok)
  assert len({name for name, *_ in cases}) >= 20
  for name, ids, thinking, expected in cases:
    turn = chat.parse_assistant(tok, ids, thinking, tools=[PYTHON])
    assert turn.error == expected, name
    assert turn.error in chat.TURN_ERRORS
  found = chat.parse_assistant(tok, [*tok.encode("ok"), tok.special["</think>"], *tok.encode("4"),
                                     tok.special["<|im_end|>"]], thinking=True)
  assert (found.reasoning, found.content, found.error) == ("ok", "4", None)


def test_random_ids_never_raise(tok):
  rng = random.Random(0)
  specials = list(tok.special.values())
  for _ in range(3000):
    ids = [rng.choice(specials) if rng.random() < 0.3 else rng.randrange(3, 259) for _ in range(rng.randrange(0, 30))]
    turn = chat.parse_assistant(tok, ids, thinking=rng.random() < 0.5, tools=[PYTHON] if rng.random() < 0.5 else None)
    assert turn.error is None or turn.error in chat.TURN_ERRORS


def test_bad_input_is_a_clear_error(tok):
  with pytest.raises(ValueError, match="role 'robot'"):
    chat.render_text([{"role": "robot", "content": "hi"}])
  with pytest.raises(ValueError, match="tool_call_id"):
    chat.render_text([{"role": "tool", "content": "55"}])
  with pytest.raises(ValueError, match="only assistant"):
    chat.render_text([{"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}])
  with pytest.raises(ValueError, match="tokens >= 1"):
    chat.render_text([{"role": "user", "content": [{"type": "image", "tokens": 0}]}])
  with pytest.raises(ValueError, match="chat tokens"):
    chat.render_ids(tokenizer.ByteTokenizer(media=True), [{"role": "user", "content": "hi"}])


IMAGE_TURN = [{"role": "user", "content": [{"type": "image", "tokens": 2}, {"type": "text", "text": "Dots?"}]},
              {"role": "assistant", "content": "3"}]


@pytest.mark.parametrize("messages, tools, thinking, generation", [
    (TWO_CALLS, True, False, False), (TWO_CALLS[:4], True, False, True), (MULTI_TURN, False, True, False),
    (MULTI_TURN[:4], False, True, True), (THINKING_TOOL, True, True, False), (THINKING_TOOL[:3], True, True, True),
    (THINKING_TOOL, False, False, False), (IMAGE_TURN, False, False, False), (IMAGE_TURN[:1], False, True, True)])
def test_transformers_renders_the_exported_template_as_the_renderer_does(messages, tools, thinking, generation):
  """The Jinja template an export writes (chat.chat_template()), applied by transformers."""
  from tokenizers import Tokenizer, models
  from transformers import PreTrainedTokenizerFast
  hf = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]")))
  hf.chat_template = chat.chat_template()
  declared = [WEATHER, PYTHON] if tools else None
  extra = {"tools_ts_str": tool_declaration.declare(declared)} if tools else {}
  got = hf.apply_chat_template(messages, tools=declared, thinking=thinking, add_generation_prompt=generation,
                               tokenize=False, **extra)
  assert got == chat.render_text(messages, declared, thinking, generation)
