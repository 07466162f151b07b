"""What the router tells about itself: its Prometheus metrics (`metrics`, with the
scrape-time `collectors` and the workers' `merge`), every engine's own metrics relayed
(`federate`), and request traces (`tracing`)."""
