"""The `eft serve` deployment: a Ray Serve FastAPI ingress answering OpenAI's `/v1/models`,
`/v1/chat/completions` and `/v1/completions`, streaming as server-sent events on `stream: true`.

The bearer token (when one is set) is one dependency of the whole app, `require_token`, which
FastAPI runs before any route, and before the body is read: a route added later cannot forget it,
and a caller without the token learns nothing about the API, not even which fields it takes.
FastAPI's own pages (/docs, /openapi.json) are off: nothing is served unauthenticated. Replicas
log through `logging` (Serve's replica log files), never print, and never log a request's headers.

No `from __future__ import annotations` here: FastAPI reads the routes' parameter annotations (the
`Request`) as types, and Serve's ingress rebinds the methods where string annotations do not resolve.
"""

import json
import logging
import time
from typing import Optional

from fastapi import Depends, FastAPI, Request, Security
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from ray import serve

from app.serve import openai_api as oa
from app.serve.auth import is_token_valid
from app.serve.generate import Sampling, TextGenerator, aiter_pieces, join_pieces
from app.serve.source import ServedModel

# Under Serve's own logger: a replica writes what it logs to Serve's replica log files (with the
# replica's id); a logger of another name would have no handler there.
log = logging.getLogger("ray.serve.eft")

# auto_error off: a missing or non-Bearer header is refused by require_token, in OpenAI's error body.
bearer = HTTPBearer(auto_error=False, description="the token `eft serve` was given (--token-file, EFT_SERVE_TOKEN)")


async def read_replica_token_digest() -> Optional[bytes]:
    """The token digest the replica answering this request was built with (async: no threadpool hop)."""
    return serve.get_replica_context().servable_object.token_digest


async def require_token(credentials: Optional[HTTPAuthorizationCredentials] = Security(bearer),
                        digest: Optional[bytes] = Depends(read_replica_token_digest)) -> None:
    """The app's one dependency: FastAPI runs it before every route's own parameters, the body
    included. HTTPBearer declares the scheme, so the app's OpenAPI shows it on every operation."""
    if not is_token_valid(credentials.credentials if credentials else None, digest):
        raise unauthorized()


api = FastAPI(title="eft serve", docs_url=None, redoc_url=None, openapi_url=None,
              dependencies=[Depends(require_token)])


@api.exception_handler(oa.RequestError)
async def answer_request_error(request: Request, err: oa.RequestError) -> JSONResponse:
    return error_response(err)


def error_response(err: oa.RequestError) -> JSONResponse:
    return JSONResponse(oa.error_body(str(err), err.kind, err.param, err.code), status_code=err.status)


def unauthorized() -> oa.RequestError:
    return oa.RequestError("missing or wrong bearer token (send Authorization: Bearer <token>)", status=401,
                           kind="authentication_error", code="invalid_api_key")


@serve.deployment(name="EftModel")
@serve.ingress(api)
class ServeModel:
    """One replica: the export loaded once, then requests answered in the training format."""

    def __init__(self, served: dict, token_digest: Optional[bytes], max_tokens_limit: int):
        self.served = ServedModel(**served)
        self.token_digest = token_digest
        self.generator = TextGenerator(self.served, max_tokens_limit)
        self.created = int(time.time())
        log.info("serving %s: the %s export %s (step %s) on %s, %d torch thread(s)", self.served.name,
                 self.served.kind, self.served.export_uri, self.served.step, self.generator.device,
                 self.generator.threads)

    # -- routes ----------------------------------------------------------------------------

    @api.get("/v1/models")
    async def list_models(self):
        return oa.models_response(self.served.name, self.created, self.served.export_uri)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        # A RequestError raised here is answered by answer_request_error, as OpenAI's error body.
        body = await self.read_request(request, oa.ChatCompletionRequest)
        ids = self.generator.chat_ids([m.as_template_message() for m in body.messages])
        sampling = self.sampling(body, ids, self.generator.max_tokens_limit)
        return await self.answer(oa.new_id("chatcmpl"), body, ids, sampling, self.chat_events, oa.chat_response)

    @api.post("/v1/completions")
    async def completions(self, request: Request):
        body = await self.read_request(request, oa.CompletionRequest)
        ids = self.generator.prompt_ids(body.prompt_text)
        sampling = self.sampling(body, ids, oa.COMPLETION_DEFAULT_MAX_TOKENS)
        return await self.answer(oa.new_id("cmpl"), body, ids, sampling, self.completion_events,
                                 oa.completion_response)

    # -- helpers ---------------------------------------------------------------------------

    async def answer(self, rid: str, body: oa.SamplingRequest, ids: list[int], sampling: Sampling, events, respond):
        """Server-sent events from `events` on `stream: true`; else the whole answer, one body from `respond`."""
        if body.stream:
            return StreamingResponse(events(rid, ids, sampling, body.include_usage), media_type="text/event-stream")
        text, finish, prompt_n, completion_n = join_pieces(
            [p async for p in aiter_pieces(self.generator, ids, sampling, incremental=False)])
        return respond(rid, self.served.name, text, finish, oa.usage(prompt_n, completion_n))

    async def read_request(self, request: Request, model: type[oa.SamplingRequest]) -> oa.SamplingRequest:
        """The body (require_token has passed), then the model the request names."""
        try:
            payload = json.loads(await request.body() or b"null")
        except ValueError:
            raise oa.RequestError("the body is not JSON") from None
        body = oa.parse_request(model, payload)
        if body.model != self.served.name:
            raise oa.RequestError(f"the model {body.model!r} does not exist; this server serves {self.served.name!r}",
                                  param="model", status=404, code="model_not_found")
        return body

    def sampling(self, body: oa.SamplingRequest, ids: list[int], default_max_tokens: int) -> Sampling:
        return self.generator.check_budget(ids, Sampling(**body.sampling(default_max_tokens)))

    async def chat_events(self, rid: str, ids: list[int], sampling: Sampling, include_usage: bool):
        name = self.served.name
        yield oa.sse(oa.chat_chunk(rid, name, {"role": "assistant", "content": ""}))
        async for piece in aiter_pieces(self.generator, ids, sampling):
            if piece.text:
                yield oa.sse(oa.chat_chunk(rid, name, {"content": piece.text}))
            if piece.finish_reason is not None:
                yield oa.sse(oa.chat_chunk(rid, name, {}, piece.finish_reason))
                if include_usage:
                    yield oa.sse(oa.chat_chunk(rid, name, {}, used=oa.usage(piece.prompt_tokens,
                                                                            piece.completion_tokens)))
        yield oa.SSE_DONE

    async def completion_events(self, rid: str, ids: list[int], sampling: Sampling, include_usage: bool):
        name = self.served.name
        async for piece in aiter_pieces(self.generator, ids, sampling):
            if piece.text or piece.finish_reason is not None:
                yield oa.sse(oa.completion_chunk(rid, name, piece.text, piece.finish_reason))
            if piece.finish_reason is not None and include_usage:
                yield oa.sse(oa.completion_chunk(rid, name, "", used=oa.usage(piece.prompt_tokens,
                                                                              piece.completion_tokens)))
        yield oa.SSE_DONE


def build_app(served: ServedModel, token_digest: Optional[bytes], replicas: int, cpus_per_replica: float,
              max_tokens_limit: int):
    """The Serve application: `replicas` copies of the model, one CPU slot each by default. A stopping
    replica checks for requests still in flight every half second (Serve's default, 2 s, is what a
    `eft serve` stop would wait on an idle replica) and gives them up to 20 s to finish."""
    return ServeModel.options(num_replicas=replicas, ray_actor_options={"num_cpus": cpus_per_replica},
                              graceful_shutdown_wait_loop_s=0.5, graceful_shutdown_timeout_s=20).bind(
        served.to_dict(), token_digest, max_tokens_limit)
