"""`dpserve top`: a live terminal view of the fleet, read from the router.

- `scrape`: one scrape of the router's `/metrics` and `/metrics/engines` turned into
  per-replica samples (pure).
- `window`: rates and TTFT percentiles over the last minute from successive scrapes,
  and the rows the view shows (pure).
- `fetch`: the three GETs of one refresh, and the messages a person reads when they
  fail (I/O).
- `app`: the Textual app, thin: it calls `fetch`, hands the result to `window`, draws.

Importing this package does no work; `textual` is imported by `app` only.
"""
