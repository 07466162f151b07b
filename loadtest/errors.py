"""Errors that end a load test before it measures anything.

    LoadTestError            base: the CLI prints its message as one line, exit status 2
    ├── ConfigError          a setting is invalid; the message names the flag
    ├── DatasetError         the prompts cannot be built (file, format, tokenizer)
    └── UnreachableError     the server cannot be reached, or does not serve the model

A request that fails *during* a run is not an exception: it is counted, by
reason, in the result (see `loadtest.client`).
"""

from __future__ import annotations


class LoadTestError(Exception):
    """A load test cannot start; the message is meant for the user, as is."""


class ConfigError(LoadTestError):
    pass


class DatasetError(LoadTestError):
    pass


class UnreachableError(LoadTestError):
    pass
