"""docs/API.md covers every endpoint and every request field the code accepts."""

from __future__ import annotations

import re

from app.server import protocol
from app.server.openapi import openapi_document
from tests.conftest import REPO


def test_every_endpoint_and_field_is_documented():
    text = (REPO / "docs" / "API.md").read_text()
    for path in openapi_document("x")["paths"]:
        assert re.search(rf"`(GET|POST) {re.escape(path)}`", text), path
    for model in (protocol.CompletionRequest, protocol.ChatCompletionRequest):
        for field in model.model_fields:
            assert f"`{field}`" in text, f"{model.__name__}.{field} is not in docs/API.md"
