"""/docs: Swagger UI over /openapi.json, as vLLM serves it; public and documented like
/openapi.json itself."""

from __future__ import annotations

import httpx
import pytest

from frontend_svc.server.openapi import PUBLIC_PATHS, SWAGGER_UI_DIST, swagger_ui_page
from tests.frontend.fake_engine import FakeEngine
from tests.frontend.harness import GatewayServer

pytestmark = pytest.mark.timeout(30)


def test_docs_is_swagger_ui_over_the_openapi_document(gateway: GatewayServer) -> None:
    r = httpx.get(f"{gateway.url}/docs", timeout=5)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/html")
    page = r.text
    assert f'rel="stylesheet" href="{SWAGGER_UI_DIST}/swagger-ui.css">' in page
    assert f'<script src="{SWAGGER_UI_DIST}/swagger-ui-bundle.js"></script>' in page
    assert 'url: "/openapi.json"' in page
    assert httpx.get(f"{gateway.url}/openapi.json", timeout=5).status_code == 200


def test_docs_is_documented_and_public_like_the_document(engine: FakeEngine) -> None:
    g = GatewayServer(engine.address, api_key="sekret").start()
    try:
        for path in ("/openapi.json", "/docs"):
            assert path in PUBLIC_PATHS
            assert httpx.get(f"{g.url}{path}", timeout=5).status_code == 200  # no key needed
        assert httpx.get(f"{g.url}/v1/models", timeout=5).status_code == 401
        doc = httpx.get(f"{g.url}/openapi.json", timeout=5).json()
        for path in ("/openapi.json", "/docs"):
            assert doc["paths"][path]["get"]["security"] == []
            assert "401" not in doc["paths"][path]["get"]["responses"]
        assert "text/html" in doc["paths"]["/docs"]["get"]["responses"]["200"]["content"]
    finally:
        g.stop()


def test_the_page_follows_a_root_path_and_escapes_it() -> None:
    assert 'url: "/proxy/openapi.json"' in swagger_ui_page("/proxy/openapi.json")
    page = swagger_ui_page("/</script><script>alert(1)//openapi.json")
    assert "</script><script>alert" not in page
