"""The model-free side of vecpool: everything a call needs before and after the engine runs it.

One options object per task (`options.py`: what each call accepts, its defaults and checks).
Preparing a call (`context.py`: `CallContext`, `make_requests`; `prepare.py`: one `prepare_*`
function per task; `listwise.py`, `windowed.py`, `chat.py`), what an engine serves
(`info.py`: `EngineInfo`), what a call sends and gets back (`outputs.py`) and the pure
post-processing of outputs (`postprocess.py`). Nothing here imports torch or the engine: the
server's API processes run on this package alone, and `Engine` prepares its calls with it.
"""

from vecpool.calls.context import (
    CallContext,
    InputList,
    TokenizedText,
    as_input_list,
    check_dimensions,
    detokenize,
    instruction,
    make_requests,
    role_prompt_name,
    tokenize,
    tokenize_text,
)
from vecpool.calls.info import EngineInfo
from vecpool.calls.options import (
    ClassifyOptions,
    EmbedOptions,
    EncodeOptions,
    Options,
    RerankOptions,
    ScoreOptions,
    SparseOptions,
    check_top_k,
    check_top_n,
)
from vecpool.calls.outputs import PoolingOutput, PreparedCall, PromptRequest, RunTimes, output_data
from vecpool.calls.prepare import (
    SparseResult,
    check_one_score,
    check_quantization,
    cut_documents,
    on_side,
    pair_indices,
    pair_up,
    prepare_classify,
    prepare_embed_sparse,
    prepare_encode,
    prepare_rerank,
    prepare_score,
    text_pairs,
)

__all__ = [
    "CallContext",
    "ClassifyOptions",
    "EmbedOptions",
    "EncodeOptions",
    "EngineInfo",
    "InputList",
    "Options",
    "PoolingOutput",
    "PreparedCall",
    "PromptRequest",
    "RerankOptions",
    "RunTimes",
    "ScoreOptions",
    "SparseOptions",
    "SparseResult",
    "TokenizedText",
    "as_input_list",
    "check_dimensions",
    "check_one_score",
    "check_quantization",
    "check_top_k",
    "check_top_n",
    "cut_documents",
    "detokenize",
    "instruction",
    "make_requests",
    "on_side",
    "output_data",
    "pair_indices",
    "pair_up",
    "prepare_classify",
    "prepare_embed_sparse",
    "prepare_encode",
    "prepare_rerank",
    "prepare_score",
    "role_prompt_name",
    "text_pairs",
    "tokenize",
    "tokenize_text",
]
