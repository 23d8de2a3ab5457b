"""ReAct turn formats: how a task becomes a prompt, how one generated turn is parsed, how a result returns.

A turn is what the policy writes between two observations: an optional thought, then exactly one
action. Two formats share one interface (`TurnFormat`), chosen by name with `get_format`:

- `tag` (Search-R1 style): `<think>…</think>` then `<search>query</search>`, `<calculator>expr</calculator>`,
  `<python>code</python>` or `<answer>…</answer>`; results come back inside `<information>…</information>`.
- `json` (Qwen / Hermes style): `<think>…</think>` then
  `<tool_call>{"name": "search", "arguments": {"query": "…"}}</tool_call>` or `<answer>…</answer>`;
  results come back inside `<tool_response>…</tool_response>`.

Parsing never raises on model output and takes time linear in its length: `parse_turn` returns a
`ParsedTurn` whose `error` tells the model precisely what was wrong. The rules, the same for both formats:

- The thought is the text inside `<think>…</think>` (a missing `<think>` before `</think>` is fine:
  some chat templates open it in the prompt). Action tags inside the thought are ignored.
- The action is the FIRST action tag after the thought; anything after its closing tag (a second
  action, an invented `<information>` block) is ignored and kept in `ParsedTurn.trailing`. Engines
  stop at the end of an action (`stop_strings`), so this only matters for engines without stop strings.
- The closing tag is required: engines must keep the stop string in their output
  (vLLM: `include_stop_str_in_output=True`). A missing one (e.g. the token limit cut the turn) is an error.
- Tag contents are dedented and stripped; required text arguments must not be empty.
- A complete tag block that is not an action (`<wikipedia>…</wikipedia>`, a `<search>` block in the
  json format) before the first action is an error that lists the valid actions.
- json only: a `<tool_call>` nested deeper than `MAX_JSON_DEPTH`, an integer longer than
  `MAX_JSON_INT_DIGITS` digits, a number beyond the float range and NaN / Infinity are errors, refused
  before `json.loads` would recurse past Python's stack or hit its int-string limit (4,300 digits);
  so is a string argument with an unpaired surrogate escape ("\\ud800"), which no UTF-8 file can hold.
"""

from __future__ import annotations

import difflib
import json
import math
import re
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from trace_rl.agent.types import Task, ToolCall

ANSWER = "answer"
"""Name of the final action: `ToolCall("answer", {"answer": ...})` ends the episode."""

ParamType = Literal["string", "integer", "number", "boolean"]

MAX_JSON_DEPTH = 16
"""Deepest array / object nesting a `<tool_call>` may have (a call needs 2: the call, its arguments)."""
MAX_JSON_INT_DIGITS = 100
"""Longest integer a `<tool_call>` may hold; Python refuses to convert more than 4,300 digits at all."""


@dataclass(frozen=True)
class ToolParam:
    name: str
    type: ParamType = "string"
    description: str = ""
    required: bool = True


@dataclass(frozen=True)
class ToolSpec:
    """What a format needs to know about a tool: its name, what it does, its parameters.

    The tag format carries only the first parameter (`<search>QUERY</search>`).
    """

    name: str
    description: str
    params: tuple[ToolParam, ...]

    @property
    def argument(self) -> str:
        """The parameter the tag format fills."""
        return self.params[0].name


ANSWER_SPEC = ToolSpec(
    name=ANSWER,
    description="Give your final answer and end the episode.",
    params=(ToolParam("answer", "string", "the final answer only, as short as possible"),),
)


@dataclass(frozen=True)
class WorkedExample:
    """A solved episode shown before the question (`task.few_shot`): its task, and every turn with its
    observation exactly as the model would write and read them."""

    task: Task
    episode: str


@dataclass(frozen=True)
class ParsedTurn:
    """One generated turn, split into thought and action. Exactly one of `call` and `error` is set."""

    text: str
    """The turn exactly as generated."""
    thought: str
    action: str
    """The action as written, from its opening to its closing tag ("" when none was found)."""
    call: ToolCall | None
    error: str | None
    """Why the turn cannot be acted on, written for the model (it becomes the observation)."""
    trailing: str = ""
    """Text after the action's closing tag; ignored."""

    @property
    def ok(self) -> bool:
        return self.call is not None


def check_arguments(spec: ToolSpec, arguments: Any) -> str | None:
    """Why `arguments` do not fit `spec` (a message for the model), or None when they do."""
    if not isinstance(arguments, Mapping):
        return f"arguments must be a JSON object, got {_json_type(arguments)}"
    known = {p.name for p in spec.params}
    expected = ", ".join(p.name for p in spec.params) or "none"
    for key in arguments:
        if key not in known:
            return f"unexpected argument {key!r} (expected: {expected})"
    for param in spec.params:
        if param.name not in arguments:
            if param.required:
                return f"missing argument {param.name!r} (expected: {expected})"
            continue
        value = arguments[param.name]
        if not _has_type(value, param.type):
            article = "an" if param.type == "integer" else "a"
            return f"argument {param.name!r} must be {article} {param.type}, got {_json_type(value)}"
        if param.type == "string" and param.required and not value.strip():
            return f"argument {param.name!r} is empty"
    return None


def _has_type(value: Any, kind: ParamType) -> bool:
    if kind == "string":
        return isinstance(value, str)
    if kind == "boolean":
        return isinstance(value, bool)
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _json_type(value: Any) -> str:
    for py, name in ((bool, "boolean"), (str, "string"), (int, "integer"), (float, "number"), (list, "array"), (dict, "object")):
        if isinstance(value, py):
            return name
    return "null" if value is None else type(value).__name__


def tool_schema(spec: ToolSpec) -> dict[str, Any]:
    """The OpenAI / Hermes function schema of a tool (what chat templates take as `tools=`)."""
    properties = {p.name: {"type": p.type, "description": p.description} for p in spec.params}
    return {
        "type": "function",
        "function": {
            "name": spec.name,
            "description": spec.description,
            "parameters": {
                "type": "object",
                "properties": properties,
                "required": [p.name for p in spec.params if p.required],
            },
        },
    }


_OPEN = re.compile(r"<([A-Za-z_][\w\-]*)>")
_CLOSE = re.compile(r"</([A-Za-z_][\w\-]*)>")


def _last_closes(text: str) -> dict[str, int]:
    """Where each tag's last closing tag starts: one pass, so asking "is <x> closed later?" is O(1)
    (a `find` per opening tag made `'<a>' * 100000` quadratic)."""
    return {match.group(1): match.start() for match in _CLOSE.finditer(text)}


def _split_thought(text: str) -> tuple[str, tuple[int, int] | None]:
    """The thought inside <think>…</think> and the span the think block covers (None: no think tags)."""
    open_at = text.find("<think>")
    close_at = text.find("</think>", open_at + 1 if open_at >= 0 else 0)
    if open_at >= 0 and close_at > open_at:
        return text[open_at + len("<think>") : close_at], (open_at, close_at + len("</think>"))
    if open_at < 0 and close_at >= 0:  # the template opened <think> in the prompt
        return text[:close_at], (0, close_at + len("</think>"))
    if open_at >= 0:  # unclosed: the thought runs up to the action
        return "", (open_at, open_at + len("<think>"))
    return "", None


def _clean(content: str) -> str:
    return textwrap.dedent(content.strip("\n")).strip()


class TurnFormat:
    """A ReAct turn format. Subclasses define the action syntax; everything else is shared.

    Methods take the task's tools as `ToolSpec`s (the answer action is always added).
    """

    name: str = ""
    opens_thought: bool = False
    """Whether every turn is opened with `<think>` for the model (after the prompt and after each
    observation), so it continues a thought instead of choosing how to begin: a small instruct model
    that copied the format for its first turn wrote prose after an observation (`with_open_thought`)."""

    @property
    def opener(self) -> str:
        """The text that opens each of the model's turns: `<think>`, or nothing."""
        return "<think>" if self.opens_thought else ""

    def with_open_thought(self, opens: bool = True) -> TurnFormat:
        """This format, with every turn opened by `<think>` (or not)."""
        if opens == self.opens_thought:
            return self
        copy = type(self)()
        copy.opens_thought = opens
        return copy

    # ---------------------------------------------------------------- prompt

    def system_prompt(self, tools: Sequence[ToolSpec]) -> str:
        raise NotImplementedError

    def user_prompt(self, task: Task) -> str:
        return f"Question: {task.question}"

    def messages(self, task: Task, tools: Sequence[ToolSpec], examples: Sequence[WorkedExample] = ()) -> list[dict[str, str]]:
        """Chat messages for a chat template: the system text (tools and format), each worked example as a
        question and the assistant's whole episode, then the question."""
        shown = [
            message
            for example in examples
            for message in ({"role": "user", "content": self.user_prompt(example.task)}, {"role": "assistant", "content": example.episode})
        ]
        return [{"role": "system", "content": self.system_prompt(tools)}, *shown, {"role": "user", "content": self.user_prompt(task)}]

    def render_prompt(self, task: Task, tools: Sequence[ToolSpec], examples: Sequence[WorkedExample] = ()) -> str:
        """The prompt as plain text, for models without a chat template."""
        shown = "".join(f"{self.user_prompt(example.task)}\n{example.episode}\n\n" for example in examples)
        return f"{self.system_prompt(tools)}\n\n{shown}{self.user_prompt(task)}\n"

    def stop_strings(self, tools: Sequence[ToolSpec]) -> tuple[str, ...]:
        """Strings at which generation should stop: the end of each action. Keep them in the output."""
        raise NotImplementedError

    # ---------------------------------------------------------------- observations

    def render_observation(self, text: str) -> str:
        """The text appended to the context after a turn, carrying a tool's output (or an error)."""
        raise NotImplementedError

    def observation_message(self, text: str) -> dict[str, str]:
        """The same observation as a chat message."""
        raise NotImplementedError

    # ---------------------------------------------------------------- actions

    def render_call(self, call: ToolCall, thought: str = "") -> str:
        """A turn text that parses back to `call` (scripted agents write their turns with this).

        Raises ValueError if the call cannot be written in this format.
        """
        think = f"{thought}</think>\n" if self.opens_thought else f"<think>{thought}</think>\n" if thought else ""
        if call.name == ANSWER:
            return think + _tag(ANSWER, _only_argument(call, ANSWER_SPEC.argument))
        return think + self._render_tool_call(call)

    def _render_tool_call(self, call: ToolCall) -> str:
        raise NotImplementedError

    def parse_turn(self, text: str, tools: Sequence[ToolSpec]) -> ParsedTurn:
        """Split one generated turn into thought and action; never raises on model output."""
        inner, think_span = _split_thought(text)
        names = self._action_tags(tools)
        closes = _last_closes(text)
        action_at = None
        unknown_at = None
        for match in _OPEN.finditer(text):
            if think_span and think_span[0] <= match.start() < think_span[1]:
                continue
            tag = match.group(1)
            if tag in names:
                action_at = match
                break
            if tag != "think" and unknown_at is None and closes.get(tag, -1) >= match.end():
                unknown_at = match
        before_end = len(text) if action_at is None else action_at.start()
        outside = _outside(text, think_span, before_end)
        thought = "\n".join(part for part in (inner.strip(), outside.strip()) if part)

        def fail(error: str, action: str = "", trailing: str = "") -> ParsedTurn:
            return ParsedTurn(text=text, thought=thought, action=action, call=None, error=error, trailing=trailing)

        if unknown_at is not None:  # found before any action: the loop stops at the first action
            return fail(f"<{unknown_at.group(1)}> is not an action. {self.usage(tools)}")
        if action_at is None:
            return fail(f"no action found. {self.usage(tools)}")
        tag = action_at.group(1)
        close = f"</{tag}>"
        close_at = text.find(close, action_at.end())
        if close_at < 0:
            return fail(f"unclosed <{tag}>: end it with {close}. {self.usage(tools)}", action=text[action_at.start() :])
        action = text[action_at.start() : close_at + len(close)]
        trailing = text[close_at + len(close) :]
        content = text[action_at.end() : close_at]
        call, error = self._parse_action(tag, content, tools)
        if error is not None:
            return fail(error, action=action, trailing=trailing)
        return ParsedTurn(text=text, thought=thought, action=action, call=call, error=None, trailing=trailing)

    def usage(self, tools: Sequence[ToolSpec]) -> str:
        """One line telling the model how to end a turn (part of every parse error)."""
        raise NotImplementedError

    def _action_tags(self, tools: Sequence[ToolSpec]) -> set[str]:
        raise NotImplementedError

    def _parse_action(self, tag: str, content: str, tools: Sequence[ToolSpec]) -> tuple[ToolCall | None, str | None]:
        raise NotImplementedError

    def _answer(self, content: str) -> tuple[ToolCall | None, str | None]:
        answer = _clean(content)
        if not answer:
            return None, "empty answer: write it between <answer> and </answer>, e.g. <answer> Paris </answer>"
        return ToolCall(ANSWER, {ANSWER_SPEC.argument: answer}), None


def _outside(text: str, span: tuple[int, int] | None, end: int) -> str:
    """Text before `end` that is not inside the think span."""
    if span is None:
        return text[:end]
    return text[: min(span[0], end)] + text[min(span[1], end) : end]


def _tag(name: str, value: str) -> str:
    if f"</{name}>" in value:
        raise ValueError(f"cannot write a {name!r} action whose text contains '</{name}>'")
    # Spaces inside the tags, as in Search-R1's prompts ("<search> query </search>"): a name then
    # tokenizes as it does mid-sentence in the question and observations, so copying it is easy.
    return f"<{name}> {value} </{name}>"


def _only_argument(call: ToolCall, argument: str) -> str:
    if set(call.arguments) != {argument} or not isinstance(call.arguments[argument], str):
        raise ValueError(f"the tag format writes {call.name!r} with exactly one text argument {argument!r}, got {call.arguments!r}")
    value = call.arguments[argument]
    if _clean(value) != value:
        raise ValueError(f"{call.name}.{argument} must be stripped and dedented to round-trip, got {value!r}")
    return value


def _spec_map(tools: Sequence[ToolSpec]) -> dict[str, ToolSpec]:
    specs = {spec.name: spec for spec in tools}
    if ANSWER in specs:
        raise ValueError("'answer' is reserved for the final action; a tool cannot use that name")
    return specs


class TagFormat(TurnFormat):
    """Search-R1 style: each tool is its own tag, `<search>query</search>`; results in `<information>`."""

    name = "tag"

    def system_prompt(self, tools: Sequence[ToolSpec]) -> str:
        lines = [
            "Answer the question. In each turn, first think step by step inside <think> </think>, "
            "then write exactly one action and stop. The actions are:",
        ]
        for spec in (*tools, ANSWER_SPEC):
            placeholder = spec.argument.upper()
            lines.append(f"<{spec.name}>{placeholder}</{spec.name}>: {spec.description}")
        if tools:
            lines.append("The result of a tool comes back inside <information> </information>.")
        lines.append("Put only the final answer inside <answer> </answer>, for example <answer> Paris </answer>.")
        return "\n".join(lines)

    def stop_strings(self, tools: Sequence[ToolSpec]) -> tuple[str, ...]:
        return tuple(f"</{spec.name}>" for spec in (*tools, ANSWER_SPEC))

    def render_observation(self, text: str) -> str:
        return f"\n\n<information>{text}</information>\n\n"

    def observation_message(self, text: str) -> dict[str, str]:
        return {"role": "user", "content": f"<information>{text}</information>"}

    def _render_tool_call(self, call: ToolCall) -> str:
        if len(call.arguments) != 1:
            raise ValueError(f"the tag format writes a tool call with exactly one argument, got {call.arguments!r}")
        (argument,) = call.arguments
        return _tag(call.name, _only_argument(call, argument))

    def usage(self, tools: Sequence[ToolSpec]) -> str:
        forms = ", ".join(f"<{spec.name}>…</{spec.name}>" for spec in (*tools, ANSWER_SPEC))
        return f"End your turn with exactly one of: {forms}."

    def _action_tags(self, tools: Sequence[ToolSpec]) -> set[str]:
        return {*_spec_map(tools), ANSWER}

    def _parse_action(self, tag: str, content: str, tools: Sequence[ToolSpec]) -> tuple[ToolCall | None, str | None]:
        if tag == ANSWER:
            return self._answer(content)
        spec = _spec_map(tools)[tag]
        value = _clean(content)
        if not value:
            return None, f"empty <{tag}>: put the {spec.argument} between <{tag}> and </{tag}>."
        arguments = {spec.argument: value}
        problem = check_arguments(spec, arguments)  # a tag carries text; other types cannot be written
        if problem is not None:
            return None, f"{tag}: {problem}"
        return ToolCall(tag, arguments), None


class JsonFormat(TurnFormat):
    """Qwen / Hermes style: `<tool_call>{"name": …, "arguments": {…}}</tool_call>`; results in `<tool_response>`."""

    name = "json"

    def system_prompt(self, tools: Sequence[ToolSpec]) -> str:
        head = (
            "Answer the question. In each turn, first think step by step inside <think> </think>, "
            "then write exactly one action and stop: call one tool, or give the final answer."
        )
        answer = (
            "To give the final answer and end the episode, put only the answer inside <answer> </answer>, "
            "for example <answer> Paris </answer>."
        )
        if not tools:
            return f"{head}\n\n{answer}"
        schemas = "\n".join(json.dumps(tool_schema(spec), ensure_ascii=False) for spec in tools)
        return (
            f"{head}\n\n# Tools\n\nYou may call one of these functions:\n<tools>\n{schemas}\n</tools>\n\n"
            "To call a function, write a JSON object with its name and arguments inside <tool_call></tool_call> tags:\n"
            '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>\n'
            "The result comes back inside <tool_response> </tool_response>.\n"
            f"{answer}"
        )

    def stop_strings(self, tools: Sequence[ToolSpec]) -> tuple[str, ...]:
        return ("</tool_call>", f"</{ANSWER}>") if tools else (f"</{ANSWER}>",)

    def render_observation(self, text: str) -> str:
        return f"\n<tool_response>\n{text}\n</tool_response>\n"

    def observation_message(self, text: str) -> dict[str, str]:
        return {"role": "tool", "content": text}

    def _render_tool_call(self, call: ToolCall) -> str:
        body = json.dumps({"name": call.name, "arguments": call.arguments}, ensure_ascii=False)
        if "</tool_call>" in body:
            raise ValueError("cannot write a tool call whose JSON contains '</tool_call>'")
        return f"<tool_call>\n{body}\n</tool_call>"

    def usage(self, tools: Sequence[ToolSpec]) -> str:
        if not tools:
            return "End your turn with <answer>…</answer>."
        return (
            'End your turn with exactly one of: <tool_call>{"name": …, "arguments": {…}}</tool_call> '
            f"(tools: {', '.join(spec.name for spec in tools)}), <answer>…</answer>."
        )

    def _action_tags(self, tools: Sequence[ToolSpec]) -> set[str]:
        _spec_map(tools)
        return {"tool_call", ANSWER} if tools else {ANSWER}

    def _parse_action(self, tag: str, content: str, tools: Sequence[ToolSpec]) -> tuple[ToolCall | None, str | None]:
        if tag == ANSWER:
            return self._answer(content)
        specs = _spec_map(tools)
        shape = '{"name": …, "arguments": {…}}'
        if _nested_deeper_than(content, MAX_JSON_DEPTH):
            return None, f"<tool_call> is nested more than {MAX_JSON_DEPTH} levels deep; write {shape}."
        try:
            data = json.loads(content, parse_int=_json_int, parse_float=_json_float, parse_constant=_json_constant)
        except json.JSONDecodeError as exc:
            return None, f"invalid JSON in <tool_call>: {exc.msg} (line {exc.lineno}, column {exc.colno}); write {shape}."
        except _UnusableNumber as exc:
            return None, f"{exc} in <tool_call>; write {shape}."
        if not isinstance(data, dict):
            return None, f"<tool_call> must hold a JSON object {shape}, got {_json_type(data)}."
        extra = sorted(set(data) - {"name", "arguments"})
        if extra:
            return None, f"unexpected key {extra[0]!r} in <tool_call>; write {shape}."
        name = data.get("name")
        if not isinstance(name, str):
            return None, f'"name" must be a string naming a tool, got {_json_type(name)}; write {shape}.'
        if name not in specs:
            hint = " Give the final answer with <answer>…</answer>, not a tool call." if name == ANSWER else ""
            return None, f"unknown tool {name!r}; available tools: {', '.join(specs)}.{hint}"
        arguments = data.get("arguments", {})
        problem = check_arguments(specs[name], arguments)
        if problem is not None:
            return None, f"{name}: {problem}."
        for key, value in arguments.items():
            if isinstance(value, str) and _SURROGATE.search(value):  # no UTF-8 form: the tree file could not hold it
                return None, f"{name}: argument {key!r} holds an unpaired \\ud800-\\udfff escape; write the character itself."
        return ToolCall(name, dict(arguments)), None


_JSON_STRUCTURE = re.compile(r'\\.|["\[\]{}]', re.DOTALL)
"""What decides JSON nesting: quotes, brackets, and escapes (taken whole, so an escaped quote stays in its string)."""


def _nested_deeper_than(content: str, limit: int) -> bool:
    """Whether arrays / objects in `content` nest deeper than `limit`, strings skipped; linear.

    Sound for `json.loads`, which recurses once per level: over any prefix it parses, this scan
    tracks strings exactly as it does, so it sees every level the parser would enter.
    """
    if content.count("[") + content.count("{") <= limit:
        return False
    depth, in_string = 0, False
    for match in _JSON_STRUCTURE.finditer(content):
        token = match.group()
        if token == '"':
            in_string = not in_string
        elif in_string or token[0] == "\\":
            continue
        elif token in "[{":
            depth += 1
            if depth > limit:
                return True
        else:
            depth -= 1
    return False


_SURROGATE = re.compile("[\ud800-\udfff]")
"""What json.loads makes of an unpaired surrogate escape such as "\\ud800": text with no UTF-8 encoding."""


class _UnusableNumber(ValueError):
    """A JSON number no tool can take; raised from inside `json.loads` by the hooks below."""


def _json_int(digits: str) -> int:
    if len(digits.lstrip("-")) > MAX_JSON_INT_DIGITS:
        raise _UnusableNumber(f"an integer with {len(digits.lstrip('-'))} digits (at most {MAX_JSON_INT_DIGITS})")
    return int(digits)


def _json_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _UnusableNumber(f"the number {text[:40]}{'…' if len(text) > 40 else ''} is beyond the float range")
    return value


def _json_constant(name: str) -> float:
    raise _UnusableNumber(f"{name} is not a JSON number")


FORMATS: dict[str, TurnFormat] = {"tag": TagFormat(), "json": JsonFormat()}


def get_format(name: str) -> TurnFormat:
    """The turn format registered under `name` ('tag' or 'json')."""
    if name not in FORMATS:
        close = difflib.get_close_matches(name, FORMATS, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown turn format {name!r}{hint} (known: {sorted(FORMATS)})")
    return FORMATS[name]
