"""The GELU timing script runs in seconds on the CPU: every variant timed in every round,
each exact-GELU variant's error against float64 that of a bf16 rounding, the compiled
`layers.gelu` equal to the compiled `F.gelu` there (on the CPU both are `F.gelu`)."""

from __future__ import annotations

from pathlib import Path

from benchmarks.lab.activation_check import main


def test_activation_check_times_every_variant(tmp_path: Path) -> None:
    argv = ["--device", "cpu", "--backend", "aot_eager", "--tokens", "64", "--hidden", "16"]
    argv += ["--intermediate", "32"]
    report = main([*argv, "--iters", "2", "--rounds", "2", "--output", str(tmp_path / "a.json")])
    (row,) = report["rows"]
    assert row["tokens"] == 64
    activations = row["activation"]
    assert set(activations) == {
        "compiled gelu",
        "eager gelu",
        "compiled tanh gelu",
        "compiled layers.gelu",
        "compiled x * 1.5 (memory floor)",
    }
    for entry in [*activations.values(), *row["linear + activation"].values()]:
        assert len(entry["seconds"]["rounds"]) == 2 and entry["seconds"]["median"] > 0
    # bf16 keeps 8 bits: an output of magnitude up to ~8 rounds by at most 2^-5.
    for name in ("compiled gelu", "eager gelu", "compiled layers.gelu"):
        assert 0 < activations[name]["max_abs_error"] <= 2**-5, name
    assert activations["compiled layers.gelu"]["share_unequal_to_compiled_gelu"] == 0.0
    # The tanh approximation is not the exact GELU: some bf16 outputs differ.
    assert activations["compiled tanh gelu"]["share_unequal_to_compiled_gelu"] > 0
    assert "cuBLASLt gelu epilogue (tanh)" not in row["linear + activation"]  # CUDA only
