"""A realtime connection's session settings (Mixin of `RealtimeConnection`, router/realtime/socket.py): `session.update`
and what it sets, in OpenAI's names (instructions, sampling, tools, output modalities, preemptive answers, and
the audio settings of router/realtime/audio_settings.py), checked whole before the owner takes them; the session object
the client is shown; and their translation into vLLM's sampling parameters."""

from __future__ import annotations

from typing import Any

from router.openai import tool_calls
from router.realtime.events import InvalidEvent, Sampling, SessionUpdate
from router.sessions.owner import session_update


class SessionSettings:
    """Mixin of `RealtimeConnection`: `session.update` and the settings it keeps."""

    settings: dict[str, Any]
    session_id: str | None
    beta: bool
    audio: Any
    modalities_key: str
    call: Any
    send: Any
    read_early: Any

    def session_object(self) -> dict[str, Any]:
        kind = "transcription" if self.audio.transcription_only else "realtime"
        audio = self.audio.settings.shown(self.beta, self.audio.speech_model)
        return {"id": self.session_id, "object": "realtime.session", "type": kind, **self.settings, **audio}

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

    async def session_update(self, event: SessionUpdate) -> None:
        # vLLM's realtime client (router/voice/): a top-level `model`, the speech model's (not the LLM's)
        if event.model is not None and event.session is None and event.model != self.settings["model"]:
            self.audio.use_vllm_flow(event.model)
            await self.send("session.updated", session=self.session_object())
            return
        session = event.session or Sampling()
        voice = self.audio.configure(session)
        modalities = self.text_only(session, "session")
        settings = {**self.settings, **session.given()}
        if modalities is not None:
            settings[self.modalities_key] = modalities
        set_preemptive = "preemptive" in session.model_fields_set  # (null: off, a spoken session's default too)
        if set_preemptive:
            settings["preemptive"] = session.preemptive
        if session.tools == [] and session.tool_choice is None:  # no tools left to force
            settings["tool_choice"] = "auto"
        self.check_tools(settings, "session")
        # Stored only once the owner took it: a refused update leaves the session as it was.
        params = self.sampling(settings, self.settings)
        # Instructions only when given: the owner keeps its own otherwise (a re-attached connection's defaults
        # are not the session's).
        off = session.preemptive is None
        preemptive = {"preemptive": False if off else session.preemptive} if set_preemptive else {}
        if updated := await self.call(session_update, instructions=session.instructions, params=params, **preemptive):
            self.settings = settings
            if voice is not None:
                self.audio.apply(voice)
            await self.send("session.updated", session=self.session_object())
            if updated.get("state") != "answering" and isinstance(turns := updated.get("turns"), int):
                self.read_early(turns)  # (answering: once its response ends)
