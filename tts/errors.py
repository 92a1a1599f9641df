"""The errors a TTS call ends with: an item `{"error": {...}}` of OpenAI's error shape (`message`, `type`, `param`,
`code`), never an exception (a remote speech server that fails costs its call, not the replica)."""

from __future__ import annotations

from tts.client import SpeechChunk


def invalid_request(param: str, message: str, code: str = "invalid_value") -> SpeechChunk:
    """The request itself is wrong (HTTP 400 to the router's client): `param` names the field."""
    return {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": code}}


def backend_failed(message: str, code: str = "tts_backend_error") -> SpeechChunk:
    """The backend could not speak it (a remote server's error, refused connection, timeout; a voice the engine
    does not have): a server error."""
    return {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
