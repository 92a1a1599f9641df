"""The fitted local models fit, and decode their targets, under every CPU kernel path torch runs on this machine
(local_models/fit.py, local_models/fit_check.py). `make models` has built them under the machine's own path already
(the integration tests serve those); this fits them again under each other path, two at a time."""

from __future__ import annotations

from pathlib import Path

from local_models import fit_check


def test_every_fitted_model_fits_under_every_kernel_path(tmp_path: Path) -> None:
    native = fit_check.native_path()
    paths = [path for path in fit_check.available_paths() if path != native]
    assert "default" in paths or native == "default"  # (torch always runs its portable path)
    results = fit_check.check(paths, list(fit_check.MODELS), tmp_path, vllm=False)
    assert len(results) == len(paths) * len(fit_check.MODELS)
    for result in results:
        assert result["ok"], result
        assert result["capability"].endswith(f"CPU capability {result['path'].upper()}"), result
