"""The router's own cost: ``overhead`` (beside direct and vllm-router), its halves alone
(``upstream_clients``, ``front_servers``, ``proxy_python``), ``metrics_scrape`` and stream
``migration``. ``fixed_upstream`` also runs alone, as the upstream the others measure against;
the rest are their helpers."""
