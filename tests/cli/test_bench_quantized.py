"""`vecpool bench --quantization int8` prints the cosine to the unquantized model beside the
speed, and reports it in JSON: the real all-MiniLM-L6-v2, int8 against float32."""

from __future__ import annotations

import json
import re

import pytest

from vecpool.cli import main


def test_bench_prints_the_cosine_to_float32(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "-n", "16", "--repeats", "1", "--max-words", "40", "--quantization", "int8"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    found = re.search(
        r"int8: cosine to the unquantized model's vectors min ([\d.]+), median "
        r"([\d.]+) \(16 inputs\)",
        text,
    )
    assert found is not None, text
    lowest, median = float(found[1]), float(found[2])
    # The floor tests/models/test_int8.py holds int8 to (its median on ~100 texts).
    assert 0.995 <= lowest <= median < 1
    assert "inputs/s" in text.splitlines()[1]  # the speed, on the line before

    assert main([*argv, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["quantization"] == "int8"
    assert 0.995 <= report["cosine_to_float32"]["min"] <= report["cosine_to_float32"]["median"]
