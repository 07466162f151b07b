"""One forwarded request's way: read and check its body (`request`), pick a replica
and hold a slot on it, send it upstream, retry what may be retried (`retry`), and pass
the answer back, whole or as a stream (`relay`), in the OpenAI envelope on errors
(`upstream_errors`); `proxy` is the endpoint that does it in that order."""
