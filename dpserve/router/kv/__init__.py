"""What each replica holds in its KV cache, learnt from the events vLLM publishes:
the events decoded from the wire (`events`) and the index of blocks per replica that
matches a prompt's leading blocks (`index`), both pure: no sockets, no clock. And the
prompt's token ids to match with, as the engine computes them (`tokens` runs an
encoder off the event loop: `hf` for vLLM's Hugging Face tokenizers and chat templates,
with `chat` and `templates`; `prompt` is their shared vocabulary).

Beside `fleet`, above the upstream client: it imports only the shared vocabulary."""
