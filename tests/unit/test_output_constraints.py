"""A request's output constraint on the wire: response_format (OpenAI's three shapes) and
regex are accepted as OpenAI's clients send them, refused naming the field when malformed,
exported in the schema, and carried by the SDK as written."""

from __future__ import annotations

import json
from typing import Any

import pytest

from exlq.producer.client import _wire_form, build_request
from exlq.protocol.models import (
    GenerationRequest,
    InvalidRequest,
    JsonSchemaFormat,
    OutputConstraint,
    json_schemas,
    parse_request,
)

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
JSON_SCHEMA = {
    "type": "json_schema",
    "json_schema": {"name": "person", "description": "a person", "schema": SCHEMA, "strict": True},
}


@pytest.mark.parametrize(
    ("fields", "constraint"),
    [
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, OutputConstraint("json_object", "")),
        (
            {"response_format": JSON_SCHEMA},
            OutputConstraint("json_schema", json.dumps(SCHEMA, separators=(",", ":"))),
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
            OutputConstraint("json_schema", "{}"),
        ),
        ({"regex": r"\d{4}-\d{2}-\d{2}"}, OutputConstraint("regex", r"\d{4}-\d{2}-\d{2}")),
        # text is no constraint, so a regex beside it is the one.
        (
            {"response_format": {"type": "text"}, "regex": "yes|no"},
            OutputConstraint("regex", "yes|no"),
        ),
        ({}, None),
    ],
)
def test_each_shape_is_accepted_and_read_as_its_constraint(
    fields: dict[str, Any], constraint: OutputConstraint | None
) -> None:
    request = parse_request(json.dumps({"prompt": "x", **fields}))
    assert request.constraint == constraint
    if constraint is not None:
        assert constraint.field in (
            "response_format",
            "response_format.json_schema.schema",
            "regex",
        )


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"response_format": {"type": "xml"}}, "response_format: Input tag 'xml'"),
        ({"response_format": {}}, "response_format: Unable to extract tag"),
        ({"response_format": "json_object"}, "response_format: Input should be an object"),
        (
            {"response_format": {"type": "json_schema"}},
            "response_format.json_schema: Field required",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema.schema: Field required",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": True}}},
            "response_format.json_schema.schema: Input should be an object",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "x": 1}}},
            "response_format.json_schema.x: Extra inputs are not permitted",
        ),
        (
            {"response_format": {"type": "json_object", "schema": {}}},
            "response_format.schema: Extra inputs are not permitted",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"schema": {}, "strict": 1},
                }
            },
            "response_format.json_schema.strict: Input should be a valid boolean",
        ),
        ({"regex": ""}, "regex: String should have at least 1 character"),
        ({"regex": 5}, "regex: Input should be a valid string"),
        ({"regex": ["a"]}, "regex: Input should be a valid string"),
        (
            {"regex": "a", "response_format": {"type": "json_object"}},
            "give response_format json_object or regex, not both",
        ),
        ({"regex": "a", "response_format": JSON_SCHEMA}, "json_schema or regex, not both"),
    ],
)
def test_malformed_constraints_are_refused_naming_the_field(
    fields: dict[str, Any], message: str
) -> None:
    with pytest.raises(InvalidRequest) as caught:
        parse_request(json.dumps({"prompt": "x", **fields}))
    assert message in str(caught.value)


def test_a_schema_with_nan_is_refused() -> None:
    schema = {"type": "number", "maximum": float("nan")}
    with pytest.raises(InvalidRequest, match=r"response_format\.json_schema\.schema"):
        build_request(
            "x", {"response_format": {"type": "json_schema", "json_schema": {"schema": schema}}}
        )


def test_the_schema_field_is_written_as_schema_by_every_dump() -> None:
    # The attribute is schema_ (schema shadows a BaseModel method); the wire name is schema,
    # whether or not a dump asks for aliases.
    request = build_request("x", {"response_format": JSON_SCHEMA})
    form = request.response_format
    assert isinstance(form, JsonSchemaFormat) and form.json_schema.schema_ == SCHEMA
    for dumped in (
        json.loads(request.model_dump_json()),
        request.model_dump(),
        json.loads(request.model_dump_json(by_alias=True)),
    ):
        assert dumped["response_format"]["json_schema"]["schema"] == SCHEMA
        assert "schema_" not in dumped["response_format"]["json_schema"]


@pytest.mark.parametrize(
    "fields",
    [
        {"response_format": JSON_SCHEMA},
        {"response_format": {"type": "json_object"}},
        {"response_format": {"type": "text"}, "regex": "[a-z]+"},
        {"regex": r"\(\d{3}\) \d{3}-\d{4}"},
    ],
)
def test_the_sdk_writes_what_the_worker_reads(fields: dict[str, Any]) -> None:
    # AsyncProducer.submit and Producer.submit take these as keyword fields (build_request),
    # or inside request=; either way the entry holds them as given.
    for request in (build_request("x", fields), GenerationRequest(prompt="x", **fields)):
        job_id, raw = _wire_form(request)
        read = parse_request(raw)
        assert read == request and read.id == job_id
        assert read.constraint == request.constraint is not None
        written = json.loads(raw)
        for name, value in fields.items():
            assert written[name] == value


def test_the_exported_schema_describes_both_fields() -> None:
    request = json_schemas()["request"]
    properties = request["properties"]
    assert properties["regex"]["anyOf"][0] == {"minLength": 1, "type": "string"}
    union = properties["response_format"]["anyOf"][0]
    assert union["discriminator"]["propertyName"] == "type"
    assert set(union["discriminator"]["mapping"]) == {"text", "json_object", "json_schema"}
    spec = request["$defs"]["JsonSchemaSpec"]
    assert spec["required"] == ["schema"] and spec["additionalProperties"] is False
    assert set(spec["properties"]) == {"name", "description", "schema", "strict"}
