"""Simulator settings resolve flags > YAML > defaults and refuse bad values by name."""

from __future__ import annotations

import pytest

from dpserve.config import ConfigError
from dpserve.sim import SimConfig, build_sim_config


def test_flags_override_the_file_which_overrides_defaults():
    cfg = build_sim_config({"max_num_seqs": 8, "step_base_s": None},
                           {"max_num_seqs": 4, "step_base_s": 0.02, "model": "m"})
    assert (cfg.max_num_seqs, cfg.step_base_s, cfg.model) == (8, 0.02, "m")
    assert cfg.block_size == SimConfig().block_size


@pytest.mark.parametrize(("values", "field"), [
    ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"step_jitter": 1.0}, "step_jitter"),
    ({"prefill_per_token_s": -1}, "prefill_per_token_s"),
    ({"kv_cache_tokens": 4096, "max_model_len": 8192}, "kv_cache_tokens"),
    ({"step_base_s": 0, "prefill_per_token_s": 0, "decode_per_seq_s": 0}, "step_base_s"),
    ({"max_num_seqs": "many"}, "max_num_seqs"),
    ({"no_such_setting": 1}, "no_such_setting"),
])
def test_bad_settings_are_refused_naming_the_setting(values, field):
    with pytest.raises(ConfigError, match=field):
        build_sim_config({}, values)
