"""GET /v1/models, GET /health, GET /metrics: what the server serves and how it fares."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from speculant.server.bridge.core import OpenAIServer
from speculant.server.http.errors import ERROR_RESPONSES, APIError, error_response
from speculant.server.openai.protocol import ModelCard, ModelList

router = APIRouter()


@router.get("/v1/models", responses=ERROR_RESPONSES, response_model=ModelList)
def models(request: Request) -> ModelList:
    server: OpenAIServer = request.app.state.server
    # The name clients send, never the path the weights were loaded from.
    return ModelList(data=[ModelCard(id=name, root=name, max_model_len=server.engine.max_model_len)
                           for name in server.model_names])


@router.get("/health", responses=ERROR_RESPONSES)
def health(request: Request) -> Response:
    if not request.app.state.server.worker.accepting:
        return error_response(APIError(503, "the server is shutting down", "service_unavailable"))
    return JSONResponse({"status": "ok"})


@router.get("/metrics", responses=ERROR_RESPONSES)
def render_metrics(request: Request) -> Response:
    metrics = request.app.state.server.metrics
    return Response(metrics.render(), media_type=metrics.content_type)
