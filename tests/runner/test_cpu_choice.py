"""The CPU path's per-machine choice (`vecpool/runner/cpu_choice.py`): a pure function of the
instruction set and the cached measurement, the cache keyed so that a capped instruction set
is another machine, and every choice within float32 tolerance of transformers.

Tolerance: 1e-5 of the reference's largest magnitude (`REORDERED_RTOL`): every choice is the
same float32 arithmetic as transformers' in another order (another GEMM, another padded
length in the attention kernel).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers

import vecpool
from tests.conftest import tiny_bert_config
from tests.helpers import (
    REORDERED_RTOL,
    assert_rel_close,
    engine_hidden,
    hf_last_hidden,
    random_prompts,
    save_hf_model,
)
from vecpool.models.layers.cpu_attention import CPU_ATTENTION_MODES
from vecpool.runner import cpu_choice
from vecpool.runner.cpu_choice import TIE, CpuChoice, Measurement, decide
from vecpool.runner.cpu_linear import PackedLinear

# Lengths of one step: short and long mixed, several equal (a bucket of equal lengths).
LENGTHS = [5, 33, 7, 7, 12, 60, 3, 7, 25, 48]


def test_decide_takes_the_instruction_sets_default_where_nothing_is_measured() -> None:
    assert decide("AVX512", None) == CpuChoice("onednn", "buckets")
    assert decide("AVX512_BF16", None) == CpuChoice("onednn", "buckets")
    assert decide("AVX2", None) == CpuChoice("blas", "buckets")
    assert decide("DEFAULT", None) == CpuChoice("blas", "buckets")


@pytest.mark.parametrize("isa", ["AVX512", "AVX2"])
def test_decide_is_a_pure_function_of_isa_and_measurement(isa: str) -> None:
    default = "onednn" if isa == "AVX512" else "blas"
    other = "blas" if default == "onednn" else "onednn"
    # The other kernel clearly faster: it is chosen; within TIE of the default: the default.
    for factor, expected in [(0.5, other), (1 / (1 + TIE / 2), default), (2.0, default)]:
        m = Measurement(
            linear={default: 1.0, other: factor},
            attention={"padded": 3.0, "buckets": 2.0, "sequences": 1.0},
        )
        choice = decide(isa, m)
        assert choice == CpuChoice(expected, "sequences")
        # The same arguments give the same choice: nothing else is read.
        assert all(
            decide(isa, Measurement(dict(m.linear), dict(m.attention))) == choice for _ in "ab"
        )
    # The measured cost of a group of lengths is what the grouping plans with.
    m = Measurement({"blas": 1.0}, {"buckets": 1.0}, group_cost=1234.0)
    assert decide(isa, m) == CpuChoice("blas", "buckets", group_cost=1234.0)
    # Attention within TIE of the grouped way keeps it; a way the machine lacks is not chosen.
    near = Measurement({"blas": 1.0}, {"padded": 1.0, "buckets": 1.0 + TIE / 2, "sequences": 2.0})
    assert decide(isa, near) == CpuChoice("blas", "buckets")
    # Every measurable outcome maps to a valid choice.
    for lin, att in itertools.product(["onednn", "blas"], CPU_ATTENTION_MODES):
        m = Measurement(
            {k: 0.1 if k == lin else 1.0 for k in ("onednn", "blas")},
            {k: 0.1 if k == att else 1.0 for k in CPU_ATTENTION_MODES},
        )
        assert decide(isa, m) == CpuChoice(lin, att)


def test_choice_names_are_checked() -> None:
    with pytest.raises(ValueError, match="linear kernel 'mkl'"):
        CpuChoice("mkl", "buckets")
    with pytest.raises(ValueError, match="attention 'flash'"):
        CpuChoice("blas", "flash")


def _shape(**overrides: Any) -> cpu_choice.ProbeShape:
    fields: dict[str, Any] = dict(
        linears=((96, 32, 2),), heads=4, kv_heads=4, head_dim=8, causal=False, max_len=64
    )
    fields.update(overrides)
    return cpu_choice.ProbeShape(**fields)


def test_cache_keys_separate_machines_caps_and_shapes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS"):
        monkeypatch.delenv(name, raising=False)
    key = cpu_choice.machine_key(_shape(), torch.float32)
    assert cpu_choice.cpu_isa() in key and f"threads {torch.get_num_threads()}" in key
    assert key != cpu_choice.machine_key(_shape(heads=2), torch.float32)
    assert key != cpu_choice.machine_key(_shape(), torch.bfloat16)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert key != cpu_choice.machine_key(_shape(), torch.float32)
    # What is written is read back under its key only; another file version is ignored.
    path = tmp_path / "choice.json"
    m = Measurement({"blas": 0.25, "onednn": 0.5}, {"padded": 1.0, "buckets": 0.5})
    cpu_choice.write_cached(key, m, path)
    assert cpu_choice.read_cached(key, path) == m
    assert cpu_choice.read_cached(key + "x", path) is None
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "version": -1}))
    assert cpu_choice.read_cached(key, path) is None
    path.write_text("{not json")
    assert cpu_choice.read_cached(key, path) is None


def test_a_capped_instruction_set_is_another_machine() -> None:
    """torch reads ATEN_CPU_CAPABILITY when it loads: a process of its own, capped."""
    script = (
        "import torch; from vecpool.runner import cpu_choice as c; "
        "s = c.ProbeShape(((8, 8, 1),), 1, 1, 8, False, 8); "
        "print(c.cpu_isa()); print(c.machine_key(s, torch.float32))"
    )
    caps = {"ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
    runs = []
    for extra in ({}, {**caps, "ATEN_CPU_CAPABILITY": "avx2"}):
        env = {k: v for k, v in os.environ.items() if k not in (*caps, "ATEN_CPU_CAPABILITY")}
        done = subprocess.run(
            [sys.executable, "-c", script], env={**env, **extra}, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr
        runs.append(done.stdout.splitlines()[-2:])
    (native_isa, native_key), (capped_isa, capped_key) = runs
    assert native_key != capped_key
    if native_isa.startswith("AVX512"):  # x86-64 with AVX-512: torch dispatches to AVX2 now
        assert capped_isa == "AVX2" and "| AVX2 |" in capped_key


def _bert_folder(tmp_path: Path) -> tuple[Path, Any]:
    torch.manual_seed(0)
    hf = transformers.BertModel(tiny_bert_config(), add_pooling_layer=False).eval()
    return save_hf_model(hf, tmp_path / "bert"), hf


def _seed(cache: Path, engine_key: str, choice: CpuChoice) -> None:
    """A cached measurement under which `decide` makes `choice`."""
    m = Measurement(
        {k: 0.1 if k == choice.linear else 1.0 for k in ("onednn", "blas")},
        {k: 0.1 if k == choice.attention else 1.0 for k in CPU_ATTENTION_MODES},
    )
    cpu_choice.write_cached(engine_key, m, cache / "cpu_choice.json")


def test_every_choice_matches_transformers_and_is_logged_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    folder, hf = _bert_folder(tmp_path)
    cache = tmp_path / "cache"
    monkeypatch.setenv("VECPOOL_CACHE_DIR", str(cache))
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))  # a quiet machine: cached
    prompts = random_prompts(99, LENGTHS, seed=1)
    expected = [hf_last_hidden(hf, p) for p in prompts]
    with caplog.at_level(logging.INFO, logger="vecpool.runner.cpu_choice"):
        engine = vecpool.Engine(folder, device="cpu")  # measured, then cached
    measured = engine.model_runner.cpu_choice
    assert measured is not None
    logged = [r.getMessage() for r in caplog.records if r.name == "vecpool.runner.cpu_choice"]
    assert len(logged) == 1 and "measured in" in logged[0]
    assert f"linears {measured.linear}, attention {measured.attention}" in logged[0]
    (key,) = json.loads((cache / "cpu_choice.json").read_text())["entries"]
    m = cpu_choice.read_cached(key)
    assert m is not None and measured == decide(cpu_choice.cpu_isa(), m)
    for choice in itertools.starmap(
        CpuChoice, itertools.product(["onednn", "blas"], CPU_ATTENTION_MODES)
    ):
        _seed(cache, key, choice)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="vecpool.runner.cpu_choice"):
            engine = vecpool.Engine(folder, device="cpu")
        assert engine.model_runner.cpu_choice == choice
        assert "cached measurement" in caplog.records[-1].getMessage()
        packed = any(isinstance(m, PackedLinear) for m in engine.model.modules())
        assert packed == (choice.linear == "onednn")
        # One call: the prompts share a step, whose attention runs the chosen way.
        for ours, ref in zip(engine_hidden(engine, prompts), expected, strict=True):
            assert_rel_close(ours, ref, rtol=REORDERED_RTOL)


def test_a_choice_measured_on_a_busy_machine_is_a_warning_naming_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The load average per core is recorded with the measurement and logged; above
    `BUSY_LOAD` the log is a warning that names the file to delete for a new measurement. The
    choice itself stands (the same machine makes the same choice in every process)."""
    folder, _ = _bert_folder(tmp_path)
    cache = tmp_path / "cache"
    monkeypatch.setenv("VECPOOL_CACHE_DIR", str(cache))
    cores = os.cpu_count() or 1
    monkeypatch.setattr(os, "getloadavg", lambda: (3.0 * cores, 0.0, 0.0))
    with caplog.at_level(logging.INFO, logger="vecpool.runner.cpu_choice"):
        busy = vecpool.Engine(folder, device="cpu").model_runner.cpu_choice
    (record,) = [r for r in caplog.records if r.name == "vecpool.runner.cpu_choice"]
    assert record.levelno == logging.WARNING
    assert "at a load of 3.00 per core" in record.getMessage()
    assert f"delete {cache / 'cpu_choice.json'}" in record.getMessage()
    (key,) = json.loads((cache / "cpu_choice.json").read_text())["entries"]
    measured = cpu_choice.read_cached(key)
    assert measured is not None and measured.load_per_core == 3.0
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="vecpool.runner.cpu_choice"):
        again = vecpool.Engine(folder, device="cpu").model_runner.cpu_choice
    assert again == busy  # read back, not measured again
    assert caplog.records[-1].levelno == logging.WARNING
    assert "cached measurement at a load of 3.00" in caplog.records[-1].getMessage()
    # An entry written before the load was recorded reads as one of unknown load: no warning.
    entries = json.loads((cache / "cpu_choice.json").read_text())
    del entries["entries"][key]["load_per_core"]
    (cache / "cpu_choice.json").write_text(json.dumps(entries))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="vecpool.runner.cpu_choice"):
        assert vecpool.Engine(folder, device="cpu").model_runner.cpu_choice == busy
    assert caplog.records[-1].levelno == logging.INFO
    assert "at a load" not in caplog.records[-1].getMessage()


@pytest.mark.parametrize("mode", CPU_ATTENTION_MODES)
def test_causal_grouped_query_attention_matches_transformers(
    mode: str, qwen3_folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decoder (causal, two query heads per key/value head) whose prompts run whole."""
    monkeypatch.setenv("VECPOOL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(
        cpu_choice, "decide", lambda isa, m: CpuChoice(cpu_choice.default_linear(isa), mode)
    )
    engine = vecpool.Engine(qwen3_folder, device="cpu")
    assert engine.model_runner.cpu_choice == CpuChoice(
        cpu_choice.default_linear(cpu_choice.cpu_isa()), mode
    )
    hf = transformers.AutoModel.from_pretrained(qwen3_folder).eval()
    prompts = random_prompts(101, LENGTHS, seed=2)
    for ours, prompt in zip(engine_hidden(engine, prompts), prompts, strict=True):
        assert_rel_close(ours, hf_last_hidden(hf, prompt), rtol=REORDERED_RTOL)


def test_buckets_group_lengths_by_cost() -> None:
    from vecpool.models.layers.cpu_attention import plan_buckets

    lengths = np.array([200, 8, 9, 10, 8, 190, 64])
    # [8, 8, 9, 10] padded to 10 (400 logits) beats four groups (3,000 more); 64 alone beats
    # five rows of 64^2; 190 and 200 together (80,000) beat two groups (76,100 + 5,000).
    groups = plan_buckets(lengths, group_cost=5000)
    # Every sequence once, groups ascending, each group's lengths a run of the sorted ones.
    assert sorted(np.concatenate(groups).tolist()) == list(range(len(lengths)))
    tops = [int(lengths[g].max()) for g in groups]
    assert tops == sorted(tops)
    assert [sorted(lengths[g].tolist()) for g in groups] == [[8, 8, 9, 10], [64], [190, 200]]
    # A group costing more than any padding: one group, the padded layout.
    assert len(plan_buckets(lengths, group_cost=1e9)) == 1
    # Free groups: one per distinct length.
    assert len(plan_buckets(lengths, group_cost=0)) == len(set(lengths.tolist()))
