"""Two models behind one `vecpool serve`: what sharing a device costs each, and that each still
answers what it answers alone.

    python benchmarks/bench_multi_model.py --device cuda \
        --output benchmarks/results/multi_model_qwen3-0.6b_bert-base_h200.json

An embedder (`--synthetic`, default the Qwen3-0.6B shape) and a cross-encoder (BERT-base shape,
one label), random weights, on the MiniLM tokenizer (texts as `bench_gpu.py` makes them). Two
workloads, each from `--clients` closed-loop clients: **embed**, `/v1/embeddings` with 32
passages each (`model` "emb", base64); **rerank**, `/v1/rerank` with a query and 20 short
documents each (`model` "ce").
- **alone**: a server of the embedder only, then one of the cross-encoder only, each running
  its own workload;
- **together**: one server of both (`--gpu-memory-fraction` once per model: `--fractions`),
  the two workloads at the same time.
After a warm-up round, `--repeats` rounds each; every round's numbers and the medians are kept,
with each model's together / alone ratio of tokens/s. Fidelity: the first `--sample` answers of
each workload from the shared server against the same bodies' from the model's own server
(largest absolute difference of vector components and of scores).
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks import record
from benchmarks.bench_online import BATCH_INPUTS, RERANK_DOCS, write_cross_encoder
from benchmarks.serving import (
    Round,
    ServerProcess,
    Workload,
    _free_port,
    add_server_and_client_args,
    decode_base64,
    run_round,
)
from benchmarks.workloads import SHAPES, doc_lengths, make_inputs, workload_lengths, write_folder

MODELS = ("emb", "ce")


class ModelsServer(ServerProcess):
    """`vecpool serve` of `folders` (served name -> folder, in order) with `extra` options,
    in its own process group, as `ServerProcess` runs one model."""

    def __init__(
        self, folders: dict[str, Path], extra: list[str], args: argparse.Namespace, log: Path
    ):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "vecpool", "serve", *map(str, folders.values())]
        for name in folders:
            cmd += ["--served-model-name", name]
        cmd += ["--port", str(self.port), "--device", args.device, "--log-level", "warning"]
        cmd += ["--max-queued", "65536", *(["--dtype", args.dtype] if args.dtype else [])]
        cmd += [*extra, *args.server_args.split()]
        self.log = log
        with log.open("wb") as out:
            self.process = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.command = cmd


def workloads(args: argparse.Namespace) -> dict[str, Workload]:
    import tokenizers

    tokenizer = tokenizers.Tokenizer.from_file(str(args.tokenizer / "tokenizer.json"))
    tokenizer.no_truncation()
    tokenizer.no_padding()
    passages, p_ids = make_inputs(
        tokenizer, workload_lengths("passages", args.passages, seed=1), seed=1
    )
    calls = args.rerank_calls
    queries, q_ids = make_inputs(tokenizer, workload_lengths("queries", calls, seed=3), seed=3)
    docs, d_ids = make_inputs(tokenizer, doc_lengths(calls * RERANK_DOCS, seed=4), seed=4)
    embed = [
        {
            "model": "emb",
            "input": passages[i : i + BATCH_INPUTS],
            "encoding_format": "base64",
            "truncate_prompt_tokens": -1,
        }
        for i in range(0, len(passages), BATCH_INPUTS)
    ]
    rerank = [
        {
            "model": "ce",
            "query": queries[i],
            "documents": docs[i * RERANK_DOCS : (i + 1) * RERANK_DOCS],
            "return_documents": False,
        }
        for i in range(calls)
    ]
    # Token counts as the bodies' texts are made (the server's own count is in each answer).
    return {
        "emb": Workload("/v1/embeddings", embed, sum(map(len, p_ids))),
        "ce": Workload("/v1/rerank", rerank, sum(map(len, q_ids)) + sum(map(len, d_ids))),
    }


def _round(url: str, work: Workload, args: argparse.Namespace, sample: int = 0) -> Round:
    return asyncio.run(
        run_round(
            url,
            work,
            args.clients,
            limit=len(work.bodies),
            max_seconds=args.max_seconds,
            sample=sample,
            raw=args.client == "raw",
        )
    )


def run_rounds(url: str, works: dict[str, Workload], args: argparse.Namespace) -> dict[str, Any]:
    """A warm-up round, then `--repeats` rounds of every workload of `works` at once (each in
    a thread of its own); per workload, every round's summary, its median, and a sample."""
    out: dict[str, Any] = {name: {"rounds": []} for name in works}
    for i in range(args.repeats + 1):
        results: dict[str, Round] = {}
        sample = args.sample if i == 0 else 0

        def one(name: str, results: dict[str, Round] = results, sample: int = sample) -> None:
            results[name] = _round(url, works[name], args, sample)

        threads = [threading.Thread(target=one, args=(name,)) for name in works]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for name, r in results.items():
            if i == 0:
                out[name]["answers"] = r.answers
                out[name]["warm_up"] = r.summary()  # its statuses say what failed, if any
            else:
                out[name]["rounds"].append(r.summary())
    for row in out.values():
        row["tokens_per_s_median"] = record.rounds([x["tokens_per_s"] for x in row["rounds"]])[
            "median"
        ]
        row["rounds_tokens_per_s"] = [x["tokens_per_s"] for x in row["rounds"]]
    return out


def max_difference(name: str, alone: dict[int, Any], together: dict[int, Any]) -> float:
    """The largest difference over the sampled bodies both servers answered (a failed request
    has no answer: the warm-up rounds' statuses say how many)."""
    worst = 0.0
    for i, a in alone.items():
        b = together.get(i)
        if b is None:
            continue
        if name == "emb":
            for x, y in zip(a["data"], b["data"], strict=True):
                diff = decode_base64(x["embedding"]) - decode_base64(y["embedding"])
                worst = max(worst, float(np.abs(diff).max()))
        else:
            scores = {r["index"]: r["relevance_score"] for r in b["results"]}
            worst = max(
                worst, *(abs(r["relevance_score"] - scores[r["index"]]) for r in a["results"])
            )
    return worst


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--synthetic", choices=sorted(SHAPES), default="qwen3-0.6b")
    parser.add_argument("--passages", type=int, default=8192)
    parser.add_argument("--rerank-calls", type=int, default=2048)
    parser.add_argument("--clients", type=int, default=32, help="per workload")
    parser.add_argument("--repeats", type=int, default=record.MIN_ROUNDS, help="timed rounds")
    parser.add_argument("--sample", type=int, default=16, help="answers compared per workload")
    parser.add_argument("--max-seconds", type=float, default=300.0, help="per round")
    parser.add_argument(
        "--fractions", type=float, nargs=2, default=[0.45, 0.45], metavar=("EMB", "CE"),
        help="--gpu-memory-fraction of each model in the shared server",
    )  # fmt: skip
    add_server_and_client_args(parser, client_default="raw")
    parser.add_argument("--output", type=Path, help="write the report here as JSON")
    record.add_args(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.tokenizer is None:
        from vecpool.api import default_model_path

        args.tokenizer = default_model_path()
    device = torch.device(args.device)
    report: dict[str, Any] = {
        **record.header(
            "bench_multi_model.py",
            sys.argv[1:] if argv is None else argv,
            device=args.device,
            commit=args.commit,
        ),
        "models": {
            "emb": f"{args.synthetic} (random weights)",
            "ce": "bert-base cross-encoder (random weights)",
        },
        "args": {
            k: record.portable_arg(str(v)) if isinstance(v, Path) else v
            for k, v in vars(args).items()
        },
    }
    works = workloads(args)
    with tempfile.TemporaryDirectory(prefix="vecpool-mm-") as tmp_name:
        tmp = Path(tmp_name)
        folders = {
            "emb": write_folder(SHAPES[args.synthetic], tmp / "emb", args.tokenizer, args.device),
            "ce": write_cross_encoder(tmp / "ce", args),
        }
        alone: dict[str, Any] = {}
        for name in MODELS:
            server = ModelsServer({name: folders[name]}, [], args, tmp / f"alone-{name}.log")
            try:
                server.wait_ready()
                alone[name] = run_rounds(server.url, {name: works[name]}, args)[name]
            finally:
                server.stop()
            alone[name]["server_command"] = [record.portable_arg(c) for c in server.command]
            print(
                f"alone    {name}: {alone[name]['tokens_per_s_median']:12.0f} tokens/s", flush=True
            )
        fractions = [a for f in args.fractions for a in ("--gpu-memory-fraction", str(f))]
        server = ModelsServer(
            folders, fractions if device.type == "cuda" else [], args, tmp / "together.log"
        )
        try:
            server.wait_ready()
            together = run_rounds(server.url, works, args)
            if any(set(r["warm_up"]["statuses"]) - {"200"} for r in together.values()):
                print("failed requests; the server's log ends:\n" + server.log.read_text()[-4000:])
        finally:
            server.stop()
        together["server_command"] = [record.portable_arg(c) for c in server.command]
    for name in MODELS:
        ratio = together[name]["tokens_per_s_median"] / alone[name]["tokens_per_s_median"]
        together[name]["ratio_to_alone"] = ratio
        answers = alone[name].pop("answers"), together[name].pop("answers")
        together[name]["answers_compared"] = len(answers[0].keys() & answers[1].keys())
        together[name]["max_abs_difference_to_alone"] = max_difference(name, *answers)
        print(
            f"together {name}: {together[name]['tokens_per_s_median']:12.0f} tokens/s "
            f"({ratio:.0%} of alone), largest difference to alone "
            f"{together[name]['max_abs_difference_to_alone']:.2e} over "
            f"{together[name]['answers_compared']} answers; warm-up statuses "
            f"{together[name]['warm_up']['statuses']}",
            flush=True,
        )
    report["alone"], report["together"] = alone, together
    record.write(args.output, report)
    return report


if __name__ == "__main__":
    main()
