"""A deployment's method handles, as the role clients (decode/client.py, prefill/client.py, speech/client.py) call
them: by value over gRPC (`_by_reference=False`, serve_app/serve_env.py), each made once. A Serve handle's attribute
builds a new handle (its options copied) on every access, which py-spy put at ~10% of the router's CPU under 1-token
requests at 32 streams."""

from __future__ import annotations

from typing import Any

from ray.serve.handle import DeploymentHandle


class MethodHandles:
    """`handles("start")` is the handle of the deployment's `start` (`stream=True`: of a streaming method)."""

    def __init__(self, handle: DeploymentHandle) -> None:
        self._handle = handle
        self._calls = handle.options(_by_reference=False, stream=False)
        self._streams: Any = None  # made on the first streaming method's use
        self._made: dict[tuple[str, bool], Any] = {}

    def __call__(self, name: str, stream: bool = False) -> Any:
        method = self._made.get((name, stream))
        if method is None:
            if stream and self._streams is None:
                self._streams = self._handle.options(_by_reference=False, stream=True)
            method = self._made[(name, stream)] = getattr(self._streams if stream else self._calls, name)
        return method
