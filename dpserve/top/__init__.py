"""`dpserve top`: a live terminal view of the fleet, read from the router.

- `scrape`: one scrape of the router's `/metrics` and `/metrics/engines` turned into
  per-replica samples, and `kv-aware`'s fleet-wide decisions (pure).
- `window`: rates, TTFT percentiles and hit rates over the last minute from successive
  scrapes, the rows the view shows and `kv-aware`'s summary (pure).
- `view`: rows and the summary as text, the columns chosen by what the router exports
  (pure).
- `fetch`: the three GETs of one refresh, and the messages a person reads when they
  fail (I/O).
- `app`: the Textual app, thin: it calls `fetch`, hands the result to `window`, draws.

Importing this package does no work; `textual` is imported by `app` only.
"""
