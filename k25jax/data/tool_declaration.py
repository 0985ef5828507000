"""K2.5's tool declaration: JSON-schema tools written as a TypeScript namespace.

    # Tools

    ## functions
    namespace functions {
    // {description, a comment line per line}
    type {name} = (_: {parameters}) => any;
    ...
    }

The parameters object is `{`, its fields one per line (`,\n` between them), `}`: required
fields first, then optional ones (`name?`), each group sorted by name; each field is
preceded by its description and constraints as `//` comments (`// Default: ...` for a
default). `integer` is written `number`; an enum is its values joined by ` | `; an array
`Array<item>`; `anyOf` and type lists become unions; `additionalProperties` a
`[k: string]: type` field; `$defs` become `interface`s named by `$ref`.
"""
from __future__ import annotations

import json
from typing import Any

INDENT = "  "
CONSTRAINTS = {"string": ("maxLength", "minLength", "pattern"), "number": ("maximum", "minimum"),
               "integer": ("maximum", "minimum"), "array": ("maxItems", "minItems")}
TYPE_NAMES = {"string": "string", "number": "number", "integer": "number", "boolean": "boolean", "null": "null",
              "object": "{}", "array": "Array<any>"}


def comment(text: str, indent: str = "") -> str:
  """Each line of `text` as `{indent}// line` (empty lines stay empty)."""
  return "\n".join(f"{indent}// {line}" if line else "" for line in text.split("\n"))


def _doc(schema: dict | bool, indent: str) -> str:
  """The comment lines above a field of this schema: description, then its constraints."""
  if not isinstance(schema, dict):
    return ""
  lines = [comment(schema["description"], indent)] if schema.get("description") else []
  kind = schema.get("type") if isinstance(schema.get("type"), str) and "enum" not in schema else None
  found = sorted((k, schema[k]) for k in CONSTRAINTS.get(kind, ()) if k in schema)
  if found and "anyOf" not in schema and "$ref" not in schema:
    lines.append(f"{indent}// " + ", ".join(f"{k}: {v}" for k, v in found))
  return "".join(line + "\n" for line in lines)


def _default(value: Any) -> str:
  return repr(value) if isinstance(value, (bool, int, float)) else json.dumps(value, ensure_ascii=False)


def type_of(schema: dict | bool, indent: str = "") -> str:
  """The TypeScript type of a JSON schema, its nested lines indented from `indent`."""
  if isinstance(schema, bool):
    return "any" if schema else "null"
  if "$ref" in schema:
    if not schema["$ref"].startswith("#/$defs/"):
      raise ValueError(f"tool schemas refer to their own $defs only, got $ref {schema['$ref']!r}")
    return schema["$ref"].split("/")[-1]
  if "anyOf" in schema:
    return " | ".join(type_of(s, indent) for s in schema["anyOf"])
  if "enum" in schema:
    return " | ".join(f'"{v}"' if isinstance(v, str) else str(v) for v in schema["enum"])
  kind = schema.get("type")
  if isinstance(kind, list):
    return " | ".join(TYPE_NAMES[k] for k in kind)
  if kind == "object":
    return object_type(schema, indent)
  if kind == "array":
    item = schema.get("items") or {}
    doc = _doc(item, indent + INDENT)
    if doc:
      return f"Array<\n{doc}{indent}{INDENT}{type_of(item, indent + INDENT)}\n{indent}>"
    return f"Array<{type_of(item, indent) if item else 'any'}>"
  if kind is None:
    if schema:
      raise ValueError(f"a tool parameter schema needs type, enum, anyOf or $ref: {schema}")
    return "any"
  return "number" if kind == "integer" else kind


def object_type(schema: dict, indent: str = "") -> str:
  """`{` fields `}`: required fields by name, then optional ones (`name?`) by name."""
  properties = schema.get("properties") or {}
  required = set(schema.get("required") or ())
  order = sorted(n for n in properties if n in required) + sorted(n for n in properties if n not in required)
  inner = indent + INDENT
  fields = []
  for name in order:
    prop = properties[name]
    doc = _doc(prop, inner)
    if isinstance(prop, dict) and prop.get("default") is not None:
      doc += f"{inner}// Default: {_default(prop['default'])}\n"
    fields.append(f"{doc}{inner}{name}{'' if name in required else '?'}: {type_of(prop, inner)}")
  extra = schema.get("additionalProperties")
  if extra is not None:
    value = {True: "any", False: "never"}.get(extra) if isinstance(extra, bool) else type_of(extra, inner)
    fields.append(f"{inner}[k: string]: {value}")
  return "{\n" + ",\n".join(fields) + f"\n{indent}}}" if fields else "{}"


def function_declaration(function: dict) -> str:
  """`interface`s of its `$defs`, its description as comments, then `type name = (_: ...) => any;`."""
  parameters = function.get("parameters") or {}
  parts = []
  for name, definition in (parameters.get("$defs") or {}).items():
    described = comment(definition["description"]) + "\n" if definition.get("description") else ""
    parts.append(f"{described}interface {name} {type_of(definition)}")
  if function.get("description"):
    parts.append(comment(function["description"]))
  parts.append(f"type {function['name']} = (_: {object_type(parameters)}) => any;")
  return "\n".join(parts)


def declare(tools: list[dict]) -> str:
  """The tool_declare message's content for OpenAI-shaped tools (`{"type": "function",
  "function": {name, description, parameters}}`, or the function dicts alone)."""
  functions = []
  for tool in tools:
    function = tool.get("function", tool) if tool.get("type", "function") == "function" else None
    if function is None:
      continue
    if not function.get("name"):
      raise ValueError(f"a tool needs a name: {tool}")
    functions.append(function_declaration(function))
  if not functions:
    return ""
  return "# Tools\n\n## functions\nnamespace functions {\n" + "\n".join(functions) + "\n}\n"
