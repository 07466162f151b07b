"""The replicas and what the router knows of them: the pool and its states, health
checks and their hysteresis, circuit breakers, DNS discovery, the engines' own load
reports, the LoRA adapters served, and the streams in flight on each replica.

Below routing, telemetry and everything above: it imports only the shared vocabulary
(`dpserve.router.errors`, ...) and the upstream client."""
