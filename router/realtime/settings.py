"""A realtime connection's session settings (router/realtime/socket.py `RealtimeConnection` holds them):
`session.update` and what it sets, in OpenAI's names (instructions, sampling, tools, output modalities, preemptive
answers, and the audio settings of router/realtime/audio_settings.py), checked whole before the owner takes them; the
session object the client is shown; and their translation into vLLM's sampling parameters."""

from __future__ import annotations

from typing import Any, Protocol

from router.openai import tool_calls
from router.realtime.audio_settings import VoiceSettings
from router.realtime.connection import Calls, EarlyReads
from router.realtime.events import InvalidEvent, Sampling, SessionUpdate
from router.sessions.owner import session_update


class SettingsAudio(Protocol):
    """What the settings need of the audio input (router/realtime/audio.py): its settings, shown and set here."""

    settings: VoiceSettings

    @property
    def speech_model(self) -> str | None: ...

    @property
    def transcription_only(self) -> bool: ...

    def configure(self, session: Sampling, where: str = "session") -> VoiceSettings | None: ...

    def apply(self, settings: VoiceSettings) -> None: ...

    def use_vllm_flow(self, model: str) -> None: ...


class SettingsConnection(Calls, Protocol):
    """What the settings need of their connection (router/realtime/socket.py)."""

    session_id: str | None

    @property
    def audio(self) -> SettingsAudio: ...

    @property
    def conversation(self) -> EarlyReads: ...


class SessionSettings:
    """`session.update` and the settings it keeps (`values`), for one connection."""

    def __init__(self, connection: SettingsConnection, model: str, beta: bool) -> None:
        self.connection = connection
        self.beta = beta  # beta event names and fields (`OpenAI-Beta: realtime=v1`)
        self.values: dict[str, Any] = {
            "model": model,
            "instructions": "",
            "max_output_tokens": "inf",
            "temperature": 0.8,
            "tools": [],
            "tool_choice": "auto",
            self.modalities_key: ["text"],
        }

    @property
    def modalities_key(self) -> str:
        return "modalities" if self.beta else "output_modalities"

    def session_object(self) -> dict[str, Any]:
        audio = self.connection.audio
        kind = "transcription" if audio.transcription_only else "realtime"
        shown = audio.settings.shown(self.beta, audio.speech_model)
        return {"id": self.connection.session_id, "object": "realtime.session", "type": kind, **self.values, **shown}

    def restore(self, info: dict[str, Any]) -> None:
        """The settings as the session's owner holds them (`session_info`: a re-attached connection's view)."""
        sampling = info.get("sampling") or {}
        self.values["instructions"] = info.get("instructions") or ""
        if sampling.get("temperature") is not None:
            self.values["temperature"] = sampling["temperature"]
        self.values["max_output_tokens"] = sampling.get("max_tokens") or "inf"
        if sampling.get("tools"):
            self.values["tools"], self.values["tool_choice"] = tool_calls.from_chat(
                sampling["tools"], sampling.get("tool_choice")
            )

    @staticmethod
    def sampling(settings: dict[str, Any], before: dict[str, Any] | None = None) -> dict[str, Any]:
        """vLLM sampling parameters for `settings`; "inf" tokens become `max_tokens: None` only where they lift
        a limit set `before` (the prefill replica merges parameters into what it has)."""
        params: dict[str, Any] = {}
        tokens = settings.get("max_output_tokens")
        if tokens not in (None, "inf"):
            params["max_tokens"] = int(tokens)
        elif tokens == "inf" and before is not None and before.get("max_output_tokens") not in (None, "inf"):
            params["max_tokens"] = None
        if settings.get("temperature") is not None:
            params["temperature"] = float(settings["temperature"])
        if settings.get("tools"):
            params["tools"] = tool_calls.realtime_tools(settings["tools"])
            params["tool_choice"] = tool_calls.realtime_tool_choice(settings.get("tool_choice") or "auto")
            if settings.get("parallel_tool_calls") is not None:
                params["parallel_tool_calls"] = settings["parallel_tool_calls"]
        elif before is not None and before.get("tools"):  # cleared: the owner drops them from its request
            params.update(tools=None, tool_choice=None)
        return params

    @staticmethod
    def check_tools(settings: dict[str, Any], where: str) -> None:
        """The tools' schemas, and a named or required tool choice against the tools (`InvalidEvent`)."""
        tools = settings.get("tools") or []
        if (bad := tool_calls.check_tools(tool_calls.realtime_tools(tools))) is not None:
            param = f"{where}.tools[{bad[0]}].parameters"
            raise InvalidEvent(f"{param}: {bad[1]}", param=param)
        choice = settings.get("tool_choice")
        if isinstance(choice, dict) and choice.get("name") not in {t["name"] for t in tools}:
            message = f"tool_choice names {choice.get('name')!r}, which is not among the tools"
            raise InvalidEvent(message, param=f"{where}.tool_choice.name")
        if choice == "required" and not tools:
            raise InvalidEvent('tool_choice "required" needs tools', param=f"{where}.tool_choice")

    def text_only(self, sampling: Sampling, where: str) -> list[str] | None:
        """The output modalities asked for (None: unchanged); anything but text is refused."""
        modalities = sampling.output_modalities
        if modalities is not None and set(modalities) - {"text"}:
            raise InvalidEvent(
                "only text output is supported", "unsupported_modality", f"{where}.{self.modalities_key}"
            )
        return modalities

    async def update(self, event: SessionUpdate) -> None:
        """`session.update`."""
        conn, audio = self.connection, self.connection.audio
        # vLLM's realtime client (router/voice/): a top-level `model`, the speech model's (not the LLM's)
        if event.model is not None and event.session is None and event.model != self.values["model"]:
            audio.use_vllm_flow(event.model)
            await conn.send("session.updated", session=self.session_object())
            return
        session = event.session or Sampling()
        voice = audio.configure(session)
        modalities = self.text_only(session, "session")
        settings = {**self.values, **session.given()}
        if modalities is not None:
            settings[self.modalities_key] = modalities
        set_preemptive = "preemptive" in session.model_fields_set  # (null: off, a spoken session's default too)
        if set_preemptive:
            settings["preemptive"] = session.preemptive
        if session.tools == [] and session.tool_choice is None:  # no tools left to force
            settings["tool_choice"] = "auto"
        self.check_tools(settings, "session")
        # Stored only once the owner took it: a refused update leaves the session as it was.
        params = self.sampling(settings, self.values)
        # Instructions only when given: the owner keeps its own otherwise (a re-attached connection's defaults
        # are not the session's).
        off = session.preemptive is None
        preemptive = {"preemptive": False if off else session.preemptive} if set_preemptive else {}
        if updated := await conn.call(session_update, instructions=session.instructions, params=params, **preemptive):
            self.values = settings
            if voice is not None:
                audio.apply(voice)
            await conn.send("session.updated", session=self.session_object())
            if updated.get("state") != "answering" and isinstance(turns := updated.get("turns"), int):
                conn.conversation.read_early(turns)  # (answering: once its response ends)
