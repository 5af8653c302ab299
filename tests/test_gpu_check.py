"""tools/gpu_check.py on CPU: the parts that need no GPU (the FLOP count, the report, the refusal).

The sections themselves need CUDA and run only under `make gpu-check` on a GPU machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import ROOT
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(ROOT))
from tools import gpu_check as gc  # noqa: E402

TINY = dict(vocab=16, seq=8, layers=2, width=8, heads=2, mlp_ratio=4, tie_weights=True)


def hand_count(vocab, seq, layers, width, mlp_ratio, tokens, **_):
    """The tiny model counted by hand: parameters, and the matmul FLOPs of forward + backward."""
    h, f = width, mlp_ratio * width
    block_params = (2 * h) + (3 * h * h + 3 * h) + (h * h + h) + (2 * h) + (h * f + f) + (f * h + h)
    psi = vocab * h + seq * h + layers * block_params + 2 * h  # the head is the token embedding (tied)
    matmul_weights = layers * (3 * h * h + h * h + h * f + f * h) + vocab * h  # every Linear, and the head
    attention = layers * 2 * (2 * seq * h)  # per token: q·kᵀ over s keys and the weighted sum of s values
    return psi, 3 * (2 * matmul_weights + attention) * tokens  # backward = 2 x forward


def test_step_flops_is_6_psi_plus_attention_counted_by_hand():
    tokens = 3 * TINY["seq"]
    psi, _ = hand_count(**TINY, tokens=tokens)
    attention = 12 * TINY["layers"] * TINY["seq"] * TINY["width"] * tokens
    assert gc.step_flops(TINY, tokens) == 6 * psi * tokens + attention


def test_the_hand_count_of_matmul_flops_is_what_torch_counts():
    """torch's FlopCounterMode on a real forward and backward agrees with the hand count, so
    6Ψ + attention over-counts only the parameters that are not matmul weights."""
    from course_utils.models import GPTConfig, build_model

    model, batch = build_model(GPTConfig(**TINY)), 3
    idx = torch.randint(0, TINY["vocab"], (batch, TINY["seq"]))
    counter = FlopCounterMode(display=False)
    with sdpa_kernel(SDPBackend.MATH), counter:  # the math path: attention as matmuls torch can count
        model(idx, idx).backward()
    psi, matmul_flops = hand_count(**TINY, tokens=batch * TINY["seq"])
    assert counter.get_total_flops() == matmul_flops
    non_matmul = psi - (TINY["layers"] * 12 * TINY["width"] ** 2 + TINY["vocab"] * TINY["width"])
    assert gc.step_flops(TINY, batch * TINY["seq"]) - matmul_flops == 6 * non_matmul * batch * TINY["seq"]


def test_mfu_and_kernel_summary():
    assert gc.mfu(4e14, 1.0, 1e15) == pytest.approx(0.4)
    kernels = [
        {"name": "sm90_xmma_gemm_bf16", "us": 600.0, "calls": 10},
        {"name": "flash_bwd_kernel", "us": 200.0, "calls": 4},
        {"name": "ncclDevKernel_AllGather", "us": 100.0, "calls": 4},
        {"name": "vectorized_elementwise_kernel", "us": 100.0, "calls": 50},
    ]
    s = gc.summarise_kernels(kernels, wall_us=2000.0, top=2)
    assert s["busy_fraction"] == pytest.approx(0.5)
    assert [k["name"] for k in s["top"]] == ["sm90_xmma_gemm_bf16", "flash_bwd_kernel"]
    assert {c: v["share"] for c, v in s["by_category"].items()} == pytest.approx(
        {"matmul": 0.6, "attention": 0.2, "communication": 0.1, "elementwise and other": 0.1}
    )


def fake_results(mfu: float) -> dict:
    return {
        "meta": {"started": "2026-12-01 03:00 UTC", "finished": "2026-12-01 03:09 UTC", "total_s": 512.0},
        "device": {
            "name": "Fake GPU",
            "memory_bytes": 80 * 2**30,
            "capability": "9.0",
            "count": 1,
            "torch": "2.13.0",
            "cuda": "12.8",
            "cudnn": 91000,
            "nccl": "2.27.5",
        },
        "matmul_peak": {"n": 8192, "iters": 50, "trials": 3, "flops": 7.5e14, "data_sheet_flops": 9.89e14},
        "fsdp_1b": {
            "shape": gc.ONE_B,
            "psi": 1_077_463_040,
            "micro_batch": 8,
            "tokens": 16384,
            "flops_per_step": 1.2e14,
            "peak_flops": 7.5e14,
            "mfu": mfu,
            "timing": {"steps": 10, "step_s": 0.5, "step_times_s": [0.5] * 10, "tokens_per_s": 32768.0},
            "memory": {"measured": 30e9, "predicted": 29e9, "ratio": 30 / 29, "within_target": True},
            "profile": {
                "steps": 2,
                **gc.summarise_kernels([{"name": "nvjet_gemm", "us": 5e5, "calls": 9}], wall_us=1e6),
            },
        },
        "train_1gpu": {
            "error": "RuntimeError: rank 0 failed",
            "traceback": "Traceback ...\nRuntimeError: rank 0 failed\n",
        },
        "single_process": {
            "rows": [
                {"notebook": "00", "what": "all-reduce", "result": "nccl on cuda:0: [1.0]", "ok": True, "seconds": 9.0},
                {"notebook": "06", "what": "resume", "result": "bit-identical: False", "ok": False, "seconds": 20.0},
                {"notebook": "05", "what": "timers", "error": "RuntimeError: boom", "seconds": 1.0},
            ]
        },
        "nccl_2rank": {"not_run": "1 GPU here; the 2-rank NCCL runs need two or more"},
        "notebooks": {
            "parameters": {},
            "skipped": ["06_failure_recovery"],
            "rows": [
                {"notebook": "00_setup", "wall_s": 20.0, "error": None, "nccl": 0, "gloo": 3},
                {"notebook": "02_data_parallelism", "wall_s": 30.0, "error": "AssertionError: x", "nccl": 1, "gloo": 5},
            ],
        },
    }


def test_report_writer_renders_every_section_and_failure(tmp_path):
    results = fake_results(mfu=0.32)
    gc.write_report(results, tmp_path)
    assert json.loads((tmp_path / "gpu.json").read_text()) == json.loads(json.dumps(results))
    md = (tmp_path / "gpu.md").read_text()
    for text in (
        "Fake GPU",
        "**750 TFLOP/s** measured",
        "data sheet 989 TFLOP/s (not used)",
        "32.0%",
        "below the 40% target",
        "GPU ran no kernel for 50%",
        "1.034",
        "`nvjet_gemm`",
        "**Failed**: `RuntimeError: rank 0 failed`",
        "Not run: 1 GPU here",
        "| 02_data_parallelism | FAILED: `AssertionError: x` | 30.0 | 1 | 5 |",
        "Not run (time budget): 06_failure_recovery",
        "| 00 | all-reduce | nccl on cuda:0: [1.0] | 9.0 |",
        "| 06 | resume | **check this:** bit-identical: False | 20.0 |",
        "| 05 | timers | FAILED: `RuntimeError: boom`",
    ):
        assert text in md, text
    assert "meets the 40% target" in gc.report_markdown(fake_results(mfu=0.45))


def test_a_failing_section_is_recorded_and_the_next_one_runs(tmp_path):
    results = {"meta": {}}
    gc.run_section("device", lambda: 1 / 0, results, tmp_path)
    gc.run_section("matmul_peak", lambda: {"n": 2, "iters": 1, "trials": 1, "flops": 1e12}, results, tmp_path)
    assert results["device"]["error"] == "ZeroDivisionError: division by zero"
    assert "1 / 0" in results["device"]["traceback"] and results["matmul_peak"]["flops"] == 1e12
    assert "division by zero" in (tmp_path / "gpu.md").read_text()


def test_without_cuda_it_exits_2_with_one_line():
    """As a script, on a machine that shows no GPU (CUDA_VISIBLE_DEVICES empty hides them on any)."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "gpu_check.py")],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == "no CUDA device: run make gpu-check on a machine with a GPU\n"
