"""JSON-schema keywords the grammar cannot enforce, found before compiling.

xgrammar compiles some keywords into nothing (measured against its matcher: a document breaking
them is accepted): `not`, `if`/`then`/`else`, `uniqueItems: true`, `contains` (and its counts),
`dependentRequired`, `dependentSchemas`, `unevaluatedProperties`/`unevaluatedItems`, and `allOf`
over more than one schema (only the first is applied). Output under such a schema could break
it, so a schema using one is refused with a message naming the keyword and where it is. `format`
values xgrammar does not know are annotations, as JSON Schema treats formats by default.
"""

from __future__ import annotations

from typing import Any

_UNENFORCED = (
    "not",
    "if",
    "then",
    "else",
    "contains",
    "minContains",
    "maxContains",
    "dependentRequired",
    "dependentSchemas",
    "unevaluatedProperties",
    "unevaluatedItems",
)
# Keywords whose value is a schema, a list of schemas, or a name -> schema map.
_SCHEMA = ("items", "additionalProperties", "additionalItems", "propertyNames")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")


def unenforced_keyword(schema: Any, path: str = "#") -> str | None:
    """'keyword at path' for the first keyword the grammar cannot enforce, else None."""
    if not isinstance(schema, dict):
        return None
    for keyword in _UNENFORCED:
        if keyword in schema:
            return f"{keyword!r} at {path}"
    if schema.get("uniqueItems") is True:
        return f"'uniqueItems' at {path}"
    all_of = schema.get("allOf")
    if isinstance(all_of, list) and len(all_of) > 1:
        return f"'allOf' over {len(all_of)} schemas at {path}"
    for keyword in _SCHEMA:
        found = unenforced_keyword(schema.get(keyword), f"{path}/{keyword}")
        if found:
            return found
    for keyword in _SCHEMA_LISTS:
        value = schema.get(keyword)
        for i, sub in enumerate(value if isinstance(value, list) else ()):
            found = unenforced_keyword(sub, f"{path}/{keyword}/{i}")
            if found:
                return found
    for keyword in _SCHEMA_MAPS:
        value = schema.get(keyword)
        for name, sub in value.items() if isinstance(value, dict) else ():
            found = unenforced_keyword(sub, f"{path}/{keyword}/{name}")
            if found:
                return found
    return None


def schemas_in_structural_tag(tag: Any) -> list[Any]:
    """Every `json_schema` a structural tag holds (tool parameters)."""
    if isinstance(tag, dict):
        found = [tag["json_schema"]] if tag.get("type") == "json_schema" else []
        return found + [s for v in tag.values() for s in schemas_in_structural_tag(v)]
    if isinstance(tag, list):
        return [s for v in tag for s in schemas_in_structural_tag(v)]
    return []
