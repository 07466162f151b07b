"""Helpers more than one benchmark folder uses: processes and CPU placement
(``services``), tools installed outside the project's venv (``tools``), a fleet of real
vLLM CPU replicas composed in-process (``fleet``). Nothing here runs on its own."""
