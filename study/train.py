"""Train a small byte-level hybrid model for the accuracy study.

The models are transformers' own `NemotronHForCausalLM` (Mamba-2 + attention + MLP) and
`Qwen3_5ForCausalLM` (Gated DeltaNet + gated attention), run through their plain-PyTorch paths,
with the real state head sizes (Mamba-2 head_dim 64, dstate 128; GDN head_k_dim = head_v_dim
= 128) and a few layers in each family's hybrid pattern. The vocabulary is the 256 byte values;
no special ids are used (the corpus is plain text).

Data: the standard library's `.py` files (study/corpus.py fixes the split). A step samples
`batch` random windows of `seq_len` bytes from the training files' concatenation. The learning
rate warms up over the first steps, then follows a cosine over the time budget, so a run ends
after --time-budget-s seconds of training whatever the machine's speed (the number of steps is
recorded in the curve). Weights are trained in fp32 (bf16 autocast on CUDA) and saved in bf16 so
that each model.safetensors stays under 15 MB.

Output directory: config.json + model.safetensors (save_pretrained), heldout.txt (the held-out
files, one relative path a line), curve.json (train loss every --log-every steps, held-out
nats/byte every --eval-every steps and at the end, sizes, timings).

    python study/train.py --family nemotron_h --out runs/nemotron_h --time-budget-s 150
    python study/train.py --family qwen3_5 --out runs/qwen3_5 --smoke   # seconds on a CPU
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import corpus  # noqa: E402

FAMILIES = ("nemotron_h", "qwen3_5")
VOCAB = 256
MAX_WEIGHTS_BYTES = 15 * 10**6
MIN_LR_FRACTION = 0.1


def model_config(family: str, smoke: bool):
    """The transformers config of a family's study model (`smoke`: a tiny one for CPU checks).

    Sizes give about 6-7 M parameters (13-14 MB in bf16); the state head sizes are the real
    models' in both the full and the smoke size.
    """
    if family == "nemotron_h":
        from transformers import NemotronHConfig

        hidden = 64 if smoke else 320
        return NemotronHConfig(
            vocab_size=VOCAB,
            hidden_size=hidden,
            # Nemotron-H's pattern: Mamba-2 and MLP blocks alternating, an attention block
            # among them (M = Mamba-2, - = MLP, * = attention).
            layers_block_type=NemotronHConfig._pattern_to_list("M-*-" if smoke else "M-M-M*-M-"),
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=128,
            intermediate_size=4 * hidden,
            mamba_num_heads=2 if smoke else 10,
            mamba_head_dim=64,
            ssm_state_size=128,
            n_groups=2,
            conv_kernel=4,
            chunk_size=64,
            use_mamba_kernels=False,
            max_position_embeddings=65536,
            pad_token_id=None,
            bos_token_id=None,
            eos_token_id=None,
            tie_word_embeddings=False,
        )
    if family == "qwen3_5":
        from transformers import Qwen3_5TextConfig

        hidden = 64 if smoke else 320
        return Qwen3_5TextConfig(
            vocab_size=VOCAB,
            hidden_size=hidden,
            intermediate_size=4 * hidden if smoke else 1024,
            # Qwen3.5's pattern: three Gated DeltaNet layers, then one full-attention layer.
            num_hidden_layers=4,
            layer_types=["linear_attention"] * 3 + ["full_attention"],
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=128,
            linear_conv_kernel_dim=4,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            linear_num_key_heads=1 if smoke else 2,
            linear_num_value_heads=2 if smoke else 4,
            max_position_embeddings=65536,
            pad_token_id=None,
            bos_token_id=None,
            eos_token_id=None,
            tie_word_embeddings=False,
        )
    raise ValueError(f"unknown family {family!r}; supported: {', '.join(FAMILIES)}")


def build_model(family: str, smoke: bool, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = model_config(family, smoke)
    if family == "nemotron_h":
        from transformers import NemotronHForCausalLM

        return NemotronHForCausalLM(config)
    from transformers import Qwen3_5ForCausalLM

    return Qwen3_5ForCausalLM(config)


def eval_windows(data: torch.Tensor, seq_len: int, count: int) -> torch.Tensor:
    """`count` evenly spaced windows of seq_len bytes over `data` (fixed, so evaluations compare)."""
    if data.numel() < seq_len:
        raise ValueError(f"held-out text has {data.numel()} bytes, fewer than one window of {seq_len}")
    count = min(count, data.numel() // seq_len)
    starts = torch.linspace(0, data.numel() - seq_len, count).long()
    return torch.stack([data[s:s + seq_len] for s in starts.tolist()])


def mean_nats_per_byte(model, windows: torch.Tensor, batch: int, device: torch.device) -> float:
    """Mean next-byte cross-entropy (nats) over every predicted position of the windows."""
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad(), autocast(device):
        for i in range(0, windows.shape[0], batch):
            ids = windows[i:i + batch].to(device).long()
            logits = model(input_ids=ids).logits.float()
            loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1), reduction="sum")
            total += loss.item()
            count += ids[:, 1:].numel()
    model.train()
    return total / count


def autocast(device: torch.device):
    # bf16 autocast on CUDA only: the CPU smoke runs stay fp32.
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")


def learning_rate(step: int, elapsed: float, args) -> float:
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    progress = min(1.0, elapsed / args.time_budget_s)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return args.lr * (MIN_LR_FRACTION + (1.0 - MIN_LR_FRACTION) * cosine)


def train(args) -> dict:
    """Run one training as `args` says; writes the output directory and returns the curve."""
    device = torch.device(args.device)
    out = Path(args.out)
    root = corpus.resolve_root(args.corpus_root)
    train_files, heldout_files = corpus.split(corpus.list_sources(root))
    if not train_files or not heldout_files:
        raise ValueError(f"corpus under {root}: {len(train_files)} train and "
                         f"{len(heldout_files)} held-out files; need both")
    train_data = torch.frombuffer(bytearray(corpus.read_concatenated(root, train_files)),
                                  dtype=torch.uint8)
    heldout_data = torch.frombuffer(bytearray(corpus.read_concatenated(root, heldout_files)),
                                    dtype=torch.uint8)
    if train_data.numel() <= args.seq_len:
        raise ValueError(f"training text has {train_data.numel()} bytes, need more than "
                         f"--seq-len {args.seq_len}")
    windows = eval_windows(heldout_data, args.seq_len, args.eval_windows)
    train_gpu = train_data.to(device)

    model = build_model(args.family, args.smoke, args.seed).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), fused=device.type == "cuda")
    sampler = torch.Generator(device="cpu").manual_seed(args.seed)
    offsets = torch.arange(args.seq_len, device=device)

    curve = {"family": args.family, "params": n_params, "seed": args.seed, "smoke": args.smoke,
             "seq_len": args.seq_len, "batch": args.batch, "lr": args.lr,
             "time_budget_s": args.time_budget_s, "device": str(device),
             "torch": torch.__version__, "python": platform.python_version(),
             "corpus": {"root": str(root), "train_files": len(train_files),
                        "heldout_files": len(heldout_files),
                        "train_bytes": int(train_data.numel()),
                        "heldout_bytes": int(heldout_data.numel()),
                        "eval_windows": int(windows.shape[0])},
             "train": [], "heldout": []}
    print(f"[{args.family}] {n_params / 1e6:.2f} M params, {len(train_files)} train files "
          f"({train_data.numel() / 1e6:.1f} MB), {len(heldout_files)} held-out "
          f"({heldout_data.numel() / 1e6:.2f} MB)", flush=True)

    def evaluate(step: int, elapsed: float) -> float:
        nats = mean_nats_per_byte(model, windows, args.batch, device)
        curve["heldout"].append({"step": step, "time_s": round(elapsed, 2), "nats_per_byte": nats})
        print(f"[{args.family}] step {step} t={elapsed:.0f}s held-out {nats:.4f} nats/byte",
              flush=True)
        return nats

    model.train()
    start = time.perf_counter()
    eval_time = 0.0
    step = 0
    running = []
    while True:
        elapsed = time.perf_counter() - start - eval_time
        if elapsed >= args.time_budget_s or (args.max_steps and step >= args.max_steps):
            break
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, elapsed, args)
        starts = torch.randint(0, train_data.numel() - args.seq_len, (args.batch,),
                               generator=sampler).to(device)
        ids = train_gpu[starts[:, None] + offsets].long()
        with autocast(device):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        running.append(loss.detach())
        step += 1
        if step % args.log_every == 0:
            mean = torch.stack(running).mean().item()
            running.clear()
            if not math.isfinite(mean):
                raise FloatingPointError(f"[{args.family}] training loss is {mean} at step {step}")
            curve["train"].append({"step": step, "time_s": round(elapsed, 2), "loss": mean})
        if args.eval_every and step % args.eval_every == 0:
            t0 = time.perf_counter()
            evaluate(step, elapsed)
            eval_time += time.perf_counter() - t0
    if device.type == "cuda":
        torch.cuda.synchronize()
    train_s = time.perf_counter() - start - eval_time
    curve["steps"] = step
    curve["train_time_s"] = round(train_s, 2)
    curve["tokens_per_s"] = round(step * args.batch * args.seq_len / max(train_s, 1e-9))
    curve["final_heldout_nats_per_byte"] = evaluate(step, train_s)

    model = model.to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    weights = out / "model.safetensors"
    size = weights.stat().st_size
    curve["weights_bytes"] = size
    corpus.write_list(out / "heldout.txt", heldout_files)
    (out / "curve.json").write_text(json.dumps(curve, indent=1) + "\n")
    if size > MAX_WEIGHTS_BYTES:
        raise ValueError(f"{weights} is {size} bytes, over the {MAX_WEIGHTS_BYTES} limit")
    print(f"SUMMARY {args.family}: {n_params / 1e6:.2f} M params, {step} steps in "
          f"{train_s:.0f} s ({curve['tokens_per_s']} tok/s), held-out "
          f"{curve['final_heldout_nats_per_byte']:.4f} nats/byte, weights {size / 1e6:.1f} MB",
          flush=True)
    return curve


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--family", required=True, choices=FAMILIES)
    p.add_argument("--out", required=True, help="output directory (created)")
    p.add_argument("--smoke", action="store_true",
                   help="tiny model, short sequences, a few steps: checks the script on a CPU")
    p.add_argument("--time-budget-s", type=float, default=150.0,
                   help="training time (evaluations excluded)")
    p.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (0: no limit)")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup-steps", type=int, default=50)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--eval-windows", type=int, default=32,
                   help="held-out windows of --seq-len bytes per evaluation")
    corpus.add_root_argument(p)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    if args.smoke:
        # Smoke sizes replace the defaults; a flag set to another value keeps it.
        defaults = p.parse_args(["--family", args.family, "--out", args.out])
        for name, value in {"seq_len": 64, "batch": 2, "max_steps": 12, "warmup_steps": 2,
                            "log_every": 2, "eval_every": 6, "eval_windows": 2,
                            "time_budget_s": 60.0}.items():
            if getattr(args, name) == getattr(defaults, name):
                setattr(args, name, value)
    for name in ("time_budget_s", "seq_len", "batch", "lr", "log_every"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be > 0")
    return args


def main(argv=None) -> int:
    train(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
