"""A realtime connection's session settings (router/realtime/socket.py `RealtimeConnection` holds them):
`session.update` and what it sets, in OpenAI's names (instructions, sampling, tools, output modalities, preemptive
answers, and the audio settings of router/realtime/audio_settings.py), checked whole before the owner takes them; the
session object the client is shown; their translation into vLLM's sampling parameters; and how a response speaks
(`speech`: text only, or audio with its transcript, the session's settings with `response.create`'s own)."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, Protocol

from core.config import PreemptiveOptions, TtsConfig
from core.tasks import detached
from router.openai import tool_calls
from router.realtime.audio_settings import OutputAudio, VoiceSettings
from router.realtime.connection import Calls, EarlyReads
from router.realtime.events import InvalidEvent, Sampling, SessionUpdate
from router.sessions.owner import session_update
from router.voice.audio import AudioError, parse_format

logger = logging.getLogger(__name__)
# What a re-attached connection takes from the owner itself, not from the updates it replays (`SessionSettings.given`).
OWNER_HELD = frozenset({"instructions", "tools", "tool_choice", "parallel_tool_calls"})


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
    ingress: Any  # the router's ingress (router/app.py): its config and its TTS role's client

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
            # Text until the client asks for audio: OpenAI's GA default is ["audio"], but this server's clients
            # (and `session.created` since before it spoke) expect text from a session that never set it.
            self.modalities_key: ["text"],
        }
        self.output = OutputAudio(voice=self.tts_config.default_voice)  # how answers are spoken, when they are
        self.voiced: str | None = None  # the voice the session first spoke in: it cannot change after (OpenAI's rule)
        self.defaulted_preemptive = False  # `values["preemptive"]` is the server's default, not the client's
        # What the client's `session.update`s set, merged as they came (but for what the owner holds itself:
        # instructions and tools), kept on the owner (`view`) so that a connection that re-attaches speaks and hears
        # as this one did (`restore`).
        self.given: dict[str, Any] = {}

    @property
    def speaks(self) -> bool:
        return "audio" in self.values[self.modalities_key]

    def default_preemptive(self, speaks: bool) -> dict[str, Any] | None:
        """A spoken session's preemptive answers when it set none (`speech.preemptive`); one that answers in speech
        holds its answer until its first piece can be synthesized (`tts.preemptive_tokens`)."""
        default = self.connection.ingress.config.speech.preemptive
        tokens = self.tts_config.preemptive_tokens
        if default is None or not speaks or tokens is None:
            return default
        return {**default, "max_tokens": max(PreemptiveOptions.model_validate(default).max_tokens, tokens)}

    @property
    def modalities_key(self) -> str:
        return "modalities" if self.beta else "output_modalities"

    @property
    def tts_config(self) -> TtsConfig:
        return getattr(self.connection.ingress.config, "tts", None) or TtsConfig()

    def session_object(self) -> dict[str, Any]:
        audio = self.connection.audio
        kind = "transcription" if audio.transcription_only else "realtime"
        shown = audio.settings.shown(self.beta, audio.speech_model)
        if not audio.transcription_only:
            if self.beta:
                shown.update(self.output.shown(beta=True))
            else:
                shown["audio"]["output"] = self.output.shown(beta=False)
        return {"id": self.connection.session_id, "object": "realtime.session", "type": kind, **self.values, **shown}

    def restore(self, info: dict[str, Any]) -> None:
        """The settings as the session's owner holds them (`session_info`: a re-attached connection's view): what
        the earlier connection's updates set, applied again (its audio input and output, modalities, preemptive
        answers), then the owner's own instructions, sampling and tools."""
        view = info.get("view") or {}
        if given := view.get("given"):
            try:
                self._replay(Sampling.model_validate(given))
                self.given = dict(given)
            except (InvalidEvent, ValueError):  # (the server's config changed since: not restored)
                logger.warning("session %s: its settings were not restored", self.connection.session_id)
        self.voiced = view.get("voiced")
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

    def modalities(self, sampling: Sampling, where: str) -> list[str] | None:
        """The output modalities asked for (None: unchanged), checked: GA takes ["text"] or ["audio"] (audio comes
        with its transcript), beta ["text"] or ["text", "audio"]; audio needs the TTS role."""
        modalities = sampling.output_modalities
        if modalities is None:
            return None
        param = f"{where}.{self.modalities_key}"
        if set(modalities) - {"text", "audio"}:
            raise InvalidEvent('the output modalities are "text" and "audio"', "unsupported_modality", param)
        if not self.beta and len(set(modalities)) > 1:
            message = 'output_modalities is ["text"] or ["audio"] (audio comes with its transcript)'
            raise InvalidEvent(message, "invalid_value", param)
        if "audio" in modalities and getattr(self.connection.ingress, "tts", None) is None:
            message = "this server has no TTS role (`tts.backend` in its config): audio output is not supported"
            raise InvalidEvent(message, "audio_output_not_supported", param)
        return modalities

    def output_audio(self, sampling: Sampling, where: str) -> OutputAudio:
        """The output audio settings `sampling` asks for over the session's (GA `audio.output`; beta's flat
        `output_audio_format`, `voice`, `speed` on beta connections), checked (`InvalidEvent` naming the field)."""
        ga = sampling.audio.output if sampling.audio is not None and sampling.audio.output is not None else None
        given = ga.model_fields_set if ga is not None else set()
        flat = sampling.model_fields_set & Sampling.OUTPUT if self.beta else set()
        output, prefix = self.output, f"{where}.audio.output"

        def field(name: str, beta_name: str) -> tuple[Any, str] | None:
            """The value given for a field and its name as the client wrote it (null: not given)."""
            if beta_name in flat and getattr(sampling, beta_name) is not None:
                return getattr(sampling, beta_name), f"{where}.{beta_name}"
            if name in given and getattr(ga, name) is not None:
                return getattr(ga, name), f"{prefix}.{name}"
            return None

        if (fmt := field("format", "output_audio_format")) is not None:
            try:
                output = replace(output, format=parse_format(*fmt))
            except AudioError as e:
                raise InvalidEvent(e.message, e.code, e.param) from None
        if (speed := field("speed", "speed")) is not None:
            output = replace(output, speed=speed[0])
        if (voice := field("voice", "voice")) is not None:
            name, param = voice
            voices = self.tts_config.voice_map()
            if not isinstance(name, str) or name not in voices:
                known = ", ".join(sorted(voices))
                raise InvalidEvent(f"unknown voice {repr(name)[:80]}: one of {known}", "invalid_value", param)
            if self.voiced is not None and name != self.voiced:
                message = f"the voice cannot change once the session has spoken (it speaks in {self.voiced!r})"
                raise InvalidEvent(message, "cannot_update_voice", param)
            output = replace(output, voice=name)
        return output

    def speech(self, response: Sampling | None = None) -> OutputAudio | None:
        """How a response speaks (None: text only): the session's settings, with `response.create`'s own
        (`InvalidEvent` naming a bad one)."""
        modalities, output = self.values[self.modalities_key], self.output
        if response is not None:
            if (asked := self.modalities(response, "response")) is not None:
                modalities = asked
            output = self.output_audio(response, "response")
        return output if "audio" in modalities else None

    def _asked(self, session: Sampling) -> tuple[VoiceSettings | None, dict[str, Any], OutputAudio]:
        """What a `session.update` sets on this connection, checked (`InvalidEvent` naming a bad field): the audio
        input settings (None: unchanged), the values, and the output audio."""
        voice = self.connection.audio.configure(session)
        modalities = self.modalities(session, "session")
        output = self.output_audio(session, "session")
        settings = {**self.values, **session.given()}
        if modalities is not None:
            settings[self.modalities_key] = modalities
        if "preemptive" in session.model_fields_set:  # (null: off, a spoken session's default too)
            settings["preemptive"] = session.preemptive
        return voice, settings, output

    def _replay(self, session: Sampling) -> None:
        """An earlier connection's update, applied here only (the owner has it)."""
        voice, self.values, self.output = self._asked(session)
        if voice is not None:
            self.connection.audio.apply(voice)

    def voice_spoken(self, voice: str) -> None:
        """The session spoke for the first time, in `voice`: fixed from now on (OpenAI's rule), a re-attached
        connection's too (the owner told in the background)."""
        self.voiced = voice
        if self.connection.session_id is not None:
            detached(self._keep_voice(voice))

    async def _keep_voice(self, voice: str) -> None:
        """The owner keeps the voice; nothing told to the client if it fails: the session may have ended with this
        very answer (`close_after_answer`)."""
        assert self.connection.session_id is not None
        try:  # (the owner merges the view's keys: this call and an update's in flight do not undo each other)
            reply = await session_update(self.connection.ingress, self.connection.session_id, view={"voiced": voice})
        except Exception as e:  # (the owner is unreachable: the same)
            reply = {"error": {"message": repr(e)}}
        if "error" in reply:
            logger.debug("session %s: the voice was not kept: %s", self.connection.session_id, reply["error"])

    async def update(self, event: SessionUpdate) -> None:
        """`session.update`."""
        conn, audio = self.connection, self.connection.audio
        # vLLM's realtime client (router/voice/): a top-level `model`, the speech model's (not the LLM's)
        if event.model is not None and event.session is None and event.model != self.values["model"]:
            audio.use_vllm_flow(event.model)
            await conn.send("session.updated", session=self.session_object())
            return
        session = event.session or Sampling()
        voice, settings, output = self._asked(session)
        set_preemptive = "preemptive" in session.model_fields_set
        if session.tools == [] and session.tool_choice is None:  # no tools left to force
            settings["tool_choice"] = "auto"
        self.check_tools(settings, "session")
        # Stored only once the owner took it: a refused update leaves the session as it was.
        params = self.sampling(settings, self.values)
        # Instructions only when given: the owner keeps its own otherwise (a re-attached connection's defaults
        # are not the session's).
        off = session.preemptive is None
        preemptive = {"preemptive": False if off else session.preemptive} if set_preemptive else {}
        if not set_preemptive and self.defaulted_preemptive:  # (the default follows whether the session speaks)
            default = self.default_preemptive("audio" in settings[self.modalities_key])
            if default is not None and default != self.values.get("preemptive"):
                settings["preemptive"] = preemptive["preemptive"] = default
        given = merged(self.given, session.model_dump(exclude_unset=True, exclude=set(OWNER_HELD)))
        view = {"view": {"given": given}} if given != self.given else {}
        call = conn.call(session_update, instructions=session.instructions, params=params, **view, **preemptive)
        if updated := await call:
            self.values, self.output, self.given = settings, output, given
            self.defaulted_preemptive = self.defaulted_preemptive and not set_preemptive
            if voice is not None:
                audio.apply(voice)
            await conn.send("session.updated", session=self.session_object())
            if updated.get("state") != "answering" and isinstance(turns := updated.get("turns"), int):
                conn.conversation.read_early(turns)  # (answering: once its response ends)


def merged(given: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """What `given` and then `update` set (two `session.update` dumps): `update`'s fields win, field by field within
    `audio.input` and `audio.output` (a format or a turn detection whole), its nulls included."""
    out = {**given, **update}
    if isinstance(given.get("audio"), dict) and isinstance(update.get("audio"), dict):
        audio = {**given["audio"], **update["audio"]}
        for side in ("input", "output"):
            if isinstance(given["audio"].get(side), dict) and isinstance(update["audio"].get(side), dict):
                audio[side] = {**given["audio"][side], **update["audio"][side]}
        out["audio"] = audio
    return out
