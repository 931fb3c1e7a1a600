"""config/spec.schema.json: generated from the spec models, in sync, and agreeing with them on what a spec is."""

from __future__ import annotations

import json

import jsonschema
import pytest
import yaml

from app.spec.docs import spec_schema
from app.spec.errors import SpecError
from app.spec.load import parse_spec
from tests.conftest import CONFIG

SCHEMA = json.loads((CONFIG / "spec.schema.json").read_text())
MODELINE = "# yaml-language-server: $schema=spec.schema.json"


def _schema_accepts(doc: dict) -> bool:
    return jsonschema.Draft202012Validator(SCHEMA).is_valid(doc)


def _models_accept(doc: dict) -> bool:
    try:
        parse_spec(yaml.safe_dump(doc), "spec.yaml")
        return True
    except SpecError:
        return False


def test_the_committed_schema_is_the_generated_one():
    jsonschema.Draft202012Validator.check_schema(SCHEMA)
    assert (CONFIG / "spec.schema.json").read_text() == spec_schema(), \
        "rerun: python -m app spec-schema > config/spec.schema.json"


@pytest.mark.parametrize("path", sorted(CONFIG.glob("*.yaml")), ids=lambda p: p.name)
def test_every_example_spec_names_the_schema_and_passes_it(path):
    text = path.read_text()
    assert text.splitlines()[0] == MODELINE  # editors then complete and check keys while typing
    jsonschema.validate(yaml.safe_load(text) or {}, SCHEMA)


SPELLINGS = [  # each accepted by the models: the schema must not flag it in an editor
    {}, {"parallel": {"tp": 2}, "cores": {"ranks": "0-1|2-3"}},
    {"parallel": {"dp": 2}, "cores": {"ranks": [[0, 1], "2-3"]}}, {"cores": {"ranks": "0-15:2"}},
    {"cores": {"frontend": 3}}, {"cores": {"frontend": "3,5"}}, {"cores": {"frontend": [3]}},
    {"kv_cache": {"memory": 0.3}}, {"kv_cache": {"memory": "30%"}}, {"kv_cache": {"memory": "4GiB"}},
    {"kv_cache": {"memory": "1.5 GB"}}, {"kv_cache": {"memory": 1073741824}}, {"server": {"max_body_size": "8MiB"}},
    {"parallel": {"tp": 2, "dp": 3}}, {"model": {"dtype": "bfloat16", "max_model_len": 4096}},
]
MISTAKES = [  # each refused by the models: the schema flags it too
    {"bogus": 1}, {"model": {"dtpye": "float32"}}, {"model": {"dtype": "fp8"}}, {"parallel": {"tp": 0}},
    {"parallel": {"dp": "two"}}, {"cores": {"ranks": "0-a"}}, {"cores": {"frontend": -1}},
    {"kv_cache": {"memory": "4 GiBs"}}, {"kv_cache": {"memory": 1.5}}, {"kv_cache": {"block_size": 12}},
    {"server": {"port": 70000}},
]


@pytest.mark.parametrize("doc", SPELLINGS, ids=json.dumps)
def test_schema_accepts_what_the_spec_accepts(doc):
    assert _models_accept(doc) and _schema_accepts(doc)


@pytest.mark.parametrize("doc", MISTAKES, ids=json.dumps)
def test_schema_refuses_what_the_spec_refuses(doc):
    assert not _models_accept(doc) and not _schema_accepts(doc)
