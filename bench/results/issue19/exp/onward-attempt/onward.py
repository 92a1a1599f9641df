"""A whole prompt's answer started on decode by the prefill replica itself, once its KV is ready.

Without this, a disaggregated request went router → prefill → router → decode: the router waited for the KV's
address only to pass it on, one Ray round trip more before the first token and one more call through the
router's event loop per request. With it the request flows router → prefill → decode, and decode's frames go
to the router's feed (decode/feed.py) as for any stream: the router names its feed (`consumer`) and the
stream's id up front, and only reads.

The router keeps what it did: when the start fails here (decode replica gone, engine failure) the prefill still
returns the KV's address and the router starts decode itself, with its retries (router/feeds.py `_start`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from serve_app.protocol import Endpoint, error_body

logger = logging.getLogger(__name__)
_stopping: set[asyncio.Task[None]] = set()  # (a task nobody awaits must be referenced until it is done)


async def start_decode(
    decode: Any, onward: dict[str, Any], endpoint: Endpoint, body: dict[str, Any], kv_transfer_params: dict[str, Any]
) -> dict[str, Any]:
    """Start `body` on decode with the KV at `kv_transfer_params`, for the stream `onward` names
    (`consumer`, `stream_id`, `ids`: router/feeds.py `Feeds.onward`). decode's reply (`{"replica": ...}`, or an
    error), or a 503 error when decode could not be called. If the caller is cancelled meanwhile (the client
    left), a stream that started is stopped."""
    request = {**body, "kv_transfer_params": kv_transfer_params}
    if onward.get("ids") is not None:  # (as the router would send it: it reads the token ids beside the frames)
        request["return_token_ids"] = True
    call = asyncio.ensure_future(
        decode.start.remote(
            consumer=onward["consumer"],
            stream_id=onward["stream_id"],
            endpoint=endpoint,
            body=request,
            ids=onward.get("ids"),
        )
    )
    try:
        return await asyncio.shield(call)
    except asyncio.CancelledError:
        call.add_done_callback(lambda done: _stop_started(decode, onward, done))
        raise
    except Exception as e:  # (the router starts it itself)
        logger.warning("decode start of %s from prefill failed: %s", onward["stream_id"], e)
        return error_body(503, f"decode could not be called: {e}")


def _stop_started(decode: Any, onward: dict[str, Any], call: asyncio.Future[Any]) -> None:
    if call.cancelled() or call.exception() is not None:
        return
    started = call.result()
    if isinstance(started, dict) and "replica" in started:
        task = asyncio.ensure_future(_stop(decode, onward, started["replica"]))
        _stopping.add(task)
        task.add_done_callback(_stopping.discard)


async def _stop(decode: Any, onward: dict[str, Any], replica: str) -> None:
    with contextlib.suppress(Exception):
        await decode.stop.remote(consumer=onward["consumer"], stream_id=onward["stream_id"], replica=replica)
