"""Seconds each long test file takes on the 2-core CI VM (one xdist worker, the other busy; sums of a full run's
--durations=0, 2026-12-08: 2,091 worker-seconds, 1,077 s of wall), for the longest-first order of
tests/crash_rerun.py's scheduler. A file not listed counts half a second a test. Only the order uses these: a
stale figure costs balance, never a test."""

from __future__ import annotations

FILE_SECONDS = {
    "tests/test_scripts.py": 220, "tests/test_batch.py": 160, "tests/test_generate.py": 120, "tests/test_fp8.py": 110,
    "tests/test_budget.py": 105, "tests/test_draft_vocab.py": 95, "tests/test_serve.py": 95, "tests/test_cli.py": 85,
    "tests/test_precompile.py": 85, "tests/kernel_tests/test_gdn_tree.py": 65,
    "tests/kernel_tests/mgpu/test_tree_attention_mgpu.py": 60, "tests/kernel_tests/test_gdn_decode_fused.py": 60,
    "tests/kernel_tests/test_rms_norm.py": 55, "tests/kernel_tests/test_w8a8.py": 55,
    "tests/kernel_tests/test_dense.py": 55, "tests/test_model.py": 55, "tests/test_verify.py": 50,
    "tests/test_tp.py": 45, "tests/kernel_tests/test_tree_attention.py": 40,
    "tests/kernel_tests/mgpu/test_dense_mgpu.py": 40, "tests/kernel_tests/test_attention_decode.py": 35,
    "tests/test_convert.py": 35, "tests/test_train.py": 35, "tests/test_executables.py": 35,
    "tests/kernel_tests/mgpu/test_w8a8_mgpu.py": 30, "tests/test_tree.py": 30, "tests/test_serve_cli.py": 30,
    "tests/kernel_tests/mgpu/test_prefill_attention_mgpu.py": 25, "tests/test_prefix_cache.py": 25,
    "tests/kernel_tests/test_gdn_prefill.py": 25, "tests/kernel_tests/test_shared_memory.py": 25,
    "tests/kernel_tests/test_prefill_attention.py": 25, "tests/test_compare_reference.py": 20,
    "tests/test_drafter.py": 20, "tests/kernel_tests/test_gdn_tree_slots.py": 15,
}


def seconds(scope: str, n_tests: int) -> float:
    """Expected seconds of a work unit (a test file under --dist loadfile) of n_tests tests."""
    return FILE_SECONDS.get(scope.split("::")[0], 0.5 * n_tests)
