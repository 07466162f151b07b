"""Carrying a broken stream on to another replica: what may move (`eligibility`),
the request fields read as vLLM reads them (`fields`), the client's view of the stream
and the token replay (`replay`), the request that goes on (`continuation`), stop
strings across the seam (`stops`), and the migrator that runs it (`migrator`)."""
