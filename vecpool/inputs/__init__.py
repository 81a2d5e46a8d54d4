"""The input stage: every form a prompt arrives in becomes a `Prompt` (token ids or prompt
embeddings, with its parameters) before it reaches the engine.

- `prompts`: the input forms -> `Prompt`, truncation, validation against the model's limits
- `tokenizer`, `tokenizer_pool`, `wordpiece`, `wordpiece_pairs`: text to ids, in this process or
  in worker processes
- `arrays`: token-id and embedding arrays read and checked without copies
"""
