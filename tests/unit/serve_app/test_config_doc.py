"""serve_app/config_doc.py: docs/config.md is what the typed config says today, and every field says what it is."""

from __future__ import annotations

from core.config import AppConfig
from serve_app import config_doc


def test_the_committed_reference_is_current() -> None:
    assert config_doc.PAGE.read_text() == config_doc.render(), "docs/config.md is stale: python -m serve_app.config_doc"


def test_every_field_has_a_description() -> None:
    assert not config_doc.missing_descriptions(), "give these fields a comment in the config's source"


def test_every_field_is_on_the_page() -> None:
    page = config_doc.PAGE.read_text()

    def paths(model: type, prefix: str = "") -> list[str]:
        found = []
        for name, info in model.model_fields.items():
            found.append(f"{prefix}{name}")
            if isinstance(info.annotation, type) and hasattr(info.annotation, "model_fields"):
                found += paths(info.annotation, f"{prefix}{name}.")
        return found

    # Each model is listed once (EngineConfig under `engine`), so a path under a repeated model shows there.
    listed = [p for p in paths(AppConfig) if not p.startswith(("prefill.engine.", "decode.engine.", "speech.engine."))]
    assert not [p for p in listed if f"`{p}`" not in page]


def test_comments_make_descriptions() -> None:
    class_comments = config_doc._comments(AppConfig)
    assert class_comments["served_model_name"] == "the name clients send as `model` (None: `model`)"
    assert class_comments["model"].startswith("The LLM: a hub id")  # the block above, both lines
    assert config_doc.description(AppConfig, "limits").startswith("what any client")
