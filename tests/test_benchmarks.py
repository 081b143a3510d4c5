"""The GPU benchmark scripts still run: their --smoke modes on a tiny model (CPU, Triton interpreter).

They run on the H200 only a few times per session, where a broken script costs device time; these
catch the breakage here first (a stack that errors, a model that outlives its worker).
"""

from __future__ import annotations

import collections
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _run(args: list[str], timeout: int) -> str:
    # The scripts as a user runs them on a CPU: the kernels' plain-PyTorch twins, not the Triton
    # interpreter the kernel tests use (which made the fp8_quality smoke 300 s instead of 15 s).
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.slow
def test_bench_step_smoke_every_fasttune_stack(tmp_path):
    out = tmp_path / "step.json"
    stdout = _run(["benchmarks/bench_step.py", "--smoke", "--stacks", "hf,fasttune,fasttune-recompute,fasttune-auto",
                   "--weights", "bf16", "--shapes", "1x32", "--steps", "1", "--warmup", "1", "--out", str(out)], 600)
    rows = json.loads(out.read_text())["rows"]
    assert {r["stack"] for r in rows} == {"hf", "fasttune", "fasttune-recompute", "fasttune-auto"}
    assert all("tokens_per_s" in r for r in rows), rows
    assert len({r["loss_step1"] for r in rows}) == 1, rows  # B = 0: every stack computes the same function
    assert "LEAK" not in stdout, stdout


@pytest.mark.slow
def test_bench_step_smoke_qwen25_nf4(tmp_path):
    """``--model qwen2.5-7b``: another family's shape (q/k/v biases, kept 16-bit beside the NF4 codes);
    hf and fasttune compute the same function (B = 0), here on padded rows (``--padded``: an attention mask);
    fasttune's row also carries a profile of two more steps (``--profile --profile-steps 2``)."""
    out = tmp_path / "step_qwen.json"
    _run(["benchmarks/bench_step.py", "--smoke", "--model", "qwen2.5-7b", "--stacks", "hf,fasttune", "--weights", "nf4",
          "--shapes", "3x32", "--steps", "1", "--warmup", "1", "--padded", "--profile", "--profile-steps", "2",
          "--out", str(out)], 600)
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert result["model"] == "qwen2.5-7b" and result["padded"] and [r["stack"] for r in rows] == ["hf", "fasttune"]
    assert all(32 < r["real_tokens"] < 3 * 32 for r in rows), rows  # the workers padded their rows
    assert all("tokens_per_s" in r for r in rows), rows
    assert rows[0]["loss_step1"] == rows[1]["loss_step1"], rows
    assert rows[1]["profile"].startswith("wall ") and "(2 steps profiled)" in rows[1]["profile"], rows[1]["profile"]
    assert "profile" not in rows[0]  # --profile alone: fasttune's row


@pytest.mark.slow
def test_bench_step_smoke_fp8_stack(tmp_path):
    """fasttune-fp8 (FP8 bases) beside fasttune: every projection converted (the worker checks the
    report), and the step-1 loss of the same function within FP8's error of the exact one."""
    out = tmp_path / "step.json"
    _run(["benchmarks/bench_step.py", "--smoke", "--stacks", "fasttune,fasttune-fp8", "--weights", "bf16",
          "--shapes", "1x32", "--steps", "1", "--warmup", "1", "--out", str(out)], 600)
    rows = {r["stack"]: r for r in json.loads(out.read_text())["rows"]}
    assert all("tokens_per_s" in r for r in rows.values()), rows
    exact, fp8 = rows["fasttune"]["loss_step1"], rows["fasttune-fp8"]["loss_step1"]
    assert abs(fp8 - exact) <= 1e-2 * exact, (exact, fp8)


@pytest.mark.slow
def test_fp8_quality_smoke(tmp_path):
    """fp8_quality.py end to end on a tiny model: two adapter seeds of each arm (one ablation), the
    paired gaps, the noise floor between the 16-bit seeds and the per-projection table."""
    out = tmp_path / "q.json"
    _run(["benchmarks/fp8_quality.py", "--preset", "smoke", "--seeds", "2", "--variants", "fp8,fp8-fwd",
          "--out", str(out)], 900)
    result = json.loads(out.read_text())
    assert {k: [r["adapter_seed"] for r in v] for k, v in result["runs"].items()} == {
        "bf16": [7, 8], "fp8": [7, 8], "fp8-fwd": [7, 8]}
    assert len(result["projection_errors"]) == 7 and set(result["summary"]["variants"]) == {"fp8", "fp8-fwd"}
    assert result["summary"]["max_rel_loss_gap"] <= 1e-2 and result["summary"]["noise_floor_max_rel_gap"] > 0
    assert all(r["y_fp8"] > r["y_16"] for r in result["projection_errors"])


def test_fp8_quality_variants_leave_one_quantisation_out_and_put_the_products_back():
    """``--variants``: fp8-fwd multiplies dY unquantised, fp8-bwd X, fp8-w both; each counts its calls and
    leave fasttune's product functions as they found them, also when the run fails."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import fp8_quality

    from fasttune.kernels import fp8, lora

    shipped = (fp8.forward_product, fp8.grad_input_product, lora.forward_product, lora.grad_input_product)
    torch.manual_seed(0)
    w = fp8.Fp8Weight.quantize(torch.randn(24, 40))
    x, dy, wd = torch.randn(5, 40, requires_grad=True), torch.randn(5, 24), w.dequantize()

    def run(variant):
        calls = collections.Counter()
        with fp8_quality.fp8_products(variant, calls):
            y = fp8.fp8_linear(x, w)
            (dx,) = torch.autograd.grad(y, x, dy)
        return y.detach(), dx, calls

    y, dx, calls = run("fp8")
    assert calls == {"forward": 1, "grad_input": 1}
    assert torch.equal(y, fp8.forward_product(x.detach(), w)) and torch.equal(dx, fp8.grad_input_product(dy, w))
    y_fwd, dx_fwd, _ = run("fp8-fwd")
    assert torch.equal(y_fwd, y) and not torch.equal(dx_fwd, dx)
    torch.testing.assert_close(dx_fwd, dy @ wd, rtol=1e-6, atol=1e-6)
    y_bwd, dx_bwd, _ = run("fp8-bwd")
    assert torch.equal(dx_bwd, dx) and not torch.equal(y_bwd, y)
    torch.testing.assert_close(y_bwd, x.detach() @ wd.t(), rtol=1e-6, atol=1e-6)
    y_w, dx_w, _ = run("fp8-w")
    assert not torch.equal(y_w, y)
    torch.testing.assert_close(y_w, x.detach() @ wd.t(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dx_w, dy @ wd, rtol=1e-6, atol=1e-6)
    assert (fp8.forward_product, fp8.grad_input_product, lora.forward_product, lora.grad_input_product) == shipped
    with pytest.raises(ZeroDivisionError), fp8_quality.fp8_products("fp8-w", collections.Counter()):
        1 / 0
    assert (fp8.forward_product, fp8.grad_input_product, lora.forward_product, lora.grad_input_product) == shipped


@pytest.mark.parametrize("script", ["benchmarks/gpu_suite.sh", "scripts/fetch_gpu_test_wheels.sh"])
def test_gpu_session_scripts_parse(script):
    subprocess.run(["bash", "-n", str(ROOT / script)], check=True)


def _trace():
    """An empty Chrome trace's event list and a function adding one complete ("X") event to it."""
    ev = []

    def add(cat, ts, dur, name, **args):
        ev.append(dict(ph="X", cat=cat, ts=ts, dur=dur, name=name, args=args))

    return ev, add


def test_trace_gaps_attributes_idle_time_to_phases_and_launching_ops():
    """bench_step's profile reads GPU idle gaps out of a Chrome trace: host-bound when the next
    kernel's launch started after the GPU went idle; grouped by annotated phase and launching op."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from trace_gaps import gap_report

    ev, add = _trace()
    add("user_annotation", 0, 500, "forward")
    add("user_annotation", 500, 500, "backward")
    add("cpu_op", 0, 50, "aten::mm")
    add("cuda_runtime", 1, 2, "cudaLaunchKernel", correlation=1)
    add("kernel", 10, 100, "gemm_a", correlation=1)
    add("cpu_op", 140, 20, "aten::add")
    add("cuda_runtime", 150, 2, "cudaLaunchKernel", correlation=2)
    add("kernel", 155, 100, "add_kernel", correlation=2)          # 45 us, host-bound
    add("cuda_driver", 200, 2, "cuLaunchKernelEx", correlation=3)
    add("kernel", 300, 100, "triton_kernel", correlation=3)       # 45 us, launched early: not host-bound
    add("cpu_op", 600, 30, "MyFunction")
    add("cuda_runtime", 610, 2, "cudaLaunchKernel", correlation=4)
    add("kernel", 620, 10, "gemm_b", correlation=4)               # 220 us in backward, host-bound
    report = gap_report({"traceEvents": ev}, min_us=20)
    lines = report.splitlines()
    assert lines[0].startswith("GPU span 0.6 ms, idle in gaps >= 20 us: 0.3 ms (3 gaps; CPU-bound 0.3 ms)")
    assert lines[1] == "by phase: backward 0.2 ms, forward 0.1 ms"
    assert lines[2].startswith("by launching op: MyFunction 0.2 ms")
    assert lines[5] == "| 220 | backward | yes | MyFunction | triton_kernel | gemm_b |"
    assert "| 45 | forward | no | - | add_kernel | triton_kernel |" in lines


def _copy_wait_trace():
    """A forward whose second GEMM, queued at 9 us, waits for a side stream's copy until 225 us (120 us idle)."""
    ev, add = _trace()
    add("user_annotation", 0, 280, "forward")
    add("cpu_op", 0, 10, "aten::mm")
    add("cuda_runtime", 1, 2, "cudaLaunchKernel", correlation=1)
    add("kernel", 5, 100, "gemm_a", correlation=1, stream=7)
    add("cuda_runtime", 4, 2, "cudaMemcpyAsync", correlation=2)
    add("gpu_memcpy", 20, 200, "Memcpy HtoD", correlation=2, stream=13)
    add("cpu_op", 8, 5, "StashTake")
    add("cuda_runtime", 9, 2, "cudaLaunchKernel", correlation=3)
    add("kernel", 225, 50, "gemm_b", correlation=3, stream=7)
    return ev, add


def test_stream_report_tells_the_compute_streams_waits_from_host_bound_gaps():
    """A compute-stream gap whose next kernel was queued before the gap is a wait (here on a copy of
    the side stream, which keeps the GPU busy); one launched after it went idle is host-bound."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from trace_gaps import stream_report

    ev, add = _copy_wait_trace()
    add("user_annotation", 280, 220, "backward")
    add("cpu_op", 400, 10, "aten::add")
    add("cuda_runtime", 401, 2, "cudaLaunchKernel", correlation=4)
    add("kernel", 405, 10, "add_kernel", correlation=4, stream=7)  # launched after 275: host-bound 130 us
    lines = stream_report({"traceEvents": ev}, min_us=20).splitlines()
    assert lines[0] == "busy by stream: 13 0.2 ms, 7 0.2 ms (compute)"  # the copy stream is busier
    assert lines[1] == "compute stream: span 0.4 ms, idle in gaps >= 20 us: host-bound 0.1 ms, waiting 0.1 ms"
    assert lines[2] == "host-bound by phase: backward 0.1 ms"
    assert lines[3] == "waiting, by the op launching the next kernel: StashTake 0.1 ms"
    assert lines[4] == "waiting by phase: forward 0.1 ms"
    assert lines[7] == "| 120 | forward | StashTake | gemm_b | 13: 115 us in 1 (Memcpy HtoD) |"


def test_shrunk_trace_gives_the_same_stream_report(tmp_path):
    """``shrink`` drops short CPU ops and unused arguments, keeps what the reports read: same report from the copy."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from trace_gaps import shrink, stream_report

    ev, add = _copy_wait_trace()
    add("cpu_op", 1, 2, "aten::view")  # shorter than min_op_us: dropped
    dst = tmp_path / "t.json.gz"
    assert shrink({"traceEvents": ev}, str(dst), min_op_us=5) == (len(ev), len(ev) - 1)
    assert stream_report(str(dst)) == stream_report({"traceEvents": ev})


@pytest.mark.slow
@pytest.mark.parametrize("model", ["qwen3-30b-a3b", "gpt-oss-20b"])
def test_bench_moe_step_smoke(tmp_path, model):
    """The MoE step script on both shapes: hf and fasttune rows with LoRA on the experts, the same
    step-1 loss (B = 0), every MoE call fused, one RESULT line per stack."""
    out = tmp_path / "moe.json"
    stdout = _run(["benchmarks/bench_moe_step.py", "--smoke", "--model", model, "--stacks", "hf,fasttune",
                   "--layers", "2", "--ckpt-dir", "", "--out", str(out)], 900)
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert result["model"] == model and result["layers"] == 2, result
    assert [r["stack"] for r in rows] == ["hf", "fasttune"] and all("tokens_per_s" in r for r in rows), rows
    assert abs(rows[0]["loss_step1"] - rows[1]["loss_step1"]) <= 1e-3, rows
    assert rows[1]["calls"] and all(k.endswith("/fused") for k in rows[1]["calls"]), rows
    assert stdout.count("RESULT hf 1x64:") == 1 and stdout.count("RESULT fasttune 1x64:") == 1, stdout


@pytest.mark.slow
def test_bench_moe_step_smoke_nf4(tmp_path):
    """``--weights nf4`` (QLoRA): attention in bitsandbytes NF4, fasttune's experts in NF4 too (every
    expert call fused on NF4 weights); hf keeps the experts dense, so the step-1 losses differ by the
    experts' NF4 rounding only."""
    out = tmp_path / "moe_nf4.json"
    _run(["benchmarks/bench_moe_step.py", "--smoke", "--stacks", "hf,fasttune", "--layers", "1", "--weights", "nf4",
          "--ckpt-dir", "", "--out", str(out)], 900)
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert result["weights"] == "nf4" and all("tokens_per_s" in r for r in rows), rows
    assert rows[1]["calls"].get("moe_nf4/fused", 0) >= 1 and all(k.endswith("/fused") for k in rows[1]["calls"])
    assert abs(rows[0]["loss_step1"] - rows[1]["loss_step1"]) <= 1e-2 * abs(rows[0]["loss_step1"]), rows


@pytest.mark.slow
def test_bench_vlm_smoke_survives_a_failing_stack(tmp_path):
    """Qwen2.5-VL step script: hf and fasttune rows with the same first loss (LoRA B = 0), and a
    stack that cannot run (Unsloth without its checkpoint dir, or not installed) reported, not fatal."""
    out = tmp_path / "vlm.json"
    stdout = _run(["benchmarks/bench_vlm.py", "--smoke", "--stacks", "hf,fasttune,unsloth", "--steps", "1",
                   "--warmup", "1", "--ckpt-dir", "", "--out", str(out)], 600)
    rows = {r["stack"]: r for r in json.loads(out.read_text())["rows"]}
    assert "tokens_per_s" in rows["hf"] and "tokens_per_s" in rows["fasttune"], rows
    assert rows["hf"]["loss_step1"] == pytest.approx(rows["fasttune"]["loss_step1"], rel=1e-5)
    assert "error" in rows["unsloth"] and "FAILED" in stdout
    assert "image tokens" in stdout.splitlines()[0]


@pytest.mark.slow
def test_ab_no_grad_forward_smoke(tmp_path):
    """The in-process A/B of checkpointed forwards with and without autograd: both arms ran, and the
    no-autograd arm's layers took that path (the report's counts)."""
    out = tmp_path / "ab.json"
    stdout = _run(["benchmarks/ab_no_grad_forward.py", "--smoke", "--out", str(out)], 600)
    result = json.loads(out.read_text())
    assert "RESULT no_grad_forward" in stdout and "RESULT recorded" in stdout, stdout
    assert result["no_grad_forward"]["ms"] > 0 and result["recorded"]["ms"] > 0
    assert result["calls"].get("no_grad_forward/fused", 0) > 0, result["calls"]


@pytest.mark.slow
def test_ab_forward_graphs_smoke(tmp_path):
    """The forward-graphs A/B script runs end to end (on a CPU: the eager arm only, nothing captured)."""
    out = tmp_path / "ab.json"
    stdout = _run(["benchmarks/ab_forward_graphs.py", "--smoke", "--out", str(out)], 600)
    result = json.loads(out.read_text())
    assert "RESULT run eager" in stdout and result["eager"]["ms"] > 0, stdout
    assert result["captured"] == result["replays"] == 0 and all(map(math.isfinite, result["eager"]["losses"]))


def test_bench_moe_step_rounds_table_takes_medians_and_memory_ranges():
    """``--rounds``: each stack's rows of every round merge into one table line: the median tok/s
    (the ratios' basis), each round's tok/s, the range of peak memory, failed rounds and rounds the time
    budget left unstarted counted apart."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_moe_step as moe

    args = moe.parse_args(["--stacks", "fasttune,unsloth", "--rounds", "3"])

    def row(stack, n, tok, alloc, reserved):
        return dict(stack=stack, shape="4x2048", round=n, tokens_per_s=tok, peak_gib=alloc, peak_reserved_gib=reserved)

    rows = [row("fasttune", 1, 300, 13.44, 14.19), row("unsloth", 1, 200, 13.81, 14.15),
            row("fasttune", 2, 330, 13.44, 14.06), dict(stack="unsloth", shape="4x2048", round=2, error="boom"),
            row("fasttune", 3, 310, 13.44, 14.12), row("unsloth", 3, 250, 13.81, 13.99),
            dict(stack="fasttune", shape="4x2048", round=4, error="skipped: time budget")]
    lines = moe.table(rows, args).splitlines()
    assert "median of the rounds" in lines[0]
    assert lines[2] == ("| fasttune | 4x2048 | 310 (1.38× unsloth); 300, 330, 310; 1 not run (time budget) | 13.44 "
                        "| 14.06–14.19 |")
    assert lines[3] == "| unsloth | 4x2048 | 225 (-); 200, 250; 1 failed | 13.81 | 13.99–14.15 |"
    single = moe.table(rows[:2], moe.parse_args(["--stacks", "fasttune,unsloth"])).splitlines()
    assert single[2] == "| fasttune | 4x2048 | 300 (1.50× unsloth) | 13.44 | 14.19 |"
    with pytest.raises(SystemExit):
        moe.parse_args(["--rounds", "0"])


def test_pool_peak_places_each_pools_peak_and_names_what_was_alive():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from allocator_segments import pool_peak

    MiB = 2 ** 20

    def frames(name):  # innermost first, as torch records them: a torch frame, then fasttune's caller
        return [{"filename": "/env/site-packages/torch/functional.py", "line": 7, "name": "mm"},
                {"filename": "/repo/fasttune/kernels/grouped_mlp.py", "line": 300, "name": name}]

    def ev(action, addr, size, name=""):
        return dict(action=action, addr=addr * MiB, size=size * MiB, frames=frames(name) if name else [])

    snapshot = {"segments": [dict(address=0, total_size=1000 * MiB, segment_pool_id=(0, 0)),
                             dict(address=1000 * MiB, total_size=1000 * MiB, segment_pool_id=(0, 1))],
                "device_traces": [[
                    ev("alloc", 0, 100, "weights"),         # 0 main
                    ev("alloc", 1000, 300, "gate_up"),      # 1 pool
                    ev("alloc", 1300, 200, "dy"),           # 2 pool
                    ev("free_requested", 1000, 300),        # 3 not completed: still the pool's
                    ev("alloc", 1500, 100, "dy"),           # 4 pool: 600, its peak
                    ev("free_completed", 1000, 300),        # 5 pool: 300
                    ev("alloc", 100, 50, "head"),           # 6 main: 150
                    ev("free_completed", 100, 50),          # 7 main: 100
                    ev("alloc", 200, 20, "head"),           # 8 main: 120
                    ev("alloc", 5000, 999, "elsewhere"),    # 9 in no segment of the snapshot: no pool's
                    dict(ev("alloc", 1700, 50, "graph"), pool_id=(0, 2)),  # 10 newer torch names the pool itself
                ]]}
    pool = pool_peak(snapshot, (0, 1))
    assert (pool["peak_mib"], pool["at_entry"], pool["entries"]) == (600, 4, 11)
    assert pool["live"] == [dict(where="kernels/grouped_mlp.py:300 dy", mib=300, blocks=2),
                            dict(where="kernels/grouped_mlp.py:300 gate_up", mib=300, blocks=1)]
    main = pool_peak(snapshot, (0, 0))
    assert (main["peak_mib"], main["at_entry"]) == (150, 6)
    later = pool_peak(snapshot, (0, 0), since=7)  # after a warm-up: the peak of the entries from 7 on
    assert (later["peak_mib"], later["at_entry"]) == (120, 8)
    assert {r["where"]: r["mib"] for r in later["live"]} == {"kernels/grouped_mlp.py:300 weights": 100,
                                                              "kernels/grouped_mlp.py:300 head": 20}
    assert pool_peak(snapshot, (0, 2))["peak_mib"] == 50


def test_bench_gc_runs_both_arms_and_the_frozen_one_freezes():
    stdout = _run(["benchmarks/bench_gc.py", "--steps", "2", "--layers", "2"], 600)
    rows = [line.split("|")[1:-1] for line in stdout.splitlines() if line.startswith(("| on", "| freeze"))]
    assert [r[0].strip() for r in rows] == ["on", "freeze"], stdout
    assert "(0 frozen)" in rows[0][1] and "(0 frozen)" not in rows[1][1], stdout


def test_bench_step_padded_batch_masks_and_ignores_the_padding():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from bench_step import padded_batch
    finally:
        sys.path.pop(0)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(4, 100, (6, 40), generator=g)
    batch = padded_batch(ids, g)
    mask, labels = batch["attention_mask"], batch["labels"]
    lengths = mask.sum(1)
    assert lengths[0] == 40 and bool((lengths >= 20).all()) and bool((lengths < 40).any()), lengths
    for row, n in enumerate(lengths.tolist()):  # right padding: the row's tokens first, then the masked rest
        assert mask[row, :n].all() and not mask[row, n:].any()
        assert torch.equal(labels[row, :n], ids[row, :n]) and bool((labels[row, n:] == -100).all())


def test_bench_step_reads_the_capped_time_between_two_steps():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from bench_step import _throttled_since
    finally:
        sys.path.pop(0)
    assert _throttled_since(None, None) == {}
    first = (5_000_000_000, 7_000_000, ["sw_power_cap"])
    assert _throttled_since(None, first) == {"clock_reasons": ["sw_power_cap"]}  # no step before: no span
    later = (5_612_340_000, 7_000_000, [])
    assert _throttled_since(first, later) == {"clock_reasons": [], "power_capped_ms": 612.3, "thermal_capped_ms": 0.0}
