"""How far the load-test harness (the top-level ``loadtest`` package) can be trusted:
``accuracy``."""
