"""Carrying a broken stream on to another replica: what may move (`eligibility`),
the request fields read as vLLM reads them (`fields`), the client's view of the stream
and the token replay (`replay`), what the client gets of each leg (`tracked`), the
request that goes on (`continuation`), stop strings across the seam (`stops`), and
where a broken stream goes next (`migrator`)."""
