"""config.pbtxt parameters: the engine's, the Triton adapter's switches (Triton's vLLM
backend's names), and the refusal of every other key."""

from __future__ import annotations

import pytest

from backend.config import EngineConfig, ServingOptions, token_budget


def test_the_vllm_backend_switches_are_accepted_and_read():
    params = {"max_num_seqs": "8", "REPORT_CUSTOM_METRICS": "false", "ENABLE_VLLM_HEALTH_CHECK": "true",
              "health_check_stall_s": "2.5", "merge_queued_responses": "off", "stream_interval": "4"}
    assert EngineConfig.from_parameters(params, "/m").max_num_seqs == 8
    assert ServingOptions.from_parameters(params) == ServingOptions(
        report_custom_metrics=False, enable_health_check=True, health_check_stall_s=2.5, merge_queued_responses=False,
        stream_interval=4)
    # Absent: metrics on (our default), health check off (the vLLM backend's), queued responses
    # merged, a response per token (vLLM's default).
    assert ServingOptions.from_parameters({}) == ServingOptions(report_custom_metrics=True, enable_health_check=False,
                                                                merge_queued_responses=True, stream_interval=1)


def test_every_other_unknown_key_is_refused_by_name():
    with pytest.raises(ValueError, match=r"unknown engine parameter\(s\) \['ENABLE_VLLM_HEALTH'\]") as info:
        EngineConfig.from_parameters({"ENABLE_VLLM_HEALTH": "true"}, "/m")
    assert "REPORT_CUSTOM_METRICS" in str(info.value) and "ENABLE_VLLM_HEALTH_CHECK" in str(info.value)


@pytest.mark.parametrize("params, message", [
    ({"REPORT_CUSTOM_METRICS": "maybe"}, "REPORT_CUSTOM_METRICS='maybe' is not a valid bool"),
    ({"health_check_stall_s": "0"}, "health_check_stall_s=0.0 must be > 0"),
    ({"stream_interval": "0"}, "stream_interval=0 must be >= 1"),
    ({"stream_interval": "two"}, "stream_interval='two' is not a valid int"),
])
def test_bad_switch_values_are_refused(params, message):
    with pytest.raises(ValueError, match=message):
        ServingOptions.from_parameters(params)


def test_the_token_budget_is_the_devices_unless_given():
    """max_num_batched_tokens 0 (the default): 512 tokens an iteration on a CPU, 2048 on a GPU;
    a given budget is kept; a negative one is refused by name."""
    assert EngineConfig(model_path="/m").max_num_batched_tokens == 0
    assert token_budget(EngineConfig(model_path="/m"), "cpu") == 512
    assert token_budget(EngineConfig(model_path="/m"), "cuda") == 2048
    assert token_budget(EngineConfig(model_path="/m", max_num_batched_tokens=64), "cpu") == 64
    with pytest.raises(ValueError, match=r"max_num_batched_tokens=-1 must be >= 0"):
        EngineConfig(model_path="/m", max_num_batched_tokens=-1)
