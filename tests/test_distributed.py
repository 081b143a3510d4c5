"""fasttune on several processes (2 gloo ranks on the CPU): DDP, FSDP2 and DeepSpeed ZeRO-3 give one
process's numbers.

Each test launches ``helpers/dist_worker.py`` on 2 ranks; rank 0 also runs one process on the whole
global batch and reports relative errors (fp32: ≤ 1e-5), which are asserted here. ZeRO-3 runs on
DeepSpeed's CPU accelerator (skipped without deepspeed); the head's ZeRO-3 decisions are also
checked in one process with parameters carrying DeepSpeed's attributes.
"""

import copy
import importlib.util
from types import SimpleNamespace

import pytest
import torch

import fasttune.model_patches.head as head_module
from fasttune import FastConfig, patch_model
from helpers.compare import assert_grads_close, rel_err
from helpers.dist_worker import VOCAB, launch
from helpers.tiny_models import make_batch, tiny_model

RTOL = 1e-5
FP8_RTOL = 1e-4  # FP8 bases: a rounding-level difference upstream moves an e4m3 tie now and then (measured 2.6e-5)
# (after a few SGD steps, the flipped codes compound: measured 6e-3 on the smallest gradient by the fourth step)
ADAM_RTOL = 5e-4  # after AdamW steps: its first update g/(|g|+eps) turns rounding in tiny gradients into lr-sized steps
needs_dist = pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                                reason="torch.distributed with gloo is needed")


def _check_fp32_steps(case: dict, n_steps: int = 2, rtol: float = RTOL) -> None:
    assert len(case["steps"]) == n_steps
    for step, s in enumerate(case["steps"]):
        where = f"{case['case']} step {step}"
        assert s["missing"] == [], f"{where}: no gradient for {s['missing']}"
        assert s["loss_err"] <= rtol, f"{where}: loss differs by {s['loss_err']:.2e}"
        assert s["max_grad_err"] <= rtol, f"{where}: a gradient differs by {s['max_grad_err']:.2e}"


def _check_kernel_inputs(ranks: list[dict], case_index: int, dtype: str) -> None:
    """On every rank the fused loss got one whole (plain tensor) weight per step; kernels got ``dtype``."""
    for r, rank in enumerate(ranks):
        case = rank["cases"][case_index]
        for step, s in enumerate(case["steps"]):
            assert s["head_calls"] == [[dtype, dtype, "Tensor"]], f"rank {r} {case['case']} step {step}: {s}"
            assert s["norm_calls"] == [[dtype, dtype, "Tensor"]], f"rank {r} {case['case']} step {step}: {s}"


@needs_dist
@pytest.mark.distributed
def test_ddp_lora_with_checkpointing_matches_one_process(tmp_path):
    """LoRA + fused LoRA/head + "offload" checkpointing under DDP, find_unused_parameters False and
    True: no "marked ready twice", all-reduced gradients = one process on the global batch."""
    rank0, _ = launch("ddp", tmp_path)
    patched = rank0["patched"]
    assert patched["cross_entropy"] == 1 and patched["checkpointing"] == 2
    assert sum(v for k, v in patched.items() if k.startswith("lora")) > 0, patched
    assert [(r["find_unused"], r["step"]) for r in rank0["rounds"]] == [(False, 0), (False, 1), (True, 0), (True, 1)]
    for r in rank0["rounds"]:
        assert r["n_missing"] == 0 and r["n_grads"] > 0
        assert r["loss_err"] <= RTOL and r["max_grad_err"] <= RTOL, r


@needs_dist
@pytest.mark.distributed
def test_fp8_bases_under_ddp_and_fsdp2_match_one_process(tmp_path):
    """FastConfig(base_dtype="fp8"): DDP ("offload" checkpointing) broadcasts the uint8 codes;
    FSDP2 (accelerate's layout, "auto" checkpointing) shards them by rows, gathers them whole for
    the fused LoRA products (the scales are a buffer, whole on every rank) and never casts them.
    Per-row quantisation of X and dY makes a token's numbers independent of the batch it is in,
    so loss and gradients equal one FP8 process on the global batch (to FP8_RTOL)."""
    rank0, rank1 = launch("ddp", tmp_path / "ddp", "fp8", timeout=600)
    for rank in (rank0, rank1):
        assert {rank["patched"].get("fp8_" + p) for p in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                            "up_proj", "down_proj")} == {2}, rank["patched"]
        assert rank["base_dtypes"] == ["torch.uint8"] and sum(rank["fp8_calls"].values()) > 0
    first, *later = rank0["rounds"]
    assert first["n_missing"] == 0 and first["loss_err"] <= FP8_RTOL and first["max_grad_err"] <= FP8_RTOL, first
    # After SGD steps the two runs' weights differ by rounding, which FP8's rounding steps turn into
    # a code flipped here and there: later steps agree to FP8's own error, not to fp32 rounding.
    for r in later:
        assert r["n_missing"] == 0 and r["loss_err"] <= FP8_RTOL and r["max_grad_err"] <= 5e-2, r
    ranks = launch("fsdp2", tmp_path / "fsdp2", "lora_fp8", timeout=600)
    for rank in ranks:
        (case,) = rank["cases"]
        assert case["kind"] == "dtensor" and case["patched"]["fp8_q_proj"] == 2
        assert case["sharded_base_dtypes"] == ["DTensor torch.uint8"] and sum(case["fp8_calls"].values()) > 0
    (case,) = ranks[0]["cases"]
    first, second = case["steps"]
    assert first["missing"] == [] and first["loss_err"] <= FP8_RTOL and first["max_grad_err"] <= FP8_RTOL, first
    assert second["missing"] == [] and second["loss_err"] <= FP8_RTOL and second["max_grad_err"] <= 5e-2, second
    assert case["export_err"] <= 1e-4 and case["after_export_types"] == ["DTensor"]


@needs_dist
@pytest.mark.distributed
def test_fsdp2_accelerate_layout_matches_one_process(tmp_path):
    """accelerate's FSDP2 layout (layers, embeddings and lm_head in units of their own, tied ones
    together): the fused loss unshards lm_head's unit; loss and gradients = one process (LoRA, full
    fine-tuning, tied); a bf16 mixed-precision policy hands bf16 to the kernels; export gathers."""
    cases = ("lora", "full", "full_tied", "bf16")
    ranks = launch("fsdp2", tmp_path, *cases)
    rank0 = {c["case"]: c for c in ranks[0]["cases"]}
    for i, name in enumerate(cases):
        case = rank0[name]
        assert case["kind"] == "dtensor" and case["patched"]["cross_entropy"] == 1
        _check_kernel_inputs(ranks, i, "torch.bfloat16" if name == "bf16" else "torch.float32")
        assert case["export_types"] == ["Tensor"] and case["after_export_types"] == ["DTensor"]
        assert case["export_tied"] is (name == "full_tied")
        if name != "bf16":
            _check_fp32_steps(case)
            assert case["export_err"] <= 1e-6, f"{name}: exported weights differ by {case['export_err']:.2e}"
    assert rank0["full"]["steps"][0]["lm_head_err"] <= RTOL  # the reduce-scattered gradient of the unit we unsharded
    for s in rank0["bf16"]["steps"]:  # bf16 against the fp32 single process: rounding-level only
        assert s["loss_err"] <= 5e-3 and s["lm_head_err"] <= 5e-2 and s["missing"] == [], s


@needs_dist
@pytest.mark.distributed
def test_fsdp2_adapter_layers_kept_gathered_match_one_process(tmp_path):
    """LoRA decoder-layer units kept all-gathered from forward to backward (fsdp_reshard_after_forward
    = False): their frozen weights are still whole between forward and backward (resharded DTensors
    by default), "auto" changes nothing without CUDA, the memory they take is reserved from "auto"
    checkpointing's budget, and loss and gradients equal one process."""
    ranks = launch("fsdp2", tmp_path, "lora", "lora_gathered")
    for rank in ranks:
        default, gathered = rank["cases"]
        assert default["layer_param_types_after_forward"] == ["DTensor"]
        assert gathered["kept_gathered_auto"] == 0 and gathered["kept_gathered"] == 2  # both decoder layers
        assert gathered["layer_param_types_after_forward"] == ["Parameter"]
        reserved, expected = gathered["reserved_bytes"]  # "auto" checkpointing budgets for the gathered layers
        assert reserved == expected > 0
    gathered = ranks[0]["cases"][1]
    _check_kernel_inputs(ranks, 1, "torch.float32")
    _check_fp32_steps(gathered)
    assert gathered["export_err"] <= 1e-6 and gathered["after_export_types"] == ["DTensor"]


@needs_dist
@pytest.mark.distributed
def test_fsdp2_lm_head_in_root_unit_and_dtensor_lm_head(tmp_path):
    """lm_head inside the root's unit (unsharded for the whole forward: read as is) and an lm_head
    whose weight alone is a DTensor (``full_tensor``, gradient averaged back onto the shards)."""
    cases = ("full_root", "dtensor_head")
    ranks = launch("fsdp2", tmp_path, *cases)
    for i, case in enumerate(ranks[0]["cases"]):
        assert case["case"] == cases[i] and case["kind"] == "dtensor"
        _check_kernel_inputs(ranks, i, "torch.float32")
        _check_fp32_steps(case)
        assert all(s["lm_head_err"] <= RTOL for s in case["steps"])


@needs_dist
@pytest.mark.distributed
@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="bitsandbytes is not installed")
def test_fsdp2_qlora_nf4_codes_sharded_match_one_process(tmp_path):
    """QLoRA under FSDP2 (issue 24): a checkpoint loaded in NF4 with ``bnb_4bit_quant_storage`` float32
    or bfloat16, sharded by accelerate's FSDP2 preparation. Each rank holds half of every projection's
    codes; the fused NF4 LoRA path (its dequantiser counted) and the fused loss run on every rank, no
    call falls back; loss and every adapter gradient equal one unsharded process (fp32 compute); the
    export gathers the very codes back."""
    cases = ("qlora", "qlora_bf16_storage")
    ranks = launch("fsdp2", tmp_path, *cases)
    for i, name in enumerate(cases):
        for r, rank in enumerate(ranks):
            case = rank["cases"][i]
            assert case["case"] == name and case["kind"] == "dtensor"
            dtype, local, whole = case["codes"]
            assert dtype == ("torch.bfloat16" if name == "qlora_bf16_storage" else "torch.float32")
            assert 2 * local == whole, f"rank {r} {name}: {local} of {whole} code elements"
            assert case["layer_param_types_after_forward"] == ["DTensor"]
            assert all(outcome == "fused" for outcome in (k.split("/", 1)[1] for k in case["calls"])), case["calls"]
            assert case["calls"]["lora_qkv/fused"] == case["calls"]["lora_mlp/fused"] == 8  # 2 layers x 2 steps x 2
            assert all(s["nf4_dequantized"] > 0 for s in case["steps"]), f"rank {r} {name}: NF4 path not taken"
        _check_kernel_inputs(ranks, i, "torch.float32")
        case = ranks[0]["cases"][i]
        _check_fp32_steps(case)
        assert case["export_codes_equal"] == [14, True] and case["export_err"] <= 1e-6
        assert case["after_export_types"] == ["DTensor"]


@needs_dist
@pytest.mark.distributed
def test_fast_trainer_ddp_exports_and_pushes_on_rank_0_only(tmp_path):
    """FastTrainer on 2 ranks (accelerate's DDP): DDP built with find_unused_parameters=False under
    fasttune's checkpointing, the same losses on both ranks, the adapter written and pushed once."""
    ranks = launch("trainer", tmp_path)
    for run in ("export", "push"):
        for rank in ranks:
            assert rank[run]["wrapped"] == "DistributedDataParallel"
            assert rank[run]["checkpointing"] == "offload" and rank[run]["find_unused"] is False
        assert ranks[0][run]["losses"] == ranks[1][run]["losses"] and len(ranks[0][run]["losses"]) == 2
    assert "adapter_model.safetensors" in ranks[0]["export"]["adapter_files"]
    assert ranks[0]["calls"] == {"export_artifacts": 1, "push_to_hub": 1}
    assert ranks[1]["calls"] == {"export_artifacts": 0, "push_to_hub": 0}


@needs_dist
@pytest.mark.distributed
@pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="trl is not installed")
@pytest.mark.parametrize("trainer", ["dpo", "grpo"])
def test_trl_trainer_on_two_ranks_matches_one_process(tmp_path, trainer):
    """TRL's DPOTrainer / GRPOTrainer + FastPatchCallback under accelerate's DDP (2 gloo ranks × 2 pairs or
    completions) against one process with the same 4 per step (issue 24's DPO and GRPO runs, on the CPU):
    the fused head answered every policy and reference pass on each rank, both ranks logged and trained
    the same, and the logged metrics and the trained adapter equal one process's. GRPO's completions are
    fixed by their place in the global batch, and its rewards are gathered for the group advantages.
    Not compared: DPO's rewards/accuracies, a count of margins > 0 that flips on rounding where the
    margins are ~0."""
    one = launch(trainer, tmp_path / "one", "4", world_size=1)[0]
    two = launch(trainer, tmp_path / "two", "2")
    beta = 0.5  # DPO's
    for rank in two:
        assert rank["wrapped"] == "DistributedDataParallel" and rank["world"] == 2
        assert rank["calls"]["cross_entropy/fused"] == one["calls"]["cross_entropy/fused"] == 4  # 2 steps × 2 passes
        assert not [k for k in rank["calls"] if k.startswith(("cross_entropy/", "lora_")) and not k.endswith("/fused")]
        assert rank["logs"] == two[0]["logs"] and rank["adapter"] == two[0]["adapter"]
    assert len(one["logs"]) == len(two[0]["logs"]) == 2
    for step, (a, b) in enumerate(zip(two[0]["logs"], one["logs"])):
        assert a.keys() == b.keys() and "loss" in b and len(b) > 10
        # DPO's rewards = β·(logp − ref_logp) are differences of sequence sums: compared at their scale
        logps = max(abs(b["logps/chosen"]), abs(b["logps/rejected"])) if trainer == "dpo" else 0.0
        for k, v in b.items():
            if k == "rewards/accuracies" and trainer == "dpo":
                continue
            scale = max(abs(v), 2 * beta * logps if k.startswith("rewards/") else 0.0)
            assert abs(a[k] - v) <= RTOL * scale + 1e-7, (step, k, a[k], v)
    assert one["adapter"].keys() == two[0]["adapter"].keys() and one["adapter"]
    for name, values in one["adapter"].items():
        assert rel_err(torch.tensor(two[0]["adapter"][name]), torch.tensor(values)) <= RTOL, name


@needs_dist
@pytest.mark.distributed
def test_keep_gathered_choices_see_the_smallest_free_memory_of_any_rank(tmp_path):
    """The FSDP2 and ZeRO-3 keep-gathered choices must be the same on every rank (different choices
    issue different collectives and hang): they compare with the least free GPU memory of all ranks."""
    assert [r["free"] for r in launch("free_memory", tmp_path)] == [1 << 30, 1 << 30]


# --- DeepSpeed ZeRO-3 ------------------------------------------------------------------------------------

@needs_dist
@pytest.mark.distributed
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")
def test_zero3_matches_one_process_and_gathers_for_export(tmp_path):
    """deepspeed.initialize with ZeRO stage 3 (every parameter partitioned, lm_head too) and a torch
    AdamW client optimizer: the head and LoRA stay stock until ``setup_sharded_model`` (FastTrainer's
    train begin) registers lm_head with the causal LM and the projections with their attention / MLP,
    then the fused loss and fused LoRA run on whole weights (LoRA patched before or after
    partitioning; full fine-tuning, also tied, partitioned before patching as zero.Init leaves it);
    loss, gradients and AdamW steps = one process; the export gather gives rank 0 the trained
    weights and partitions them again after. With ``zero3_keep_frozen_gathered`` the frozen weights
    are all-gathered once per step and stay whole through backward (against a run without it)."""
    from helpers.tiny_models import tiny_config

    cases = ("lora", "lora_init", "full_init", "full_tied_init", "lora_frozen_gathered", "lora_per_module")
    ranks = launch("zero3", tmp_path, *cases, timeout=300.0)  # ~45 s alone on 2 cores; 150 s ran out under load
    whole = [VOCAB, tiny_config("llama").hidden_size]
    for i, name in enumerate(cases):
        case = ranks[0]["cases"][i]
        assert case["case"] == name and case["kind"] == "zero3" and case["patched"]["cross_entropy"] == 1
        assert case["partition_numel"] == 0 and case["after_export_numel"] == 0  # partitioned, also after export
        assert case["external_before"] == 0 and case["registered"] == [True, True] and case["external_after"] == 1
        assert case["setup"] == "zero3" and case["lora_owners"] == (4 if name.startswith("lora") else 0)
        # 2 layers x (q, k, v, o: base + A + B = 12; gate, up, down: 9) external parameters, each once
        assert case["lora_external"] == (42 if name.startswith("lora") else 0), case["lora_external"]
        for step, s in enumerate(case["steps"]):
            where = f"{name} step {step}"
            for rank in ranks:  # before registration the stock head; after it the fused loss on the whole weight
                assert rank["cases"][i]["steps"][step]["head_calls"] == ([] if step == 0 else [whole]), where
            # Fused from the first step: inside the engine's forward DeepSpeed already gathers a weight the
            # fused path reads and registers it with the running attention / MLP (its "external parameter
            # discovery"); the explicit registration makes that independent of how the model is called.
            # qkv, o and MLP of 2 layers, forward and checkpoint recompute.
            fused = 12 if name.startswith("lora") else 0
            assert s["fused_lora_calls"] == fused, f"{where}: {s['fused_lora_calls']} fused LoRA calls"
            assert s["missing"] == [] and s["loss_err"] <= RTOL, f"{where}: {s}"
            tol = RTOL if step == 0 else ADAM_RTOL
            assert s["max_grad_err"] <= tol and (s["lm_head_err"] or 0.0) <= tol, f"{where}: {s}"
        assert (case["steps"][0]["lm_head_err"] is not None) is (name == "full_init")  # untied, trainable
        assert case["export_is_engine"] and case["export_shapes_equal"] and case["export_err"] <= ADAM_RTOL, case
    _check_frozen_gathers(ranks, cases)


def _check_frozen_gathers(ranks: list[dict], cases: tuple[str, ...]) -> None:
    """Frozen elements all-gathered per frozen element in each step's forward + backward. Once
    DeepSpeed's trace of the module order is complete again after the setup changed it (from the
    fourth step): exactly once, every frozen parameter still whole after backward, with
    ``zero3_keep_frozen_gathered``; more than once (the attention projections again for the
    checkpoint recompute and backward) and nothing left whole, without it. Same numbers either way."""
    runs = {name: [rank["cases"][cases.index(name)] for rank in ranks]
            for name in ("lora_frozen_gathered", "lora_per_module")}
    for name, per_rank in runs.items():
        for r, case in enumerate(per_rank):
            kept = name == "lora_frozen_gathered"
            n_frozen = case["frozen_persistent"][1]
            assert case["frozen_persistent"] == [n_frozen if kept else 0, n_frozen] and case["marked_again"] == 0, case
            steady = case["steps"][3:]
            assert len(case["steps"]) == 4 and steady, case["steps"]
            for s in steady:
                where = f"rank {r} {name}: {s['frozen_gathers']} gathers, {s['frozen_whole_after_backward']} whole"
                if kept:
                    assert s["frozen_gathers"] == 1.0 and s["frozen_whole_after_backward"] == n_frozen, where
                else:
                    assert s["frozen_gathers"] > 1.1 and s["frozen_whole_after_backward"] == 0, where
    kept, per_module = runs["lora_frozen_gathered"][0], runs["lora_per_module"][0]
    assert [s["loss_err"] for s in kept["steps"]] == [s["loss_err"] for s in per_module["steps"]]
    assert [s["max_grad_err"] for s in kept["steps"]] == [s["max_grad_err"] for s in per_module["steps"]]


# --- DeepSpeed ZeRO-3 (one process; DeepSpeed's parameter attributes stood in for) ----------------------

class _HeadSpy:
    def __init__(self):
        self.calls = 0
        self.original = head_module.fused_linear_cross_entropy

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.original(*args, **kwargs)


def _as_zero3(param, status: str, persist: bool = False):
    param.ds_id, param.ds_status, param.ds_persist = 3, SimpleNamespace(name=status), persist


def test_zero3_lm_head_fused_only_when_gathered_for_the_causal_lm(monkeypatch):
    stock = tiny_model("llama", vocab_size=VOCAB)
    fast = copy.deepcopy(stock)
    patch_model(fast, FastConfig(rms_norm=False, rope=False, mlp=False, lora=False))
    spy = _HeadSpy()
    monkeypatch.setattr(head_module, "fused_linear_cross_entropy", spy)
    batch = make_batch(VOCAB, seed=3)
    weight = fast.lm_head.weight
    stock_loss = stock(**batch).loss
    stock_loss.backward()

    def run():
        fast.zero_grad(set_to_none=True)
        before = spy.calls
        loss = fast(**batch).loss
        loss.backward()
        assert rel_err(loss, stock_loss) <= 1e-6
        assert_grads_close(fast, stock, RTOL)
        return spy.calls - before

    _as_zero3(weight, "NOT_AVAILABLE")
    assert run() == 0  # partitioned: stock path (lm_head's own forward gathers it)
    _as_zero3(weight, "AVAILABLE")
    assert run() == 0  # gathered by someone, but nothing keeps it gathered until backward: stock
    fast.ds_external_parameters = lambda: [(id(weight), weight)]  # what register_external_parameter adds
    assert run() == 1
    del fast.ds_external_parameters
    _as_zero3(weight, "AVAILABLE", persist=True)  # a persistent (small) parameter stays gathered
    assert run() == 1
