"""Does Top-K on the wire hurt convergence? A small GPT over 3 stages, four policies.

    python benchmarks/convergence.py [--steps 300] [--ratio 100] [--png convergence.png] [--variants ...]

A GPT-2-style model (byte-level, 4 blocks) learns the text of this Python's standard
library sources. It is cut into 3 stages after blocks 0 and 2; at each cut the forward
activations and the backward gradients go through fusionp2p's wire format (encode +
decode), at each link's ratio:

  none          dense activations and gradients
  uniform       ratio r on both links
  paper         §5.2's adaptive ratios: links of 100 and 10 Mbit/s get ratios with mean r,
                the slower harder
  planned       fusionp2p's policy: the least ratio per link that hides it under the
                bottleneck's compute, at most ``--max-ratio``; both cuts get the ratios of
                the two hardest-compressed links of its plan for GPT-2 small on the
                paper-like swarm below (so the loss is paid for the speed printed next to
                it), Top-K per row (each token keeps its strongest features, as the
                runtime sends), gradients at the forward's positions, ratios growing
                geometrically from 1 (dense) to the plan's over ``--ratio-warmup`` steps

and, with ``--variants all``, more: paper+EF (error feedback on the gradients), ratio 2,
and each ratio with shared positions.

where, as in the paper, the backward gradient is Top-K-selected on its own (its own
indices) and the forward's selection is passed straight through. The "shared" variants
send the exact gradient of the compressed forward instead: the incoming gradient at the
forward's kept indices, values only (``encode_at``), as fusionp2p's runtime does.

For each policy it also plans GPT-2 small (block-level OP-DAG, n_b = 8) with OP-Fence on
a paper-like swarm (48 peers in 3 clusters, 1-10 Gbit/s inside, 8 Mbit/s - 1 Gbit/s
between; ``synthetic_swarm(48)``) and prints the estimated iteration time: what the
policy buys in speed next to what it costs in loss.

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
from fusionp2p.opdag import TransformerShape, transformer_dag
from fusionp2p.planning import (
    PLANNED_MAX_RATIO,
    CompressionPolicy,
    CostConfig,
    Topology,
    adaptive_ratios,
    estimate,
    op_fence,
    synthetic_swarm,
)

CUTS = (0, 2)  # compress after these blocks
POLICIES = ("none", "uniform", "paper", "planned")


def planned_speed(
    ratio: float, max_ratio: float, steps: int, warmup: int
) -> tuple[dict[str, float], list[float], float]:
    """Each policy's estimated iteration time for GPT-2 small on a paper-like swarm, the
    Top-K ratios of the planned policy's plan there (largest first; 1 = dense), and the
    planned plan's mean iteration time over ``steps`` steps whose first ``warmup`` grow
    the ratios from 1 (the price of the ratio warm-up)."""
    shape = TransformerShape("gpt2", 12, 768, 12, 50257, 1024, 3072, 12, True)
    dag = transformer_dag(shape, seq_len=1024, micro_batch=4, granularity="block")
    peers, links, _ = synthetic_swarm(48, n_peers=48, n_clusters=3)
    topo = Topology.from_records(peers, links)
    policies = {
        "none": CompressionPolicy(kind="none"),
        "uniform": CompressionPolicy(kind="uniform", ratio=ratio),
        "paper": CompressionPolicy(kind="adaptive", ratio=ratio),
        "planned": CompressionPolicy(kind="planned", ratio=1.0, max_ratio=max_ratio),
    }
    times, planned, mean = {}, [1.0], 0.0
    for name, policy in policies.items():
        cost = CostConfig(n_micro_batches=8, compression=policy)
        plan = op_fence(dag, topo, cost)
        times[name] = plan.iteration_s
        if name == "planned":
            planned = sorted((lk.ratio for lk in plan.estimate.links if lk.wire_bytes > 0), reverse=True)
            ramp = [
                estimate(dag, topo, plan.stages, cost, {k: r ** (t / warmup) for k, r in plan.ratios.items()})
                for t in range(min(warmup, steps))
            ]
            mean = (sum(e.iteration_s for e in ramp) + max(0, steps - warmup) * plan.iteration_s) / steps
    return times, planned + [1.0] * 2, mean


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
    def forward(ctx, h, ratio, feedback, key, shared, rows):
        ctx.ratio, ctx.feedback, ctx.key, ctx.indices = ratio, feedback, key, None
        if ratio <= 1:
            return h.clone()
        enc = encode(h, ratio, rows=rows)
        if shared and enc.header.index_format != "dense":
            ctx.indices = enc.indices
        return decode(enc.header, enc.body).to(h.dtype)

    @staticmethod
    def backward(ctx, grad):
        if ctx.ratio <= 1:
            return grad, None, None, None, None, None
        if ctx.indices is not None:
            enc = encode_at(grad, ctx.indices)
            return decode_at(enc.header, enc.body, ctx.indices).to(grad.dtype), None, None, None, None, None
        if ctx.feedback is not None:
            enc = ctx.feedback.compress(ctx.key, grad, ctx.ratio)
        else:
            enc = encode(grad, ctx.ratio)
        return decode(enc.header, enc.body).to(grad.dtype), None, None, None, None, None


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
    rows: bool,
    warmup_steps: int,
    data: np.ndarray,
    held_out: np.ndarray,
    args: argparse.Namespace,
) -> tuple[list[float], float]:
    model = build(0, args)
    ef = ErrorFeedback() if feedback else None
    hooks = []
    warm = {"exponent": 0.0}  # ratio ** exponent: 0 dense, 1 the full ratio
    for link, block in enumerate(CUTS):

        def hook(_module, _inputs, output, link=link):
            ratio = ratios[link] ** warm["exponent"]
            return _WireHop.apply(output, ratio, ef, f"link{link}", shared, rows)

        hooks.append(model.transformer.h[block].register_forward_hook(hook))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    warmup = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / args.warmup))
    rng = np.random.default_rng(1)
    losses = []
    start = time.perf_counter()
    for step in range(args.steps):
        if warmup_steps < 0:  # the abrupt variant: -warmup_steps steps dense, then the full ratios
            warm["exponent"] = float(step >= -warmup_steps)
        else:
            warm["exponent"] = min(1.0, step / warmup_steps) if warmup_steps else 1.0
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
    parser.add_argument(
        "--ratio-warmup", type=int, default=100, help="planned: steps over which ratios grow from 1"
    )
    parser.add_argument(
        "--variants", nargs="*", help="run only these variants (names as printed), or 'all' for every one"
    )
    parser.add_argument(
        "--max-ratio", type=float, default=PLANNED_MAX_RATIO, help="planned: no link compressed harder"
    )
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    text = stdlib_bytes(4 << 20)
    data, held_out = text[: int(len(text) * 0.95)], text[int(len(text) * 0.95) :]
    # two links, 100 and 10 Mbit/s, carrying the same activation: uncompressed times 1 : 10
    adaptive = adaptive_ratios(
        np.array([1.0, 10.0]), CompressionPolicy(kind="adaptive", ratio=args.ratio)
    ).tolist()
    speed, planned_all, ramp_mean = planned_speed(args.ratio, args.max_ratio, args.steps, args.ratio_warmup)
    planned = planned_all[:2]  # the planner's two hardest-compressed links on the paper-like swarm
    variants = [  # name, ratio per link, error feedback, shared indices, row-wise, ratio warm-up steps
        ("none", [1.0, 1.0], False, False, False, 0),
        ("uniform", [args.ratio] * 2, False, False, False, 0),
        ("paper", adaptive, False, False, False, 0),
        ("planned", planned, False, True, True, args.ratio_warmup),
        ("paper+EF", adaptive, True, False, False, 0),
        ("uniform 2", [2.0, 2.0], False, False, False, 0),
        ("uni. shared", [args.ratio] * 2, False, True, False, 0),
        ("paper shared", adaptive, False, True, False, 0),
        ("10 shared", [10.0, 10.0], False, True, False, 0),
        ("2 shared", [2.0, 2.0], False, True, False, 0),
        ("planned, global", planned, False, True, False, args.ratio_warmup),
        ("planned, no warm-up", planned, False, True, True, 0),
        ("planned, 30 dense", planned, False, True, True, -30),  # dense, then the plan's ratios at once
    ]
    chosen = args.variants or list(POLICIES)
    if "all" not in chosen:
        variants = [v for v in variants if v[0] in {"none", *chosen}]
    print(
        f"{len(data) / 1e6:.1f} MB of stdlib text, {args.steps} steps of {args.batch}x{args.seq_len} bytes, "
        f"ratios: uniform {args.ratio:g}, adaptive {[round(r, 1) for r in adaptive]}, "
        f"planned {[round(r, 1) for r in planned]}"
    )
    results = {}
    for name, ratios, fb, shared, rows, warm in variants:
        results[name] = run(name, ratios, fb, shared, rows, warm, data, held_out, args)
    base_train = np.mean(results["none"][0][-20:])
    base_eval = results["none"][1]
    print(
        f"\n{'variant':<20} {'link ratios':<12} {'train loss':>10} {'vs none':>8} "
        f"{'held-out':>9} {'vs none':>8} {'est. iteration s':>17} {'vs paper':>9}"
    )
    for name, ratios, *_ in variants:
        losses, ev = results[name]
        train = float(np.mean(losses[-20:]))
        policy = name if name in speed else None
        est = (
            f"{speed[policy]:>17.3f} {(speed[policy] / speed['paper'] - 1) * 100:>+8.1f}%"
            if policy
            else f"{'-':>17} {'-':>9}"
        )
        print(
            f"{name:<20} {'/'.join(f'{r:.0f}' for r in ratios):<12} {train:>10.4f} "
            f"{(train / base_train - 1) * 100:>+7.1f}% {ev:>9.4f} {(ev / base_eval - 1) * 100:>+7.1f}% {est}"
        )
    if "planned" in results and args.ratio_warmup:
        print(
            f"planned over all {args.steps} steps, counting the ratio warm-up: {ramp_mean:.3f} s per "
            f"iteration on average ({(ramp_mean / speed['paper'] - 1) * 100:+.1f}% vs paper)"
        )
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 5.5))
    window = 10
    colors = plt.get_cmap("tab20").colors
    for i, (name, *_) in enumerate(variants):
        losses = np.array(results[name][0])
        smooth = np.convolve(losses, np.ones(window) / window, mode="valid")
        main = name in POLICIES  # the four policies bold, the variants thin
        ax.plot(
            np.arange(window, len(losses) + 1),
            smooth,
            label=name,
            color=colors[(2 * i) % 20 if i < 10 else (2 * i + 1) % 20],
            linewidth=2.2 if main else 1.0,
            linestyle="-" if main else "--",
        )
    ax.set_xlabel("step")
    ax.set_ylabel(f"training loss ({window}-step mean)")
    ax.set_ylim(top=min(ax.get_ylim()[1], math.log(256) + 0.5))
    ax.set_title("GPT over 3 stages: training loss under each Top-K policy on both links")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    fig.tight_layout()
    fig.savefig(args.png, dpi=110)
    print(f"\nwrote {args.png}")


if __name__ == "__main__":
    main()
