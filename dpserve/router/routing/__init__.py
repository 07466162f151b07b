"""Which replica takes a request: the dispatcher and its slots (`dispatch`), the
admission queue (`admission`), the canary split of a deploy (`canary`), and the pure
selection policies (`policies`)."""
