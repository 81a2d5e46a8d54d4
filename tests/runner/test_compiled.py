"""The compiled layer stack: which blocks compile, when the engine compiles by default, and
that a compiled model computes what the eager one does, prompt embeds bit-exact with ids.

CI has no GPU and needs no compiler: the checks here trace the blocks with dynamo's "eager"
backend, which runs the same wrapping and guards without generating code.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import vecpool
from tests.helpers import (
    REORDERED_RTOL,
    assert_rel_close,
    engine_hidden,
    padded_cpu_attention,
    random_prompts,
)
from tests.runner.conftest import VOCAB
from vecpool.runner import cpu_choice, model_runner
from vecpool.runner.compiled import compile_blocks, compile_by_default, repeated_blocks


def test_repeated_blocks_are_the_layer_stacks(qwen3_folder: Path, tiny_bert_engine) -> None:
    decoder = vecpool.Engine(qwen3_folder, device="cpu").model
    assert repeated_blocks(decoder) == list(decoder.layers)
    assert len(repeated_blocks(tiny_bert_engine.model)) == 2  # BERT's encoder.layer
    assert repeated_blocks(torch.nn.Linear(2, 2)) == []


def test_compile_by_default_on_wide_cuda_models_only() -> None:
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert compile_by_default(cuda, 1024)
    assert compile_by_default(cuda, 768)
    assert not compile_by_default(cuda, 384)
    assert not compile_by_default(cpu, 4096)
    assert not vecpool.Engine(device="cpu").model_runner.compiled


def _steps_against_eager(
    eager: vecpool.Engine, compiled: vecpool.Engine, vocab: int
) -> Iterator[tuple[list[list[int]], list[np.ndarray], list[np.ndarray], list[np.ndarray]]]:
    """Batches of different token and sequence counts (one dynamic graph serves them all):
    each batch's prompts, the eager engine's hidden states, and the compiled engine's from the
    ids and from the same prompts given as their embeddings."""
    for seed, lengths in enumerate([[5, 17, 3, 30], [7, 2], [40, 9, 9, 1, 12]]):
        prompts = random_prompts(vocab, lengths, seed=seed)
        expected = engine_hidden(eager, prompts)
        as_ids = engine_hidden(compiled, prompts)
        as_embeds = engine_hidden(
            compiled, [{"prompt_embeds": compiled.embed_tokens(p)} for p in prompts]
        )
        yield prompts, expected, as_ids, as_embeds


@pytest.mark.parametrize("measured", ["buckets", "sequences"])
def test_compiled_blocks_match_eager_and_keep_embeds_bit_exact(
    qwen3_folder: Path, monkeypatch: pytest.MonkeyPatch, measured: str
) -> None:
    """Whatever attention the machine measured as fastest (a loaded one picks "sequences"),
    compiled blocks compute what the eager engine does in the layout they run (padded)."""
    monkeypatch.setattr(
        model_runner.cpu_choice, "choose", lambda *a, **k: cpu_choice.CpuChoice("blas", measured)
    )
    eager = padded_cpu_attention(vecpool.Engine(qwen3_folder, device="cpu", compile=False))
    compiled = vecpool.Engine(qwen3_folder, device="cpu", compile=False)
    assert compiled.model_runner.cpu_choice.attention == measured
    assert compile_blocks(compiled.model, backend="eager") == 3
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # graphs compiled by earlier tests count there too
    for _, expected, as_ids, as_embeds in _steps_against_eager(eager, compiled, VOCAB):
        for e, a, b in zip(expected, as_ids, as_embeds, strict=True):
            assert np.array_equal(a, e)
            assert np.array_equal(a, b)
    # The block's forward compiled once for all three layers (parameters are graph inputs):
    # one graph while the padded fallback builds its mask, one once it is cached.
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 2


def test_many_block_structures_stay_compiled(qwen3_folder: Path) -> None:
    """Past dynamo's default of 8 graphs per code object (here 12 structures sharing one
    forward, as several models of one block class in a process do), every one still compiles."""

    class Block(torch.nn.Module):
        def __init__(self, inner: torch.nn.Module):
            super().__init__()
            self.inner = inner

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(x) + 1

    compile_blocks(vecpool.Engine(qwen3_folder, device="cpu", compile=False).model, backend="eager")
    graphs = []

    def count(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> object:
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    inners = [type(f"Inner{i}", (torch.nn.Identity,), {})() for i in range(12)]
    for inner in inners:
        block = Block(inner)
        block.compile(backend=count, dynamic=True)
        assert torch.equal(block(torch.zeros(3)), torch.ones(3))
    assert len(graphs) == 12


def test_each_engine_keeps_its_own_compiled_code(qwen3_folder: Path) -> None:
    """Two engines of one block class in a process: what dynamo compiles for each lives on a
    code object of that engine's own (none on the class's forward), so neither checks its
    guards against the other's graphs nor counts towards the other's recompile limit; each
    still computes what an eager engine does."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list as entries

    eager = padded_cpu_attention(vecpool.Engine(qwen3_folder, device="cpu", compile=False))
    engines = [vecpool.Engine(qwen3_folder, device="cpu", compile=False) for _ in range(2)]
    torch._dynamo.reset()
    for engine in engines:
        assert compile_blocks(engine.model, backend="eager") == 3
    prompts = random_prompts(VOCAB, [5, 17, 3], seed=0)
    expected = engine_hidden(eager, prompts)
    codes = []
    for engine in engines:
        for e, a in zip(expected, engine_hidden(engine, prompts), strict=True):
            assert np.array_equal(a, e)
        blocks = repeated_blocks(engine.model)
        code = blocks[0].forward.__code__
        assert all(b.forward.__code__ is code for b in blocks)  # one code object per engine
        codes.append(code)
    assert codes[0] is not codes[1]
    counts = [len(entries(code)) for code in codes]
    assert counts[0] >= 1 and counts[0] == counts[1]  # the same graphs, each engine its own
    class_forward = type(repeated_blocks(engines[0].model)[0]).forward
    assert entries(class_forward.__code__) == []


def test_compiled_blocks_run_chunked_prompts(qwen3_folder: Path) -> None:
    """Chunks of prompts over the budget attend to cached keys through the opaque
    `vecpool::cached_attention` op: no graph break, one graph per block for chunked steps
    (and one for whole ones), no recompiles from step to step; results stay bit-exact with the
    eager model's."""
    eager = padded_cpu_attention(
        vecpool.Engine(qwen3_folder, device="cpu", compile=False, max_num_batched_tokens=16)
    )
    compiled = vecpool.Engine(qwen3_folder, device="cpu", compile=False, max_num_batched_tokens=16)
    compile_blocks(compiled.model, backend="eager")
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    for seed, lengths in enumerate([[100, 7, 30], [57, 3]]):
        prompts = random_prompts(VOCAB, lengths, seed=seed)
        expected = engine_hidden(eager, prompts)
        for e, a in zip(expected, engine_hidden(compiled, prompts), strict=True):
            assert np.array_equal(a, e)
    counters = torch._dynamo.utils.counters
    assert not counters["graph_break"]
    assert 1 <= counters["stats"]["unique_graphs"] <= 2


def test_gelu_op_is_atens_gelu() -> None:
    """`vecpool::gelu`, which compiled CUDA layers call instead of the compiler's own GELU
    kernel, is ATen's `F.gelu` bit for bit, with a fake implementation the compiler can trace
    at any token count; on the CPU a compiled `layers.gelu` stays `F.gelu`."""
    from vecpool.models.layers import basic as layers

    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(37, 64, generator=gen) * 4).to(dtype)
        assert torch.equal(torch.ops.vecpool.gelu(x), torch.nn.functional.gelu(x))
        torch.library.opcheck(torch.ops.vecpool.gelu.default, (x,))
    compiled = torch.compile(lambda t: layers.gelu(t) * 2, backend="aot_eager", dynamic=True)
    x = torch.randn(5, 8, generator=gen)
    assert torch.equal(compiled(x), torch.nn.functional.gelu(x) * 2)
    assert layers.activation("gelu")(x).equal(torch.nn.functional.gelu(x))


def test_add_linear_accumulates_into_the_residual() -> None:
    """`vecpool::add_linear_`, through which compiled CUDA layers add a projection to its
    residual, leaves `residual + x @ w.T` in the residual, as `torch.addmm` computes it (the
    compiler's own rewrite of that sum), eagerly and in a compiled graph, where the mutation
    of an intermediate must survive functionalization; on the CPU `add_linear` is the sum."""
    from vecpool.models.layers import basic as layers

    gen = torch.Generator().manual_seed(1)
    r, x, w = (torch.randn(*s, generator=gen) for s in ((9, 16), (9, 24), (16, 24)))
    want = torch.addmm(r, x, w.t())
    residual = r.clone()
    torch.ops.vecpool.add_linear_(residual, x, w)
    assert torch.equal(residual, want)
    torch.library.opcheck(torch.ops.vecpool.add_linear_.default, (r.clone(), x, w))

    def step(r: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        h = r * 1.0  # an intermediate of the graph, as a layer's residual is
        torch.ops.vecpool.add_linear_(h, x, w)
        return h * 2.0

    compiled = torch.compile(step, backend="aot_eager", dynamic=True)
    assert torch.equal(compiled(r, x, w), want * 2.0)
    linear = torch.nn.Linear(24, 16, bias=False)
    assert torch.equal(layers.add_linear(r, linear, x), r + linear(x))


@pytest.mark.parametrize("model", ["qwen3", "bert"])
def test_compiled_cuda_ops_path_matches_eager_and_keeps_embeds_bit_exact(
    qwen3_folder: Path, tiny_bert: tuple[Path, Any], monkeypatch, model: str
) -> None:
    """The path layers compiled for CUDA take, run on the CPU: decoder layers overwriting
    their input with the attention's residual sum and that sum with the feed-forward's
    (`vecpool::add_linear_`), BERT's GELU through `vecpool::gelu`. The compiled engine, over
    steps of several sizes, stays within float32 reordering of the eager one (an addmm rounds
    a sum once where `x + linear(h)` rounds twice), a prompt given as embeddings gives its
    ids' bits, and a second call the first's (no step sees what an earlier one overwrote)."""
    from vecpool.models.layers import basic as layers

    folder = qwen3_folder if model == "qwen3" else tiny_bert[0]
    vocab = VOCAB if model == "qwen3" else 99
    # Plain linears, as on CUDA (on the CPU the engine packs them for oneDNN).
    monkeypatch.setattr(model_runner, "can_pack", lambda *_: False)
    eager = padded_cpu_attention(vecpool.Engine(folder, device="cpu", compile=False))
    compiled = vecpool.Engine(folder, device="cpu", compile=False)
    traced_ops: set[str] = set()
    aot_eager = torch._dynamo.lookup_backend("aot_eager")

    def spy(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        traced_ops.update(str(n.target) for n in gm.graph.nodes if "vecpool" in str(n.target))
        return aot_eager(gm, example_inputs)

    monkeypatch.setattr(layers, "compiled_for_cuda", lambda x: torch.compiler.is_compiling())
    torch._dynamo.reset()
    for block in repeated_blocks(compiled.model):
        block.compile(backend=spy, dynamic=True)
    for prompts, expected, as_ids, as_embeds in _steps_against_eager(eager, compiled, vocab):
        again = engine_hidden(compiled, prompts)
        for e, a, b, c in zip(expected, as_ids, as_embeds, again, strict=True):
            assert_rel_close(a, e, REORDERED_RTOL)
            assert np.array_equal(a, b) and np.array_equal(a, c)
    op = "add_linear_" if model == "qwen3" else "gelu"
    assert any(op in name for name in traced_ops), traced_ops


def test_every_tower_is_a_stack_of_blocks() -> None:
    """A model of two towers (a dual encoder's text and image encoders) has both stacks
    compiled and prepacked; a list inside a block is not a stack of its own; a model whose
    only list holds one block (ALBERT's shared group) has that block."""

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.parts = torch.nn.ModuleList(torch.nn.Linear(2, 2) for _ in range(3))

    class TwoTowers(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.text = torch.nn.ModuleList(Block() for _ in range(2))
            self.vision = torch.nn.ModuleList(Block() for _ in range(4))
            self.heads = torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.ReLU()])

    model = TwoTowers()
    assert repeated_blocks(model) == [*model.text, *model.vision]
    shared = torch.nn.Module()
    shared.groups = torch.nn.ModuleList([torch.nn.Sequential(torch.nn.Linear(2, 2))])
    assert repeated_blocks(shared) == [shared.groups[0]]
