"""What each replica holds in its KV cache, learnt from the events vLLM publishes:
the events decoded from the wire (`events`) and the index of blocks per replica that
matches a prompt's leading blocks (`index`). Pure: no sockets, no clock.

Beside `fleet`, above the upstream client: it imports only the shared vocabulary."""
