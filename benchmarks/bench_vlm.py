"""One LoRA training step of a Qwen2.5-VL-7B shape with images: fasttune vs stock HF+PEFT and Unsloth (H200).

A step = forward (bf16 autocast, as Trainer(bf16=True) runs it), backward and a fused AdamW step on
the adapters. Model: random-init Qwen2.5-VL-7B shape (language tower 28 layers, hidden 3,584,
V = 152,064; vision tower 32 blocks, hidden 1,280, window attention), bf16 on the GPU, built from
its config (no download). LoRA r=16, alpha 16, dropout 0 on the seven projections of every
language layer (the vision tower frozen, as Unsloth's ``finetune_vision_layers=False``). The first
stack's worker saves the random model to ``--ckpt-dir`` (16 GB, reused); every stack then loads it
from there, as a user loads a model (``--in-place-init``: hf and fasttune train the init in place).

Each sample holds ``--images`` images of ``--image-size``² pixels (Qwen2.5-VL: 14-pixel patches
merged 2×2 → (size/28)² image tokens each) and ``--text-tokens`` text tokens, the labels on the
text (image tokens ignored); ``--batch`` samples per step. The script prints this layout, then one
line per stack:

    STACK  tok/s  peak allocated GiB  peak reserved GiB  first loss  [× hf, × unsloth]

(tokens = text + image tokens of the batch; median of ``--steps`` timed steps after ``--warmup``).

Stacks (each in its own process: Unsloth patches transformers globally):
  hf          stock transformers + PEFT, HF checkpointing (non-reentrant) on both towers
  fasttune    ``patch_model(model, FastConfig(checkpointing=--checkpointing))`` ("offload" default)
  fasttune-recompute  the same with checkpointing="recompute"
  unsloth     ``FastVisionModel.from_pretrained(dir)`` + ``get_peft_model(..., finetune_vision_layers=False,
              use_gradient_checkpointing="unsloth")``: loads the saved checkpoint (random weights +
              an in-process processor).
A stack that fails (Unsloth missing, out of memory) prints its error on its line; the others run.

Usage (H200, repo root; Unsloth from the carried wheels, see ../shared/tools/fetch_peer_wheels.sh):
    python3 benchmarks/bench_vlm.py --out $OUT/bench_vlm.json        # all stacks, < 10 minutes
    python3 benchmarks/bench_vlm.py --smoke    # tiny model, CPU (interpreter) or GPU: checks the script
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time

if "--worker" in sys.argv and sys.argv[sys.argv.index("--worker") + 1:][:1] == ["unsloth"]:
    os.environ.setdefault("UNSLOTH_DISABLE_STATISTICS", "1")  # no network on the GPU machine
    try:  # Unsloth must be imported before transformers
        import unsloth  # noqa: F401
    except Exception as err:  # noqa: BLE001 - reported as the stack's row
        UNSLOTH_IMPORT_ERROR = f"{type(err).__name__}: {err}"

import torch  # noqa: E402

from allocator_segments import segment_summary  # noqa: E402 - benchmarks/ is on sys.path as the script dir

if "--smoke" in sys.argv and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before fasttune's kernels are imported

GIB = 1 << 30
STACKS = ("hf", "fasttune", "fasttune-recompute", "unsloth")
TEXT_7B = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
               num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=128000, rms_norm_eps=1e-6,
               rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
               bos_token_id=151643, eos_token_id=151645, use_cache=False)
VISION_7B = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                 patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112, tokens_per_second=2,
                 fullatt_block_indexes=[7, 15, 23, 31])
IDS = dict(image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653)
SMOKE_IDS = dict(image_token_id=1003, video_token_id=1004, vision_start_token_id=1001, vision_end_token_id=1002)
SMOKE_TEXT = dict(TEXT_7B, vocab_size=1031, bos_token_id=1, eos_token_id=2, hidden_size=128, intermediate_size=256,
                  num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2,
                  rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [4, 6, 6]})
SMOKE_VISION = dict(VISION_7B, depth=2, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=128,
                    window_size=56, fullatt_block_indexes=[1])
LANGUAGE_TARGETS = r"^model\.language_model\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)$"


def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def build_config(smoke: bool):
    from transformers import Qwen2_5_VLConfig

    config = Qwen2_5_VLConfig(text_config=SMOKE_TEXT if smoke else TEXT_7B,
                              vision_config=SMOKE_VISION if smoke else VISION_7B, **(SMOKE_IDS if smoke else IDS))
    config.use_cache = False
    return config


def make_batch(config, args) -> dict:
    """``args.batch`` samples of [text half | images | text half], random pixels and ids, image labels ignored."""
    g = torch.Generator().manual_seed(0)
    v = config.vision_config
    start, end, image = config.vision_start_token_id, config.vision_end_token_id, config.image_token_id
    side = args.image_size // v.patch_size  # patches per side
    image_tokens = side * side // v.spatial_merge_size ** 2
    patch_width = 3 * v.temporal_patch_size * v.patch_size ** 2
    rows = []
    for _ in range(args.batch):
        text = torch.randint(3, min(start, 151000), (args.text_tokens,), generator=g)
        block = [start] + [image] * image_tokens + [end]
        half = args.text_tokens // 2
        rows.append(torch.cat([text[:half], torch.tensor(block * args.images), text[half:]]))
    ids = torch.stack(rows)
    labels = ids.clone()
    labels[(ids == image) | (ids == start) | (ids == end)] = -100
    n_images = args.batch * args.images
    batch = dict(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels,
                 mm_token_type_ids=(ids == image).int(),
                 pixel_values=torch.randn(n_images * side * side, patch_width, generator=g).to(torch.bfloat16),
                 image_grid_thw=torch.tensor([[1, side, side]] * n_images))
    return {k: t.to(device()) for k, t in batch.items()}


def layout(config, args) -> str:
    v = config.vision_config
    patches = (args.image_size // v.patch_size) ** 2
    image_tokens = patches // v.spatial_merge_size ** 2
    seq = args.text_tokens + args.images * (image_tokens + 2)
    side = f"{args.image_size}x{args.image_size}"
    return (f"batch {args.batch} x {seq} tokens per sample: {args.images} image(s) of {side} px ({image_tokens} "
            f"image tokens + 2 markers each, {patches} patches in the vision tower) + {args.text_tokens} text "
            f"tokens; {args.batch * seq} tokens per step")


# --- the stacks ----------------------------------------------------------------------------------

def build_model(config):
    from transformers import Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(0)
    dtype = torch.bfloat16 if device() == "cuda" else torch.float32
    with torch.device(device()):
        model = Qwen2_5_VLForConditionalGeneration._from_config(config, dtype=dtype, attn_implementation="sdpa")
    model.requires_grad_(False)
    return model


def save_checkpoint(model, path: str) -> None:
    """The random model and a processor (a word-level tokenizer holding Qwen's special ids), for Unsloth."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast, Qwen2_5_VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    if os.path.exists(os.path.join(path, "config.json")):
        return
    tmp = path + ".partial"
    model.save_pretrained(tmp, max_shard_size="5GB")
    c = model.config
    specials = {"<|vision_start|>": c.vision_start_token_id, "<|vision_end|>": c.vision_end_token_id,
                "<|image_pad|>": c.image_token_id, "<|video_pad|>": c.video_token_id}
    n = min(specials.values())  # Qwen: 151643 ordinary tokens, then <|endoftext|>, <|im_start|>, <|im_end|>
    specials |= {"<|endoftext|>": n - 3, "<|im_start|>": n - 2, "<|im_end|>": n - 1}
    vocab = {f"t{i}": i for i in range(n - 3)} | specials
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="t0")), eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>", unk_token="t0")
    tok.add_special_tokens({"additional_special_tokens": list(specials)})
    try:
        from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

        Qwen2_5_VLProcessor(image_processor=Qwen2VLImageProcessorPil(), tokenizer=tok,
                            video_processor=Qwen2VLVideoProcessor()).save_pretrained(tmp)
    except Exception as err:  # noqa: BLE001 - no torchvision: the tokenizer alone
        print(f"    processor not saved ({type(err).__name__}: {err}); tokenizer only", flush=True)
        tok.save_pretrained(tmp)
    os.replace(tmp, path)


def prepare(stack: str, config, args, log):
    if stack == "unsloth":
        return prepare_unsloth(args)
    from peft import LoraConfig, get_peft_model

    saved = bool(args.ckpt_dir) and os.path.exists(os.path.join(args.ckpt_dir, "config.json"))
    if not (args.from_checkpoint and saved):
        base = build_model(config)
        writer = next((s for s in args.all_stacks if s != "unsloth"), None)  # the first stack to run writes it
        if args.ckpt_dir and (args.from_checkpoint or "unsloth" in args.all_stacks and stack == writer):
            t0 = time.perf_counter()
            save_checkpoint(base, args.ckpt_dir)
            log(f"    checkpoint at {args.ckpt_dir} ({time.perf_counter() - t0:.0f} s)")
    if args.from_checkpoint:  # as a user (and Unsloth) would: from the saved bf16 weights, not a random init
        from transformers import Qwen2_5_VLForConditionalGeneration

        base = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        dtype = torch.bfloat16 if device() == "cuda" else torch.float32
        base = Qwen2_5_VLForConditionalGeneration.from_pretrained(args.ckpt_dir, dtype=dtype, attn_implementation="sdpa",
                                                                  device_map=device())
        base.requires_grad_(False)
    if torch.cuda.is_available():
        log(f"    weights ready: {torch.cuda.memory_allocated() / GIB:.2f} GiB allocated, "
            f"{torch.cuda.memory_reserved() / GIB:.2f} GiB reserved")
        if args.segments:
            log(f"    segments at weights ready: {json.dumps(segment_summary())}")
    model = get_peft_model(base, LoraConfig(r=16, lora_alpha=16, lora_dropout=0.0, bias="none",
                                            target_modules=LANGUAGE_TARGETS))
    if stack == "hf":
        kw = {"use_reentrant": False}
        if hasattr(base, "activation_checkpointing_enable"):  # transformers ≥ 5.2x
            base.activation_checkpointing_enable(activation_checkpointing_kwargs=kw)
        else:
            base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)
    else:
        from fasttune import FastConfig, patch_model

        mode = "recompute" if stack == "fasttune-recompute" else args.checkpointing
        report = patch_model(model, FastConfig(checkpointing=mode))
        log("    " + str(report).replace("\n", "\n    "))
        n = config.text_config.num_hidden_layers
        missing = [op for op in ("lora_qkv", "lora_o", "lora_mlp", "rope", "checkpointing") if report.patched[op] != n]
        if missing:
            raise RuntimeError(f"not on the fast path everywhere ({missing}): {report}")
    return model.train()


def prepare_unsloth(args):
    if "UNSLOTH_IMPORT_ERROR" in globals():
        raise RuntimeError(f"unsloth does not import: {UNSLOTH_IMPORT_ERROR}")
    from unsloth import FastVisionModel

    if not args.ckpt_dir or not os.path.exists(os.path.join(args.ckpt_dir, "config.json")):
        raise RuntimeError(f"no checkpoint at {args.ckpt_dir} (the first other stack's worker writes it)")
    model, _ = FastVisionModel.from_pretrained(args.ckpt_dir, dtype=torch.bfloat16, load_in_4bit=False)
    model = FastVisionModel.get_peft_model(model, finetune_vision_layers=False, finetune_language_layers=True,
                                           finetune_attention_modules=True, finetune_mlp_modules=True, r=16,
                                           lora_alpha=16, lora_dropout=0.0, bias="none", random_state=0,
                                           use_gradient_checkpointing="unsloth")
    FastVisionModel.for_training(model)
    return model


def measure(model, batch: dict, args) -> dict:
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.0, fused=device() == "cuda" or None)

    def step():
        with torch.autocast(device(), dtype=torch.bfloat16, enabled=device() == "cuda"):
            loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    loss0 = float(step())
    for _ in range(args.warmup - 1):
        step()
    sync()
    warmup_peak = torch.cuda.max_memory_allocated() / GIB if torch.cuda.is_available() else None
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    ms = statistics.median(times) * 1e3
    tokens = batch["input_ids"].numel()
    cuda = torch.cuda.is_available()
    return dict(ms=round(ms, 1), tokens_per_s=round(tokens / (ms / 1e3)), loss_step1=round(loss0, 4),
                peak_allocated_gib=round(torch.cuda.max_memory_allocated() / GIB, 2) if cuda else None,
                peak_reserved_gib=round(torch.cuda.max_memory_reserved() / GIB, 2) if cuda else None,
                times_ms=[round(t * 1e3, 1) for t in times],
                warmup_peak_allocated_gib=None if warmup_peak is None else round(warmup_peak, 2),
                **({"segments": segment_summary()} if cuda and args.segments else {}))


def worker(stack: str, args) -> None:
    def log(msg):
        print(msg, flush=True)

    config = build_config(args.smoke)
    try:
        model = prepare(stack, config, args, log)
        row = dict(stack=stack, **measure(model, make_batch(config, args), args))
    except Exception as err:  # noqa: BLE001 - one stack's failure is its row, the others still run
        row = dict(stack=stack, error=f"{type(err).__name__}: {str(err).splitlines()[0][:300] if str(err) else ''}")
    print("ROW " + json.dumps(row), flush=True)


# --- driver --------------------------------------------------------------------------------------

def run_stack(stack: str, args, log) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", stack] + args.passthrough
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.stack_timeout_s)
    except subprocess.TimeoutExpired:
        return dict(stack=stack, error=f"timed out after {args.stack_timeout_s} s")
    rows = [json.loads(line[4:]) for line in proc.stdout.splitlines() if line.startswith("ROW ")]
    for line in proc.stdout.splitlines():
        if not line.startswith("ROW "):
            log(line)
    if rows:
        return rows[-1]
    return dict(stack=stack, error=f"worker exited {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}")


def fmt(row: dict, by: dict) -> str:
    if "error" in row:
        return f"{row['stack']:<20} FAILED: {row['error']}"
    gib = lambda v: "n/a" if v is None else f"{v:.2f}"  # noqa: E731
    vs = [f"x{row['tokens_per_s'] / by[ref]['tokens_per_s']:.2f} {ref}" for ref in ("hf", "unsloth")
          if ref != row["stack"] and "tokens_per_s" in by.get(ref, {})]
    return (f"{row['stack']:<20} {row['tokens_per_s']:>8} tok/s  peak allocated {gib(row['peak_allocated_gib'])} GiB  "
            f"peak reserved {gib(row['peak_reserved_gib'])} GiB  loss {row['loss_step1']}"
            + (f"  ({', '.join(vs)})" if vs else "")
            + f"  [warm-up peak allocated {gib(row.get('warmup_peak_allocated_gib'))} GiB]")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--stacks", default=",".join(STACKS), help="comma-separated subset of " + ", ".join(STACKS))
    p.add_argument("--batch", type=int, default=4, help="samples per step")
    p.add_argument("--images", type=int, default=1, help="images per sample")
    p.add_argument("--image-size", type=int, default=672, help="image side in pixels (a multiple of 28)")
    p.add_argument("--text-tokens", type=int, default=1536, help="text tokens per sample")
    p.add_argument("--steps", type=int, default=5, help="timed steps (median reported)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (compilation, optimizer states)")
    p.add_argument("--checkpointing", default="offload", choices=("offload", "recompute", "auto"),
                   help="the 'fasttune' stack's checkpointing mode")
    p.add_argument("--ckpt-dir", default=None, help="where the hf worker saves the random model for unsloth")
    p.add_argument("--in-place-init", action="store_true",
                   help="hf/fasttune stacks train the random init built in place on the GPU instead of loading the "
                        "saved checkpoint as a user (and Unsloth) would; that build leaves ~6 GiB more reserved")
    p.add_argument("--segments", action="store_true",
                   help="log the allocator's segments (per stream: reserved, in use, free by size) at weights "
                        "ready and after the timed steps")
    p.add_argument("--stack-timeout-s", type=int, default=540, help="seconds per stack's process")
    p.add_argument("--out", help="write the rows as JSON here")
    p.add_argument("--smoke", action="store_true", help="tiny model: checks the script, measures nothing")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.all_stacks = [s for s in args.stacks.split(",") if s]
    bad = sorted(set(args.all_stacks) - set(STACKS))
    if bad:
        p.error(f"unknown stacks {bad}")
    if args.image_size % 28:
        p.error("--image-size must be a multiple of 28 (14-pixel patches merged 2x2)")
    if args.ckpt_dir is None:
        args.ckpt_dir = f"/tmp/fasttune_bench_vlm_{'smoke' if args.smoke else 'qwen25vl7b'}"
    args.from_checkpoint = bool(args.ckpt_dir) and not args.in_place_init  # --ckpt-dir '': nothing to load
    args.passthrough = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--worker"]
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker(args.worker, args)
        return
    if args.smoke:
        args.batch, args.images, args.image_size, args.text_tokens = min(args.batch, 2), 1, 56, 24
        args.passthrough += ["--batch", str(args.batch), "--image-size", "56", "--text-tokens", "24"]
    print("Qwen2.5-VL-7B shape, LoRA r=16 on the language tower, " + layout(build_config(args.smoke), args), flush=True)
    # hf first: it writes the checkpoint unsloth loads.
    order = sorted(args.all_stacks, key=lambda s: (s != "hf", s == "unsloth"))
    rows = {}
    for stack in order:
        rows[stack] = run_stack(stack, args, print)
    for stack in order:
        print(fmt(rows[stack], rows), flush=True)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(dict(layout=layout(build_config(args.smoke), args), rows=list(rows.values()), args=vars(args)),
                      f, indent=1, default=str)


if __name__ == "__main__":
    main()
