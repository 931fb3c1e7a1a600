"""The README's promise: the default spec, served, answers the README's own curl request with Paris."""

from __future__ import annotations

import json
import re

import httpx

from tests.conftest import CONFIG, REPO
from tests.server.conftest import Appliance


def test_default_spec_answers_the_readme_request(tmp_path):
    readme = (REPO / "README.md").read_text()
    body = json.loads(re.search(r"-d '(\{.*?\})'", readme, re.S).group(1))
    app = Appliance(tmp_path, (CONFIG / "default.yaml").read_text()).wait_ready()
    try:
        response = httpx.post(app.url + "/v1/chat/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        assert "Paris" in response.json()["choices"][0]["message"]["content"]
    finally:
        assert app.stop() == 0
