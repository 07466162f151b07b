"""One forwarded request's way: read and check its body (`request`), pick a replica
and hold a slot on it, send it upstream, retry what may be retried (`retry`), and pass
the answer back, whole or as a stream (`stream`: one owner from the first byte to
`[DONE]`, migration included), in the OpenAI envelope on errors (`upstream_errors`).
How an attempt ended is one of `attempt`'s outcomes; `proxy` is the endpoint that does
it in that order."""
