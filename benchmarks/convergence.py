"""Does Top-K on the wire hurt convergence? A small GPT over 3 stages, four ways.

    python benchmarks/convergence.py [--steps 300] [--ratio 100] [--png convergence.png] [--variants ...]

A GPT-2-style model (byte-level, 4 blocks) learns the text of this Python's standard
library sources. It is cut into 3 stages after blocks 0 and 2; at each cut the forward
activations and the backward gradients go through fusionp2p's wire format (encode +
decode), at each link's ratio:

  (a) none        dense activations and gradients
  (b) uniform     ratio r on both links
  (c) adaptive    paper §5.2: links of 100 and 10 Mbit/s get ratios with mean r, slower harder
  (d) adaptive+EF (c) with error feedback on the gradients

  (e) planned     the least ratio per link that hides it under a stage's compute (here:
                  compute per micro-batch = the fast link's dense transfer time, so the
                  fast link stays dense and the slow one gets what it needs), shared positions

where, as in the paper, the backward gradient is Top-K-selected on its own (its own
indices) and the forward's selection is passed straight through. The "shared" variants
send the exact gradient of the compressed forward instead: the incoming gradient at the
forward's kept indices, values only (``encode_at``). Ratios 10 and 2 show the trend.

Every variant sees the same batches from the same initial weights, with a linear warm-up
and gradient clipping (without them the dense model can sit on the unigram plateau for
hundreds of steps, and which variant leaves it first is chance). Prints the training
loss (mean of the last 20 steps) and a held-out loss, each relative to (a), and writes
the loss curves to a PNG.
"""

from __future__ import annotations

import argparse
import math
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch
import transformers

from fusionp2p.compression import ErrorFeedback, decode, decode_at, encode, encode_at
from fusionp2p.planning import WIRE, CompressionPolicy, adaptive_ratios, planned_ratios

CUTS = (0, 2)  # compress after these blocks


def stdlib_bytes(limit: int) -> np.ndarray:
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= limit:
            break
    return np.frombuffer(b"".join(chunks)[:limit], dtype=np.uint8)


class _WireHop(torch.autograd.Function):
    """Identity in value space, except that both directions cross the wire format."""

    @staticmethod
    def forward(ctx, h, ratio, feedback, key, shared):
        ctx.ratio, ctx.feedback, ctx.key, ctx.indices = ratio, feedback, key, None
        if ratio <= 1:
            return h.clone()
        enc = encode(h, ratio)
        if shared and enc.header.index_format != "dense":
            ctx.indices = enc.indices
        return decode(enc.header, enc.body).to(h.dtype)

    @staticmethod
    def backward(ctx, grad):
        if ctx.ratio <= 1:
            return grad, None, None, None, None
        if ctx.indices is not None:
            enc = encode_at(grad, ctx.indices)
            return decode_at(enc.header, enc.body, ctx.indices).to(grad.dtype), None, None, None, None
        if ctx.feedback is not None:
            enc = ctx.feedback.compress(ctx.key, grad, ctx.ratio)
        else:
            enc = encode(grad, ctx.ratio)
        return decode(enc.header, enc.body).to(grad.dtype), None, None, None, None


def build(seed: int, args: argparse.Namespace) -> transformers.GPT2LMHeadModel:
    torch.manual_seed(seed)
    config = transformers.GPT2Config(
        vocab_size=256,
        n_positions=args.seq_len,
        n_embd=args.d_model,
        n_layer=4,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return transformers.GPT2LMHeadModel(config)


def run(
    name: str,
    ratios: list[float],
    feedback: bool,
    shared: bool,
    data: np.ndarray,
    held_out: np.ndarray,
    args: argparse.Namespace,
) -> tuple[list[float], float]:
    model = build(0, args)
    ef = ErrorFeedback() if feedback else None
    hooks = []
    for link, block in enumerate(CUTS):

        def hook(_module, _inputs, output, link=link):
            return _WireHop.apply(output, ratios[link], ef, f"link{link}", shared)

        hooks.append(model.transformer.h[block].register_forward_hook(hook))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    warmup = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / args.warmup))
    rng = np.random.default_rng(1)
    losses = []
    start = time.perf_counter()
    for step in range(args.steps):
        starts = rng.integers(0, len(data) - args.seq_len - 1, args.batch)
        batch = torch.from_numpy(np.stack([data[s : s + args.seq_len] for s in starts]).astype(np.int64))
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        warmup.step()
        losses.append(loss.item())
        if (step + 1) % 50 == 0:
            print(
                f"  {name:<13} step {step + 1:>4}  loss {np.mean(losses[-20:]):.4f}  "
                f"({time.perf_counter() - start:.0f} s)",
                flush=True,
            )
    with torch.no_grad():
        starts = np.arange(0, len(held_out) - args.seq_len - 1, args.seq_len)[:64]
        batch = torch.from_numpy(np.stack([held_out[s : s + args.seq_len] for s in starts]).astype(np.int64))
        eval_loss = float(model(input_ids=batch, labels=batch).loss)
    for h in hooks:
        h.remove()
    return losses, eval_loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--ratio", type=float, default=100.0)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=30, help="steps of linear learning-rate warm-up")
    parser.add_argument("--clip", type=float, default=1.0, help="gradient norm clipping")
    parser.add_argument("--png", default="convergence.png")
    parser.add_argument("--variants", nargs="*", help="run only these variants (names as printed)")
    parser.add_argument(
        "--budget", type=float, default=1.0, help="planned: compute per micro-batch / fast link's dense time"
    )
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    text = stdlib_bytes(4 << 20)
    data, held_out = text[: int(len(text) * 0.95)], text[int(len(text) * 0.95) :]
    # two links, 100 and 10 Mbit/s, carrying the same activation: uncompressed times 1 : 10
    adaptive = adaptive_ratios(
        np.array([1.0, 10.0]), CompressionPolicy(kind="adaptive", ratio=args.ratio)
    ).tolist()
    dense = float(args.batch * args.seq_len * args.d_model * 4)  # one cut's activation, fp32
    fast, slow = 100e6 / 8, 10e6 / 8  # bytes/s
    planned = planned_ratios(
        np.array([dense, dense]),
        np.array([fast, slow]),
        0.0,
        args.budget * dense / fast,
        CompressionPolicy(kind="planned", ratio=1.0, max_ratio=100.0),
        WIRE,
    ).tolist()
    variants = [  # name, ratio per link, error feedback, shared indices
        ("none", [1.0, 1.0], False, False),
        ("uniform", [args.ratio] * 2, False, False),
        ("adaptive", adaptive, False, False),
        ("adaptive+EF", adaptive, True, False),
        ("uniform 2", [2.0, 2.0], False, False),
        ("uni. shared", [args.ratio] * 2, False, True),
        ("adapt. shared", adaptive, False, True),
        ("10 shared", [10.0, 10.0], False, True),
        ("2 shared", [2.0, 2.0], False, True),
        ("planned", planned, False, True),
    ]
    if args.variants:
        variants = [v for v in variants if v[0] in {"none", *args.variants}]
    print(
        f"{len(data) / 1e6:.1f} MB of stdlib text, {args.steps} steps of {args.batch}x{args.seq_len} bytes, "
        f"ratios: uniform {args.ratio:g}, adaptive {[round(r, 1) for r in adaptive]}, "
        f"planned {[round(r, 1) for r in planned]}"
    )
    results = {}
    for name, ratios, fb, shared in variants:
        results[name] = run(name, ratios, fb, shared, data, held_out, args)
    base_train = np.mean(results["none"][0][-20:])
    base_eval = results["none"][1]
    print(
        f"\n{'variant':<13} {'link ratios':<16} {'train loss':>10} {'vs (a)':>8} "
        f"{'held-out':>9} {'vs (a)':>8}"
    )
    for name, ratios, _, _ in variants:
        losses, ev = results[name]
        train = float(np.mean(losses[-20:]))
        print(
            f"{name:<13} {'/'.join(f'{r:.0f}' for r in ratios):<16} {train:>10.4f} "
            f"{(train / base_train - 1) * 100:>+7.1f}% {ev:>9.4f} {(ev / base_eval - 1) * 100:>+7.1f}%"
        )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    window = 10
    for name, _, _, _ in variants:
        losses = np.array(results[name][0])
        smooth = np.convolve(losses, np.ones(window) / window, mode="valid")
        ax.plot(np.arange(window, len(losses) + 1), smooth, label=name)
    ax.set_xlabel("step")
    ax.set_ylabel(f"training loss ({window}-step mean)")
    ax.set_ylim(top=min(ax.get_ylim()[1], math.log(256) + 0.5))
    ax.set_title(f"GPT over 3 stages, Top-K on both links (average ratio {args.ratio:g})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.png, dpi=110)
    print(f"\nwrote {args.png}")


if __name__ == "__main__":
    main()
