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


def test_a_path_whose_kernels_die_is_not_available(monkeypatch) -> None:
    """A hypervisor can hide AVX-512 from the OS while CPUID names it: torch then reports AVX512 when asked for it
    and dies of SIGILL in its first kernel (seen on an AVX2 EPYC). Such a path is not one this machine can run."""
    import subprocess

    def python(args: list[str], path: str | None, timeout: float) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(args, -4 if path == "avx512" else 0, f"{path}\n", "")

    monkeypatch.setattr(fit_check, "_python", python)
    assert fit_check.capability_under("avx512") == ""
    assert fit_check.available_paths() == ["default", "avx2"]
