"""The input stage: every form a prompt arrives in becomes a `Prompt` (token ids, prompt
embeddings or an image's patch rows, with its parameters) before it reaches the engine.
Model-free: no torch here.

- `prompts`: the input forms -> `Prompt`, truncation, validation against the model's limits
- `tokenizer`, `tokenizer_pool`, `wordpiece`, `wordpiece_pairs`: text to ids, in this process or
  in worker processes
- `images`: which inputs are images, and their reading on a pool of threads
- `media`: loading an image safely (allow-lists, byte and pixel caps, timeouts)
- `image_processing`: preprocessing equal to the checkpoint's Hugging Face image processor
- `pixels`: `ImagePixels`, an image as the patch rows the engine runs
- `arrays`: token-id and embedding arrays read and checked without copies
"""
