"""Multi-process (gloo, CPU) checks of fasttune under DDP, FSDP2 and ZeRO-3: the per-rank script and its launcher.

``launch(scenario, out_dir)`` starts ``world_size`` processes of this file with the environment
torchrun would give them (RANK, WORLD_SIZE, MASTER_ADDR/PORT, LOCAL_RANK) and returns what each
rank wrote to ``out_dir/rank{r}.json``; a failing rank fails the call with the tail of every log.
The scenarios compute numbers (relative errors, dtypes, call counts); the tests assert on them.

Every scenario compares against one process holding the whole global batch (rank 0 computes it),
with the loss normalised as transformers does across devices: each rank's loss is its token sum
over the global token count, times the world size, and DDP/FSDP average the gradients.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from helpers.dist_trl import scenario_dpo, scenario_grpo  # noqa: F401 - scenarios, dispatched by name in main()

ROOT = Path(__file__).resolve().parents[3]
VOCAB = 1001  # odd: lm_head rows split unevenly over 2 ranks


# --- launcher (runs in the test process) ------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(scenario: str, out_dir: Path, *args: str, world_size: int = 2, timeout: float = 150.0) -> list[dict]:
    """Run ``scenario`` (with string ``args``) on ``world_size`` gloo ranks; the per-rank results, rank order."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(world_size),
               LOCAL_WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests" / "_lib"), os.environ.get("PYTHONPATH", "")]))
    procs, logs = [], []
    for rank in range(world_size):
        log = open(out_dir / f"rank{rank}.log", "w")
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, __file__, scenario, str(out_dir), *args], cwd=out_dir,
                                      stdout=log, stderr=subprocess.STDOUT,
                                      env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank))))
    deadline = time.monotonic() + timeout
    timed_out = False
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
    codes = [p.returncode for p in procs]
    if any(codes):
        tails = "\n".join(f"--- rank {r} (exit {c}) ---\n" + (out_dir / f"rank{r}.log").read_text()[-4000:]
                          for r, c in enumerate(codes))
        why = f" (killed at the {timeout:.0f} s deadline)" if timed_out else ""
        raise AssertionError(f"{scenario}: ranks exited with {codes}{why}\n{tails}")
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world_size)]


# --- per-rank helpers ---------------------------------------------------------------------------------

def _setup():
    """The test suite's environment (Triton interpreter, bf16 dot fix) before fasttune is imported."""
    spec = importlib.util.spec_from_file_location("_fasttune_conftest", ROOT / "tests" / "conftest.py")
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
    import torch.distributed as dist

    dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()


def _global_batches(n_steps: int, world: int, rows_per_rank: int = 2, seq: int = 11):
    from helpers.tiny_models import make_batch

    return [make_batch(VOCAB, batch=world * rows_per_rank, seq=seq, seed=100 + s) for s in range(n_steps)]


def _shard(batch: dict, rank: int, world: int) -> dict:
    rows = batch["input_ids"].shape[0] // world
    return {k: v[rank * rows:(rank + 1) * rows] for k, v in batch.items()}


def _n_items(batch: dict):
    import torch

    return torch.tensor(int((batch["labels"][:, 1:] != -100).sum()))


def _model(lora: bool, tied: bool = False, seed: int = 0):
    """The tiny llama (vocab 1001), LoRA r=4 on every linear (lm_head frozen) or all weights trainable."""
    import torch
    from helpers.tiny_models import tiny_model

    model = tiny_model("llama", vocab_size=VOCAB, tie_word_embeddings=tied, seed=seed)
    if not lora:
        return model
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed + 1)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                                            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                            "up_proj", "down_proj"]))


def _qlora_checkpoint(seed: int = 0) -> str:
    """The tiny llama (widths multiples of 64, as bitsandbytes' CPU path wants) saved by rank 0 (the
    only rank transformers writes from) into the run's folder; every rank returns its path."""
    import torch.distributed as dist
    from helpers.tiny_models import tiny_model

    path = str(Path.cwd() / "qlora-checkpoint")
    if dist.get_rank() == 0:
        tiny_model("llama", vocab_size=VOCAB, seed=seed, hidden_size=128, head_dim=32,
                   intermediate_size=256).save_pretrained(path)
    dist.barrier()
    return path


def _qlora_model(path: str, storage, seed: int = 0):
    """``path`` loaded as QLoRA people shard it: NF4 with double quantisation and the codes stored in
    a float dtype (``bnb_4bit_quant_storage=storage``: FSDP2 shards them as a float tensor), fp32
    compute; LoRA r=4 on every projection."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=torch.float32, bnb_4bit_quant_storage=storage)
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=quant, dtype=torch.float32,
                                                 attn_implementation="eager", device_map="cpu")
    torch.manual_seed(seed + 1)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                             "up_proj", "down_proj"]))
    return model.train()  # from_pretrained leaves eval mode; the Trainer trains in train mode


def _patched(model, checkpointing="offload", base_dtype="auto"):
    from fasttune import FastConfig, patch_model

    report = patch_model(model, FastConfig(checkpointing=checkpointing, base_dtype=base_dtype))
    return model, dict(report.patched)


def _fp8_calls(model) -> dict:
    """FP8 base products counted on this rank, by outcome (on a CPU: the reference, with its reason),
    and the dtypes of the base weights (uint8 codes wherever they were converted)."""
    from fasttune.model_patches.patch import patch_report

    calls = {}
    for (op, outcome), n in patch_report(model).calls.items():
        if op.startswith("fp8_"):
            calls[outcome] = calls.get(outcome, 0) + n
    return calls


def _rel(a, b) -> float:
    from helpers.compare import rel_err

    return rel_err(a, b)


def _local(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _sgd(model, lr: float = 0.05):
    import torch

    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p.add_(p.grad, alpha=-lr)
                p.grad = None


class _Spy:
    """Records (input dtype, weight dtype, weight type) of each call of a module-level function."""

    def __init__(self, module, name):
        self.module, self.name, self.calls = module, name, []
        self.original = getattr(module, name)
        setattr(module, name, self)

    def __call__(self, x, w, *args, **kwargs):
        self.calls.append((str(x.dtype), str(w.dtype), type(w.data).__name__))
        return self.original(x, w, *args, **kwargs)

    def take(self):
        calls, self.calls = self.calls, []
        return calls


# --- DDP -------------------------------------------------------------------------------------------

def scenario_ddp(rank: int, world: int, base_dtype: str = "auto") -> dict:
    """LoRA + "offload" checkpointing under DistributedDataParallel, find_unused_parameters False
    then True, two SGD steps each: the all-reduced gradients against one process on the global batch.
    ``base_dtype="fp8"``: the bases in FP8 on every rank (DDP broadcasts the uint8 codes), and in
    the single process."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model, patched = _patched(_model(lora=True), base_dtype=base_dtype)
    ref, _ = _patched(_model(lora=True), base_dtype=base_dtype) if rank == 0 else (None, None)
    out = {"patched": patched, "rounds": []}
    batches = _global_batches(4, world)
    for i, find_unused in enumerate((False, True)):
        ddp = DDP(model, find_unused_parameters=find_unused)
        for step in range(2):
            batch = batches[2 * i + step]
            n = _n_items(batch)
            loss = ddp(**_shard(batch, rank, world), num_items_in_batch=n).loss * world
            loss.backward()
            record = {"find_unused": find_unused, "step": step}
            summed = loss.detach() / world
            import torch.distributed as dist

            dist.all_reduce(summed)
            if rank == 0:
                ref_loss = ref(**batch, num_items_in_batch=n).loss
                ref_loss.backward()
                grads = dict(ref.named_parameters())
                errs = {name: _rel(p.grad, grads[name].grad) for name, p in model.named_parameters()
                        if p.requires_grad}
                record.update(loss_err=_rel(summed, ref_loss), max_grad_err=max(errs.values()),
                              n_grads=len(errs), n_missing=sum(p.grad is None for p in model.parameters()
                                                               if p.requires_grad))
                _sgd(ref)
            _sgd(model)
            out["rounds"].append(record)
    out["fp8_calls"] = _fp8_calls(model)
    out["base_dtypes"] = sorted({str(m.get_base_layer().weight.dtype) for n, m in model.named_modules()
                                 if n.endswith("_proj") and hasattr(m, "base_layer")})
    return out


# --- FSDP2 and DTensor lm_head -----------------------------------------------------------------------

def _cpu_mesh():
    """A 1-D mesh over the ranks on the CPU (also on a GPU machine, where the default would be CUDA)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp_shard",))


def _accelerate_fsdp2(model, rank: int, mixed_precision: str = "no"):
    """Shard ``model`` with accelerate's own FSDP2 preparation (accelerate's FSDP refuses CPU, so its
    Accelerator is stood in for by the few attributes ``fsdp2_prepare_model`` reads)."""
    from types import SimpleNamespace

    import torch
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                            transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
                                            reshard_after_forward=True)
    if mixed_precision != "no":
        plugin.set_mixed_precision(mixed_precision)
    accelerator = SimpleNamespace(state=SimpleNamespace(fsdp_plugin=plugin), mixed_precision=mixed_precision,
                                  is_main_process=rank == 0, device=torch.device("cpu"), torch_device_mesh=_cpu_mesh(),
                                  parallelism_config=SimpleNamespace(fsdp_dim_names=("dp_shard",)))
    return fsdp2_prepare_model(accelerator, model)


def _layers_and_root(model):
    """fully_shard each decoder layer and the root: lm_head stays in the root's unit."""
    from torch.distributed.fsdp import fully_shard

    mesh = _cpu_mesh()
    for module in model.modules():
        if type(module).__name__ == "LlamaDecoderLayer":
            fully_shard(module, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _dtensor_lm_head(model):
    """Only lm_head's weight sharded (a DTensor on a CPU mesh, no FSDP unit): the full_tensor path."""
    from torch import nn
    from torch.distributed.tensor import Shard, distribute_tensor

    head = model.get_output_embeddings()
    head.weight = nn.Parameter(distribute_tensor(head.weight.detach(), _cpu_mesh(), [Shard(0)]))
    return model


def _fsdp_case(name: str, rank: int, world: int, batches, spies) -> dict:
    import torch
    import torch.distributed as dist
    from fasttune.hf_integration.distributed import gathered_weights, sharding_kind

    lora, tied, layout, mp = {
        "lora": (True, False, "accelerate", "no"),
        "full": (False, False, "accelerate", "no"),
        "full_tied": (False, True, "accelerate", "no"),
        "full_root": (False, False, "root", "no"),
        "dtensor_head": (False, False, "dtensor", "no"),
        "bf16": (False, False, "accelerate", "bf16"),
        "lora_gathered": (True, False, "accelerate", "no"),
        "lora_fp8": (True, False, "accelerate", "no"),
        "qlora": (True, False, "accelerate", "no"),
        "qlora_bf16_storage": (True, False, "accelerate", "no"),
    }[name]
    # "lora_gathered" checkpoints with "auto": the gathered layers' memory is reserved from its budget.
    # "lora_fp8": FP8 bases (uint8 codes sharded by rows, scales whole on every rank), "auto" checkpointing.
    base_dtype = "fp8" if name == "lora_fp8" else "auto"
    path = _qlora_checkpoint() if name.startswith("qlora") else None
    storage = torch.bfloat16 if name == "qlora_bf16_storage" else torch.float32
    build = (lambda: _qlora_model(path, storage)) if path else (lambda: _model(lora=lora, tied=tied))
    import fasttune.kernels.lora as lora_kernels

    dequant = _Counter(lora_kernels, "dequantize_nf4") if path else None  # the fused NF4 path's dequantiser
    model, patched = _patched(build(), "auto" if name in ("lora_gathered", "lora_fp8") else "offload", base_dtype)
    ref, _ = _patched(build(), base_dtype=base_dtype) if rank == 0 else (None, None)
    if layout == "accelerate":
        model = _accelerate_fsdp2(model, rank, mp)
    elif layout == "root":
        model = _layers_and_root(model)
    else:
        model = _dtensor_lm_head(model)
    out = {"case": name, "patched": patched, "kind": sharding_kind(model), "steps": []}
    if path:  # one projection's NF4 codes: this rank's shard and the whole tensor, in elements of the storage
        codes = model.get_submodule("base_model.model.model.layers.0.self_attn.q_proj").base_layer.weight
        out["codes"] = [str(codes.dtype), codes.to_local().numel(), codes.numel()]
    if name == "lora_gathered":  # what FastTrainer does at train begin, with the setting forced (no CUDA here)
        from fasttune import FastConfig
        from fasttune.hf_integration.distributed import DistributedHeadCallback, keep_adapter_layers_gathered

        out["kept_gathered_auto"] = keep_adapter_layers_gathered(model, FastConfig())  # None: never without CUDA
        DistributedHeadCallback(FastConfig(fsdp_reshard_after_forward=False)).on_train_begin(None, None, None,
                                                                                             model=model)
        out["kept_gathered"] = sum(  # units whose weights stay gathered after forward
            all(g.post_forward_mesh_info is None for g in m._get_fsdp_state()._fsdp_param_groups)
            for m in model.modules() if type(m).__name__.endswith("DecoderLayer"))
        from fasttune.model_patches.checkpointing import layer_checkpointing

        layers = [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]
        whole = sum(p.numel() * p.element_size() for m in layers for p in m.parameters())  # DTensor: global size
        local = sum(p.to_local().numel() * p.element_size() for m in layers for p in m.parameters())
        out["reserved_bytes"] = [layer_checkpointing(model).policy.reserved_bytes, whole - local]
    for step, batch in enumerate(batches):
        n = _n_items(batch)
        for s in spies.values():
            s.take()
        dequant_before = dequant.calls if dequant else 0
        loss = model(**_shard(batch, rank, world), num_items_in_batch=n).loss * world
        # Between forward and backward: decoder-layer weights still gathered (plain tensors) or resharded (DTensor).
        out.setdefault("layer_param_types_after_forward", sorted({
            type(p).__name__ for m in model.modules() if type(m).__name__.endswith("DecoderLayer")
            for p in m.parameters(recurse=True) if not p.requires_grad}))
        loss.backward()
        if layout == "dtensor":  # the rest of the model is not distributed there: average its gradients as DDP would
            for p in model.parameters():
                if p.grad is not None and type(p.grad) is torch.Tensor:
                    dist.all_reduce(p.grad)
                    p.grad /= world
        record = {"head_calls": spies["head"].take(), "norm_calls": sorted(set(map(tuple, spies["norm"].take()))),
                  "nf4_dequantized": dequant.calls - dequant_before if dequant else 0}
        summed = loss.detach().float() / world
        dist.all_reduce(summed)
        grads = {k: _local(p.grad) for k, p in model.named_parameters() if p.grad is not None}  # collective
        if rank == 0:
            ref_loss = ref(**batch, num_items_in_batch=n).loss
            ref_loss.backward()
            ref_params = dict(ref.named_parameters())
            expected = {k for k, p in ref_params.items() if p.requires_grad}
            errs = {k: _rel(g, ref_params[k].grad) for k, g in grads.items()}
            record.update(loss_err=_rel(summed, ref_loss), max_grad_err=max(errs.values()),
                          missing=sorted(expected - set(grads)), lm_head_err=errs.get(
                              next((k for k in errs if k.endswith("lm_head.weight")), ""), None))
            _sgd(ref)
        _sgd(model)
        out["steps"].append(record)
    if layout == "accelerate":
        # Export: whole weights on rank 0 (equal to the reference after the same steps), shards back after.
        with gathered_weights(model, is_main=rank == 0) as m:
            if rank == 0:
                mine = {k: p for k, p in m.named_parameters()}
                ref_params = dict(ref.named_parameters())
                out["export_types"] = sorted({type(p.data).__name__ for p in mine.values()})
                codes = {k for k in mine if k.endswith("base_layer.weight")} if path else set()
                out["export_err"] = max(_rel(p, ref_params[k]) for k, p in mine.items() if k not in codes)
                if codes:  # NF4 codes stored as float32: compared as bytes (some patterns read as NaN)
                    out["export_codes_equal"] = [len(codes), all(torch.equal(
                        mine[k].detach().reshape(-1).view(torch.uint8), ref_params[k].detach().reshape(-1).view(
                            torch.uint8)) for k in codes)]
                out["export_tied"] = m.get_output_embeddings().weight is m.get_input_embeddings().weight
        out["after_export_types"] = sorted({type(p).__name__ for p in model.parameters()})
    if path:
        from fasttune.model_patches.patch import patch_report

        out["calls"] = {f"{op}/{why}": n for (op, why), n in patch_report(model).calls.items()}
    if base_dtype == "fp8":
        out["fp8_calls"] = _fp8_calls(model)
        out["sharded_base_dtypes"] = sorted({f"{type(m.get_base_layer().weight).__name__} "
                                             f"{m.get_base_layer().weight.dtype}" for n, m in model.named_modules()
                                             if n.endswith("_proj") and hasattr(m, "base_layer")})
    return out


def scenario_fsdp2(rank: int, world: int, *cases: str) -> dict:
    """fully_shard on CPU, ``cases`` among: accelerate's layout (lm_head its own unit, or with the
    embeddings when tied) with LoRA ("lora"), full fine-tuning ("full", "full_tied") and a bf16
    mixed-precision policy ("bf16"); lm_head in the root's unit ("full_root"); only lm_head's
    weight a DTensor ("dtensor_head")."""
    import fasttune.kernels.rms_norm as rms_norm_module
    import fasttune.model_patches.head as head_module

    spies = {"head": _Spy(head_module, "fused_linear_cross_entropy"), "norm": _Spy(rms_norm_module, "rms_norm")}
    batches = _global_batches(2, world)
    return {"cases": [_fsdp_case(name, rank, world, batches, spies)
                      for name in cases]}


# --- DeepSpeed ZeRO-3 (its CPU accelerator over gloo) ---------------------------------------------------

# Stage 3 with no persistence threshold (the tiny lm_head is partitioned too), no gradient
# clipping (DeepSpeed's default clips at 1.0; the single process does not), fp32.
ZERO3_CONFIG = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10 ** 9,
                "gradient_clipping": 0.0, "zero_allow_untested_optimizer": True,
                "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
ZERO3_GATHER_STEPS = 4


class _ShapeSpy(_Spy):
    """Records the weight's shape on each call (whole, or the empty partition ZeRO-3 leaves)."""

    def __call__(self, x, w, *args, **kwargs):
        self.calls.append(list(w.shape))
        return self.original(x, w, *args, **kwargs)


class _Counter:
    """Counts the calls of a module-level function."""

    def __init__(self, module, name):
        self.original, self.calls = getattr(module, name), 0
        setattr(module, name, self)

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.original(*args, **kwargs)


def _adamw(model):
    import torch

    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.0)


def _count_frozen_gathers(module) -> dict:
    """Elements of frozen parameters that DeepSpeed all-gathers, counted from now on (its coordinator
    gathers through each parameter's ``all_gather_coalesced``)."""
    counts = {"frozen": 0}
    for p in module.parameters():
        def counted(params, *args, _gather=p.all_gather_coalesced, **kwargs):
            counts["frozen"] += sum(q.ds_numel for q in params if not q.requires_grad)
            return _gather(params, *args, **kwargs)

        p.all_gather_coalesced = counted
    return counts


def _zero3_case(name: str, rank: int, world: int, batches, spy, lora_calls) -> dict:
    """"lora": patched, then partitioned by ``deepspeed.initialize``. "lora_init", "full_init",
    "full_tied_init": partitioned before patching (as transformers' ``zero.Init`` load leaves a
    model). "lora_frozen_gathered": "lora" with ``zero3_keep_frozen_gathered=True``, and
    "lora_per_module" the same without it, both with DeepSpeed's reuse distance 0 (as in a model
    larger than it: a parameter is released after each use) over more steps (DeepSpeed's trace of
    the module order is recorded again after the setup changed it: it is complete from the fourth
    step). AdamW steps through the engine, the first before ``setup_sharded_model`` (what FastTrainer
    runs at train begin: lm_head and the fused LoRA projections registered), then the export gather."""
    import deepspeed
    import torch
    from deepspeed.utils import safe_get_full_grad
    from fasttune import FastConfig
    from fasttune.hf_integration.distributed import (gathered_weights, keep_frozen_gathered_zero3,
                                                     register_zero3_fused_lora, register_zero3_lm_head,
                                                     setup_sharded_model, sharding_kind)

    lora, tied, partition_first = name.startswith("lora"), "tied" in name, name.endswith("_init")
    config = FastConfig(zero3_keep_frozen_gathered=name.endswith("_gathered"))
    model = _model(lora=lora, tied=tied)
    if partition_first:
        deepspeed.zero.Init(module=model, config_dict_or_path=ZERO3_CONFIG)
    model, patched = _patched(model)
    ref, _ = _patched(_model(lora=lora, tied=tied)) if rank == 0 else (None, None)
    ref_opt = _adamw(ref) if rank == 0 else None
    ds_config = ZERO3_CONFIG
    if name in ("lora_frozen_gathered", "lora_per_module"):
        ds_config = {**ZERO3_CONFIG, "zero_optimization": {**ZERO3_CONFIG["zero_optimization"],
                                                           "stage3_max_reuse_distance": 0}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=_adamw(model), config=ds_config)
    module = engine.module
    head, causal_lm = module.get_output_embeddings(), module.get_base_model() if lora else module
    out = {"case": name, "patched": patched, "kind": sharding_kind(module), "steps": [],
           "partition_numel": head.weight.numel()}
    frozen = list({id(p): p for p in module.parameters() if not p.requires_grad}.values())
    frozen_numel = sum(p.ds_numel for p in frozen)
    gathers = _count_frozen_gathers(module)
    for step, batch in enumerate(batches):
        if step == 1:
            out["external_before"] = sum(p is head.weight for _, p in causal_lm.ds_external_parameters())
            out["setup"] = setup_sharded_model(engine, config)
            out["frozen_persistent"] = [sum(p.ds_persist for p in frozen), len(frozen)]
            out["marked_again"] = keep_frozen_gathered_zero3(engine, config)
            out["registered"] = [register_zero3_lm_head(engine), register_zero3_lm_head(module)]  # idempotent
            out["external_after"] = sum(p is head.weight for _, p in causal_lm.ds_external_parameters())
            out["lora_owners"] = register_zero3_fused_lora(engine)  # again: nothing registered twice
            out["lora_external"] = sum(len(list(m.ds_external_parameters())) for m in module.modules()
                                       if m is not causal_lm and hasattr(m, "ds_external_parameters"))
        n = _n_items(batch)
        spy.take()
        before, gathers["frozen"] = sum(c.calls for c in lora_calls), 0
        loss = engine(**_shard(batch, rank, world), num_items_in_batch=n).loss * world
        engine.backward(loss)
        record = {"head_calls": spy.take(), "fused_lora_calls": sum(c.calls for c in lora_calls) - before,
                  # frozen elements all-gathered in forward + backward, per frozen element; and how many
                  # frozen parameters are still whole after backward
                  "frozen_gathers": gathers["frozen"] / frozen_numel if frozen_numel else None,
                  "frozen_whole_after_backward": sum(p.ds_status.name == "AVAILABLE" for p in frozen)}
        summed = loss.detach() / world
        torch.distributed.all_reduce(summed)
        grads = {k: safe_get_full_grad(p) for k, p in module.named_parameters() if p.requires_grad}  # collective
        if rank == 0:
            ref_loss = ref(**batch, num_items_in_batch=n).loss
            ref_loss.backward()
            ref_params = dict(ref.named_parameters())
            errs = {k: _rel(g, ref_params[k].grad) for k, g in grads.items() if g is not None}
            record.update(loss_err=_rel(summed, ref_loss), max_grad_err=max(errs.values()),
                          missing=sorted(k for k, g in grads.items() if g is None),
                          lm_head_err=next((e for k, e in errs.items() if k.endswith("lm_head.weight")), None))
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
        engine.step()
        out["steps"].append(record)
    with gathered_weights(engine, is_main=rank == 0) as m:  # every rank gathers; the main one compares
        if rank == 0:
            ref_params = dict(ref.named_parameters())
            out["export_shapes_equal"] = all(p.shape == ref_params[k].shape for k, p in module.named_parameters())
            out["export_err"] = max(_rel(p, ref_params[k]) for k, p in module.named_parameters())
        out["export_is_engine"] = m is engine
    out["after_export_numel"] = head.weight.numel()
    return out


def scenario_zero3(rank: int, world: int, *cases: str) -> dict:
    """DeepSpeed ZeRO-3 on the CPU, ``cases`` among "lora", "full_init", "full_tied_init" (see
    ``_zero3_case``): loss, gradients and AdamW steps against one process on the global batch."""
    os.environ["DS_ACCELERATOR"] = "cpu"
    # DeepSpeed's CPU backend JIT-compiles a shared-memory all-reduce (~25 s of g++ on first use);
    # without it every collective goes through gloo. (The attribute ``deepspeed.comm.torch`` is
    # torch itself: the submodule is taken from sys.modules.)
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    import fasttune.model_patches.head as head_module
    import fasttune.model_patches.lora as lora_module

    spy = _ShapeSpy(head_module, "fused_linear_cross_entropy")
    lora_calls = [_Counter(lora_module, f) for f in ("lora_qkv", "lora_linear", "lora_mlp")]
    return {"cases": [_zero3_case(name, rank, world, _global_batches(ZERO3_GATHER_STEPS if name in (
        "lora_frozen_gathered", "lora_per_module") else 2, world), spy, lora_calls) for name in cases]}


# --- the keep-gathered choices: one answer on every rank -------------------------------------------------

def scenario_free_memory(rank: int, world: int) -> dict:
    """``smallest_free_gpu_memory`` when each rank's GPU reports a different free size (rank r: r + 1 GiB,
    torch's query stood in for): every rank gets the smallest."""
    import torch
    from fasttune.hf_integration.distributed import smallest_free_gpu_memory

    torch.cuda.mem_get_info = lambda device=None: ((rank + 1) << 30, 80 << 30)
    return {"free": smallest_free_gpu_memory(torch.device("cpu"))}


# --- FastTrainer under DDP: export and push on rank 0 only ----------------------------------------------

def scenario_trainer(rank: int, world: int) -> dict:
    """FastTrainer on 2 CPU ranks (accelerate's DDP, gloo), LoRA + checkpointing: what DDP was given,
    and which rank exported or pushed."""
    from transformers import TrainingArguments

    import fasttune.hf_integration.train_end as hub
    from fasttune import FastConfig, FastTrainer
    from fasttune.embedded import PadCollator
    from helpers.train_data import random_lm_rows

    calls = {"export_artifacts": 0, "push_to_hub": 0}
    real_export = hub.export_artifacts

    def export_spy(*args, **kwargs):
        calls["export_artifacts"] += 1
        return real_export(*args, **kwargs)

    def push_spy(*args, **kwargs):
        calls["push_to_hub"] += 1
        return {}

    hub.export_artifacts, hub.push_to_hub = export_spy, push_spy
    out = {}
    push = FastConfig(push_to_hub=True, hub_model_id="someone/tiny", push_artifacts=("adapter",))
    for name, fast in (("export", FastConfig(export_artifacts=("adapter",))), ("push", push)):
        args = TrainingArguments(output_dir=str(Path.cwd() / name), max_steps=2, per_device_train_batch_size=2,
                                 learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
                                 seed=0, dataloader_num_workers=0, disable_tqdm=True, gradient_checkpointing=True)
        trainer = FastTrainer(model=_model(lora=True), args=args, train_dataset=random_lm_rows(VOCAB, n=16),
                              data_collator=PadCollator(0), fast_config=fast)
        trainer.train()
        out[name] = {"wrapped": type(trainer.model_wrapped).__name__,
                     "find_unused": getattr(trainer.model_wrapped, "find_unused_parameters", None),
                     "checkpointing": trainer.fast_config.checkpointing,
                     "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
                     "adapter_files": sorted(p.name for p in (Path(args.output_dir) / "adapter").glob("*"))
                     if rank == 0 else None}
    out["calls"] = calls
    return out


def main() -> None:
    scenario, out_dir, args = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
    rank, world = _setup()
    result = globals()[f"scenario_{scenario}"](rank, world, *args)
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result, indent=1, default=str))
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()
    # Every rank's result is written and every rank reached the barrier: leave without the interpreter's
    # teardown, where torch's C++ threads once aborted a rank (exit -6, "terminate called without an active
    # exception", fsdp2 scenario, 2026-12-05) after a scenario that had passed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
