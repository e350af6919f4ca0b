"""A fake vLLM OpenAI server for router tests: records requests, delays, fails, streams SSE.

``FakeVLLM(name, role)`` builds a FastAPI app (``.app``) serving ``/v1/completions``,
``/v1/chat/completions``, ``/v1/models``, ``/version``, ``/tokenize`` and ``/health``. Its behaviour is set through
``.behavior`` (mutable between requests) and every request is kept in ``.records`` with its body,
headers, monotonic start/end times, the bytes it sent, and whether the client went away before
the response was complete (``disconnected``) -- which is how tests see that the router cancelled
a leg. In the ``prefill`` role it answers requests carrying ``kv_transfer_params.do_remote_decode``
with ``kv_transfer_params`` in its JSON, as vLLM's NIXL connectors do.

:func:`bind` takes a free loopback port and :func:`serve_all` runs ASGI apps on such ports with
uvicorn inside the running event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pydantic
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kv_push.common.testing.ports import free_ports


_STREAM = pydantic.TypeAdapter(bool | None)


@dataclass
class Behavior:
    delay: float = 0.0  # seconds before the response (before the first chunk when streaming)
    fail_status: int | None = None  # answer with this HTTP status and an OpenAI-style error
    error_body: dict | None = None  # that error's body (default: "<name> failed")
    n_chunks: int = 3  # streamed content chunks (followed by data: [DONE])
    chunk_interval: float = 0.0  # seconds between streamed chunks
    transfer_mode: str = "pull"  # echoed in the prefill role's kv_transfer_params
    no_kv_params: bool = False  # the prefill role returns no kv_transfer_params
    stream_error_code: int = 500  # that failure's ``code`` (400: vLLM refused the request)
    stream_error: bool = False  # a stream fails before any output, as vLLM's does (HTTP 200,
    # then -- chat: after its role chunk -- an error event and [DONE])
    error_after_output: bool = False  # a stream fails after its content chunks (error event)
    linger_after_done: float = 0.0  # seconds the body stays open after its [DONE]
    break_after_done: bool = False  # the connection drops after the [DONE] (no body end)
    metrics_text: str = ""  # what GET /metrics answers
    break_after: int | None = None  # a stream breaks (connection dropped) after this many chunks
    #: the generated tokens' texts (default "<name>-tok<i> "); with them, streams look like
    #: vLLM's: ``max_tokens`` of them, chat opens with a role chunk, the last chunk carries
    #: ``finish_reason`` ("stop" when ``eos_at`` is reached), ``stream_options.include_usage``
    #: adds a usage chunk
    tokens: list[str] | None = None
    eos_at: int | None = None  # the token index that is an end of sequence (its text is "")
    version: str | None = "0.32.0+fake"  # what GET /version answers (None: 404)
    model_root: str = "/models/fake"  # the ``root`` of its one model in GET /v1/models
    max_model_len: int | None = 1024  # that model's ``max_model_len`` there (None: left out)
    side_channel: str | None = None  # the prefill role names it in its answers (as kv-push's)


def _stream_error(code: int) -> dict:
    """The error event vLLM streams after its 200: a failure (5xx) or a refused request (4xx,
    e.g. a token id outside the vocabulary)."""
    if code >= 500:
        return {"error": {"message": "Internal server error", "type": "InternalServerError",
                          "param": None, "code": code}}
    return {"error": {"message": "token id 999999 is out of vocabulary",
                      "type": "BadRequestError", "param": None, "code": code}}


def _role_chunk(rid: str) -> dict:
    return {"id": f"chatcmpl-{rid}", "object": "chat.completion.chunk", "created": 1700000000,
            "model": "fake-model", "choices": [{"index": 0, "delta": {"role": "assistant",
                                                                     "content": ""},
                                                "logprobs": None, "finish_reason": None}]}


@dataclass
class Record:
    path: str
    body: dict
    headers: dict[str, str]
    start: float
    end: float | None = None
    completed: bool = False
    disconnected: bool = False
    disconnected_at: float | None = None
    sent: bytes = b""
    response_json: dict | None = None
    raw: bytes = b""  # the request's body as it came

    @property
    def request_id(self) -> str | None:
        return self.headers.get("x-request-id")

    @property
    def kv(self) -> dict | None:
        return self.body.get("kv_transfer_params")


@dataclass
class FakeVLLM:
    name: str
    role: str = "decode"  # or "prefill"
    kv_host: str = "127.0.0.1"
    kv_port: int = 0
    behavior: Behavior = field(default_factory=Behavior)
    records: list[Record] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.engine_id = f"engine-{self.name}"
        self.app = FastAPI()
        self.app.post("/v1/completions")(self._completions)
        self.app.post("/v1/chat/completions")(self._chat)
        self.app.get("/v1/models")(self._models)
        self.app.get("/version")(self._version)
        self.app.post("/tokenize")(self._tokenize)
        self.app.get("/health")(lambda: Response(status_code=200))
        self.app.get("/metrics")(lambda: Response(self.behavior.metrics_text,
                                                  media_type="text/plain"))

    # -- handlers ----------------------------------------------------------------------------

    async def _completions(self, request: Request) -> Response:
        return await self._serve(request, chat=False)

    async def _chat(self, request: Request) -> Response:
        return await self._serve(request, chat=True)

    async def _models(self) -> JSONResponse:
        model = {"id": "fake-model", "owned_by": self.name, "root": self.behavior.model_root}
        if self.behavior.max_model_len is not None:
            model["max_model_len"] = self.behavior.max_model_len
        return JSONResponse({"object": "list", "data": [model]})

    async def _version(self) -> Response:
        if self.behavior.version is None:
            return Response(status_code=404)
        return JSONResponse({"version": self.behavior.version})

    async def _tokenize(self, request: Request) -> JSONResponse:
        """One token per character; the server's name and the caller's ``Authorization``."""
        prompt = json.loads(await request.body())["prompt"]
        return JSONResponse({"tokens": [ord(ch) for ch in prompt], "count": len(prompt),
                             "server": self.name,
                             "authorization": request.headers.get("authorization")})

    async def _serve(self, request: Request, chat: bool) -> Response:
        raw = await request.body()
        body = json.loads(raw)
        try:  # ``stream`` as vLLM's pydantic request models read it (lax: "false", 0, ...)
            stream = bool(_STREAM.validate_python(body.get("stream")))
        except pydantic.ValidationError as e:
            return JSONResponse({"error": {"message": str(e), "type": "BadRequestError",
                                           "code": 400}}, status_code=400)
        rec = Record(request.url.path, body, dict(request.headers), time.monotonic(), raw=raw)
        self.records.append(rec)
        b = self.behavior
        watcher = asyncio.ensure_future(self._watch(request, rec))
        if b.delay and not stream:
            await asyncio.wait({watcher}, timeout=b.delay)
            if rec.disconnected:
                rec.end = time.monotonic()
                return Response(status_code=499)
        if b.fail_status is not None:
            if stream and b.delay:
                await asyncio.wait({watcher}, timeout=b.delay)
            return self._finish(rec, watcher, JSONResponse(
                b.error_body or {"error": {"message": f"{self.name} failed",
                                           "type": "InternalServerError", "code": b.fail_status}},
                status_code=b.fail_status))
        rid = rec.request_id or "none"
        if stream:
            return StreamingResponse(self._stream(rec, watcher, rid, chat),
                                     media_type="text/event-stream")
        text = "".join(self._token(i) for i in range(b.n_chunks))
        if chat:
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                      "finish_reason": "length"}
        else:
            choice = {"index": 0, "text": text, "finish_reason": "length"}
        out = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{rid}", "object": "fake", "created": 0,
               "model": body.get("model", "fake-model"), "choices": [choice],
               "usage": {"prompt_tokens": 3, "completion_tokens": b.n_chunks},
               "kv_transfer_params": self._kv_params(rec, chat)}
        rec.response_json = out
        return self._finish(rec, watcher, JSONResponse(out))

    # -- helpers -----------------------------------------------------------------------------

    def _token(self, i: int) -> str:
        if self.behavior.tokens is not None:
            return "" if i == self.behavior.eos_at else self.behavior.tokens[i]
        return f"{self.name}-tok{i} "

    def _vllm_stream(self, body: dict, chat: bool, rid: str) -> list[bytes]:
        """The events vLLM would stream for ``body`` with ``behavior.tokens`` (see Behavior)."""
        b = self.behavior
        n = min(int(body.get("max_tokens") or len(b.tokens)), len(b.tokens))
        if b.eos_at is not None:
            n = min(n, b.eos_at + 1)
        head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{rid}",
                "object": "chat.completion.chunk" if chat else "text_completion",
                "created": 1700000000, "model": body.get("model", "fake-model")}
        out = []
        continuous = (body.get("stream_options") or {}).get("continuous_usage_stats")
        if chat:
            out.append({**head, "choices": [{"index": 0, "delta": {"role": "assistant",
                                                                   "content": ""},
                                             "logprobs": None, "finish_reason": None}]})
            if continuous:  # vLLM's role chunk carries usage too (no token yet)
                out[-1]["usage"] = {"prompt_tokens": 3, "completion_tokens": 0,
                                    "total_tokens": 3}
        for i in range(n):
            last = i == n - 1
            finish = ("stop" if i == b.eos_at else "length") if last else None
            if chat:  # vLLM sets stop_reason on a chat choice's last chunk only
                choice: dict[str, Any] = {"index": 0, "delta": {"content": self._token(i)},
                                          "logprobs": None, "finish_reason": finish}
                if last:
                    choice["stop_reason"] = None
            else:
                choice = {"index": 0, "text": self._token(i), "logprobs": None,
                          "finish_reason": finish, "stop_reason": None}
            event = {**head, "choices": [choice]}
            if (body.get("stream_options") or {}).get("continuous_usage_stats"):
                event["usage"] = {"prompt_tokens": 3, "completion_tokens": i + 1,
                                  "total_tokens": 4 + i}
            out.append(event)
        if (body.get("stream_options") or {}).get("include_usage"):
            out.append({**head, "choices": [], "usage": {"prompt_tokens": 3,
                                                         "completion_tokens": n}})
        return [f"data: {json.dumps(e)}\n\n".encode() for e in out]

    def _kv_params(self, rec: Record, chat: bool) -> dict | None:
        """What vLLM's P returns (pull/push schedulers' ``request_finished``)."""
        if self.role != "prefill" or not (rec.kv or {}).get("do_remote_decode") \
                or self.behavior.no_kv_params:
            return None
        prefix = "chatcmpl" if chat else "cmpl"
        if "transfer_id" in rec.kv:  # our form: P holds the prefill under the router's id
            reply = {"transfer_id": rec.kv["transfer_id"]}
            if self.behavior.side_channel:
                reply["side_channel"] = self.behavior.side_channel
            return reply
        return {"do_remote_prefill": True, "do_remote_decode": False,
                "remote_block_ids": [[1, 2, 3]], "remote_engine_id": self.engine_id,
                "remote_request_id": f"{prefix}-{rec.request_id}-0-abcdef12",
                "remote_host": self.kv_host, "remote_port": self.kv_port, "tp_size": 1,
                "dcp_size": 1, "pp_size": 1, "remote_num_tokens": 3,
                "transfer_mode": self.behavior.transfer_mode}

    def _finish(self, rec: Record, watcher: asyncio.Future, resp: Response) -> Response:
        rec.completed = True
        rec.end = time.monotonic()
        rec.sent = bytes(resp.body)
        watcher.cancel()
        return resp

    async def _stream(self, rec: Record, watcher: asyncio.Future, rid: str, chat: bool
                      ) -> AsyncIterator[bytes]:
        b = self.behavior
        try:
            if b.delay:
                await asyncio.wait({watcher}, timeout=b.delay)
            if b.stream_error:
                err = _stream_error(b.stream_error_code)
                # vLLM's chat stream sends its role chunk before it learns of the failure
                role = ([f"data: {json.dumps(_role_chunk(rid))}\n\n".encode()] if chat else [])
                for data in (*role, f"data: {json.dumps(err)}\n\n".encode(),
                             b"data: [DONE]\n\n"):
                    rec.sent += data
                    yield data
                rec.completed = True
                return
            if b.tokens is not None:
                events = self._vllm_stream(rec.body, chat, rid)
            else:
                events = []
                for i in range(b.n_chunks):
                    if chat:
                        choice: dict[str, Any] = {"index": 0,
                                                  "delta": {"content": self._token(i)}}
                    else:
                        choice = {"index": 0, "text": self._token(i)}
                    chunk = {"id": f"x-{rid}", "object": "chunk", "choices": [choice]}
                    events.append(f"data: {json.dumps(chunk)}\n\n".encode())
            for i, data in enumerate(events):
                if rec.disconnected:
                    return
                if b.break_after is not None and i == b.break_after:
                    raise ConnectionAbortedError("fake server died mid-stream")
                if i and b.chunk_interval:
                    await asyncio.sleep(b.chunk_interval)
                rec.sent += data
                yield data
            if b.error_after_output:
                err = _stream_error(b.stream_error_code)
                data = f"data: {json.dumps(err)}\n\n".encode()
                rec.sent += data
                yield data
            rec.sent += b"data: [DONE]\n\n"
            rec.completed = True  # before the last send, so the watcher can tell a normal end
            yield b"data: [DONE]\n\n"
            if b.linger_after_done:  # the body's end comes later (a slow connection close)
                await asyncio.sleep(b.linger_after_done)
            if b.break_after_done:
                raise ConnectionAbortedError("fake server died after its last event")
        finally:
            rec.end = time.monotonic()
            if not rec.completed:
                self._mark_disconnected(rec)

    @staticmethod
    def _mark_disconnected(rec: Record) -> None:
        if not rec.disconnected:
            rec.disconnected, rec.disconnected_at = True, time.monotonic()

    async def _watch(self, request: Request, rec: Record) -> None:
        """Flag the record when the client goes away before the response was complete."""
        while (await request.receive())["type"] != "http.disconnect":
            pass
        if not rec.completed:
            self._mark_disconnected(rec)


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):  # type: ignore[override]  # leave pytest's signal handlers alone
        yield


def free_port() -> int:
    """A loopback port nothing listens on (``kv_push.common.testing.ports``)."""
    return free_ports(1)


def bind() -> tuple[socket.socket, str]:
    """A listening-ready socket on a free 127.0.0.1 port, and its base URL."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock, f"http://127.0.0.1:{sock.getsockname()[1]}"


@contextlib.asynccontextmanager
async def serve_all(apps_and_socks: list[tuple[Any, socket.socket]]) -> AsyncIterator[None]:
    """Run each app with uvicorn on its socket in this event loop; stop them all together."""
    http = os.environ.get("KV_PUSH_TEST_HTTP", "auto")  # "h11" to test the other ASGI server
    servers = [_Server(uvicorn.Config(app, http=http, log_level="warning", lifespan="on",
                                      timeout_graceful_shutdown=2))
               for app, _ in apps_and_socks]
    tasks = [asyncio.ensure_future(srv.serve(sockets=[sock]))
             for srv, (_, sock) in zip(servers, apps_and_socks)]
    try:
        deadline = time.monotonic() + 10
        while not all(srv.started for srv in servers):
            for task in tasks:
                if task.done():
                    task.result()
                    raise RuntimeError("uvicorn exited during start-up")
            if time.monotonic() > deadline:
                raise TimeoutError("uvicorn did not start within 10 s")
            await asyncio.sleep(0.005)
        yield
    finally:
        for srv in servers:
            srv.should_exit = True
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), timeout=5)
        for _, sock in apps_and_socks:
            sock.close()
