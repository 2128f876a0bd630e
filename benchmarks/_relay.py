"""A relay for bench_loadgen.py: forwards every request to one OpenAI-style server, less the two vLLM extensions that
`shardtool serve` refuses as unknown fields (`ignore_eos`, `stream_options.continuous_usage_stats`), which guidellm
sends with every streamed request of a fixed output length. The load generator stays unchanged; each server of a
comparison sits behind the same relay, so both get the same bodies and the same extra hop.

    python benchmarks/_relay.py UPSTREAM_URL PORT     (listens on 127.0.0.1:PORT until SIGTERM)
"""

from __future__ import annotations

import json
import sys

DROPPED = ("ignore_eos",)  # top-level body fields
DROPPED_STREAM_OPTIONS = ("continuous_usage_stats",)  # fields of stream_options


def strip(body: object) -> object:
    """`body` without the fields in DROPPED and DROPPED_STREAM_OPTIONS; anything else exactly as it came."""
    if not isinstance(body, dict):
        return body
    out = {k: v for k, v in body.items() if k not in DROPPED}
    if isinstance(out.get("stream_options"), dict):
        out["stream_options"] = {k: v for k, v in out["stream_options"].items() if k not in DROPPED_STREAM_OPTIONS}
    return out


def app(upstream: str):
    import httpx
    from starlette.applications import Starlette
    from starlette.background import BackgroundTask
    from starlette.requests import Request
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    client = httpx.AsyncClient(base_url=upstream, timeout=None, limits=httpx.Limits(max_connections=None))

    async def relay(request: Request) -> StreamingResponse:
        raw = await request.body()
        if raw and request.headers.get("content-type", "").startswith("application/json"):
            raw = json.dumps(strip(json.loads(raw))).encode()
        headers = {k: v for k, v in request.headers.items() if k in ("content-type", "authorization", "accept")}
        sent = client.build_request(request.method, request.url.path, params=request.query_params, content=raw,
                                    headers=headers)
        answer = await client.send(sent, stream=True)
        return StreamingResponse(answer.aiter_raw(), status_code=answer.status_code,
                                 headers={"content-type": answer.headers.get("content-type", "application/json")},
                                 background=BackgroundTask(answer.aclose))

    return Starlette(routes=[Route("/{path:path}", relay, methods=["GET", "POST"])])


def main(argv: list[str]) -> None:
    import uvicorn

    upstream, port = argv
    uvicorn.run(app(upstream), host="127.0.0.1", port=int(port), log_level="warning", access_log=False)


if __name__ == "__main__":
    main(sys.argv[1:])
