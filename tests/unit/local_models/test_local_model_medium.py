"""The generated local models' registry: names, shapes and the `make_local_model` API (nothing is built here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from core.config import LOCAL_MODEL
from local_models import llm as lm


def test_registry_names_and_dirs() -> None:
    assert set(lm.LOCAL_MODELS) == {"local:tiny-llama", "local:tiny-llama-tools", "local:medium-llama"}
    assert LOCAL_MODEL in lm.LOCAL_MODELS
    assert lm.model_dir("local:medium-llama") == lm.MODELS_DIR / "medium-llama"
    assert lm.model_dir("tiny-llama") == lm.DEFAULT_DIR
    with pytest.raises(ValueError, match="unknown local model"):
        lm.spec("local:huge-llama")


def test_medium_shape() -> None:
    s = lm.spec("local:medium-llama")
    assert 8 <= s.num_hidden_layers <= 12
    assert 512 <= s.hidden_size <= 1024
    assert s.max_position_embeddings >= 4096
    assert s.num_attention_heads % s.num_key_value_heads == 0
    assert s.kv_bytes_per_token == 2 * s.num_hidden_layers * s.num_key_value_heads * s.head_dim * s.dtype_bytes


def test_tiny_shape_unchanged() -> None:
    s = lm.spec("tiny-llama")
    assert (s.hidden_size, s.intermediate_size, s.num_hidden_layers, s.dtype) == (128, 384, 2, "float32")
    assert s.kv_bytes_per_token == 2 * 2 * 2 * 64 * 4


def _stamped(out: Path, version: int) -> Path:
    out.mkdir(parents=True)
    (out / "local_model.json").write_text(json.dumps({"version": version}))
    return out


def test_up_to_date_copy_is_returned_as_is(tmp_path: Path) -> None:
    medium = _stamped(tmp_path / "m", lm.spec("medium-llama").version)
    assert lm.make_local_model("local:medium-llama", out=medium) == medium
    tiny = _stamped(tmp_path / "t", lm.VERSION)
    assert lm.make_local_model(tiny) == tiny  # the old positional `out` still works
    assert lm.make_local_model("tiny-llama", out=tiny) == tiny


def test_registry_callables_build_into_default_dirs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(lm, "MODELS_DIR", tmp_path)
    _stamped(tmp_path / "medium-llama", lm.spec("medium-llama").version)
    assert lm.LOCAL_MODELS["local:medium-llama"]() == tmp_path / "medium-llama"


@pytest.mark.parametrize("native", [True, False])
def test_a_bf16_model_is_served_in_float32_where_bf16_is_not_native(monkeypatch, native: bool) -> None:
    """Benchmarks size their load for a prefill speed: bf16 on a CPU without AVX-512 BF16/AMX is ~7x slower."""
    monkeypatch.setattr(lm, "native_bf16", lambda: native)
    s = lm.spec("local:medium-llama")
    served = s.served_here()
    assert served.dtype == ("bfloat16" if native else "float32")
    assert served.kv_bytes_per_token == s.kv_bytes_per_token * (1 if native else 2)
    assert lm.spec("local:tiny-llama").served_here() == lm.spec("local:tiny-llama")  # float32 already
