"""DeepSeek-V4 in transformers on mhc: build a small model from a config, patch it, fine-tune it.

    python examples/deepseek_v4.py                      # CPU: a tiny model, patched vs unpatched
    python examples/deepseek_v4.py --preset gpu         # a GPU: a small model, bf16
    python examples/deepseek_v4.py --bench-layer        # GPU: the mHC work of one decoder layer
    python examples/deepseek_v4.py --bench-step         # GPU: a training step, with a profile
    python examples/deepseek_v4.py --bench-ckpt         # GPU: the step with k layers per checkpoint region
    python examples/deepseek_v4.py --bench-decode       # GPU: greedy generation, and where a token's time goes

``--compare`` (the default) trains the same model (same initial weights, same batches) twice, as
transformers ships it and patched with :func:`mhc.integrations.transformers.patch_deepseek_v4`,
on a synthetic language with a known optimal loss (``train_toy_lm.MarkovSource``), and prints and
plots the loss and the step time of both. Needs transformers with DeepSeek-V4
(``pip install -e ".[transformers]"``); nothing is downloaded.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time

import torch
from train_toy_lm import MarkovSource

from mhc.integrations.transformers import patch_deepseek_v4  # noqa: E402

PRESETS = {
    # CPU: two layers, hidden 64, 24 tokens a sequence
    "cpu": dict(
        hidden=64,
        layers=2,
        heads=2,
        head_dim=32,
        experts=4,
        expert_dim=64,
        batch=8,
        seq=32,
        steps=200,
        lr=3e-3,
        dtype="float32",
    ),
    # one GPU: four layers, hidden 1024, 8 x 512 tokens
    "gpu": dict(
        hidden=1024,
        layers=4,
        heads=8,
        head_dim=128,
        experts=8,
        expert_dim=512,
        batch=8,
        seq=512,
        steps=300,
        lr=1e-3,
        dtype="bfloat16",
    ),
}


def _peak_extra(fn) -> int:
    """Bytes allocated at peak by ``fn()`` beyond what was live before it."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def v4_config(hidden, layers, heads, head_dim, experts, expert_dim, vocab, hc_mult=4, **_):
    from transformers import DeepseekV4Config

    return DeepseekV4Config(
        vocab_size=vocab,
        hidden_size=hidden,
        moe_intermediate_size=expert_dim,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=1,
        head_dim=head_dim,
        q_lora_rank=hidden // 2,
        o_lora_rank=hidden // 2,
        o_groups=2,
        n_routed_experts=experts,
        num_experts_per_tok=2,
        n_shared_experts=1,
        index_n_heads=2,
        index_head_dim=64,
        index_topk=8,
        sliding_window=64,
        qk_rope_head_dim=min(64, head_dim // 2),
        hc_mult=hc_mult,
        num_nextn_predict_layers=0,
        max_position_embeddings=4096,
        mlp_layer_types=["hash_moe"] + ["moe"] * (layers - 1),
    )


def build(config, device, dtype, seed=0):
    """A V4 model with transformers' initialisation, in ``dtype`` but for the mHC parameters (fp32,
    as transformers loads them)."""
    from transformers import DeepseekV4ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(config).to(device=device, dtype=dtype)
    for name, module in model.named_modules():
        if name.endswith(("attn_hc", "ffn_hc", "hc_head")):
            module.float()
    return model


def train(model, source, args, device, label):
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(1)
    losses, times = [], []
    for step in range(args.steps):
        batch = source.sample(args.batch, args.seq + 1, g).to(device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = model(input_ids=batch[:, :-1], labels=batch[:, :-1]).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        if step % max(1, args.steps // 10) == 0 or step == args.steps - 1:
            print(f"  {label:>9} step {step:4d} loss {losses[-1]:.4f} step {times[-1] * 1e3:7.1f} ms", flush=True)
    return losses, times


def compare(args, device):
    """Train the unpatched and the patched model from the same weights on the same batches."""
    source = MarkovSource(vocab=64, branching=4, seed=0, order=1)
    dtype = getattr(torch, args.dtype)
    config = v4_config(vocab=source.vocab, **vars(args))
    unpatched = build(config, device, dtype)
    patched = patch_deepseek_v4(copy.deepcopy(unpatched))
    print(
        f"# DeepSeek-V4, {args.layers} layers, hidden {args.hidden}, hc_mult 4, {args.batch} x {args.seq} tokens, "
        f"{args.dtype}, {device}; optimal loss {source.optimum(args.seq):.4f}",
        flush=True,
    )
    results = {}
    for label, model in (("unpatched", unpatched), ("patched", patched)):
        losses, times = train(model, source, args, device, label)
        steady = statistics.median(times[len(times) // 4 :])
        results[label] = dict(losses=losses, step_ms=steady * 1e3)
    print(
        f"# median step: unpatched {results['unpatched']['step_ms']:.1f} ms, patched "
        f"{results['patched']['step_ms']:.1f} ms "
        f"({results['unpatched']['step_ms'] / results['patched']['step_ms']:.2f}x); "
        f"final loss {results['unpatched']['losses'][-1]:.4f} / {results['patched']['losses'][-1]:.4f}",
        flush=True,
    )
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "deepseek_v4.json"), "w") as f:
        json.dump(results, f)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, r in results.items():
        ax.plot(r["losses"], label=f"{label} ({r['step_ms']:.1f} ms/step)")
    ax.axhline(source.optimum(args.seq), color="k", linestyle=":", label="optimum")
    ax.set(xlabel="step", ylabel="training loss", title="DeepSeek-V4, transformers vs patched with mhc")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(args.out_dir, "deepseek_v4_loss.png"), dpi=120)


# ------------------------------------------------------------------------------ benchmarks (GPU)


def bench_layer(args):
    """The mHC work of one decoder layer, both sites, forward + backward: transformers' modules
    (``DeepseekV4HyperConnection`` and the decoder layer's mixing, as it ships) against the patched
    modules (``split``, the seam to the MLP site, ``finish``), with the branches the identity."""
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as v4
    from triton.testing import do_bench

    config = v4_config(vocab=64, **{**vars(args), "hidden": args.bench_dim})
    n, dim, dtype = 4, args.bench_dim, torch.bfloat16

    def sites():
        torch.manual_seed(0)
        attn, ffn = v4.DeepseekV4HyperConnection(config).cuda(), v4.DeepseekV4HyperConnection(config).cuda()
        with torch.no_grad():
            for site in (attn, ffn):
                site.fn.normal_(std=config.initializer_range)
                site.base.zero_()
                site.scale.fill_(1.0)
        return attn, ffn

    def transformers_layer(attn, ffn, x):
        post, comb, collapsed = attn(x)
        x = post.to(dtype).unsqueeze(-1) * collapsed.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), x)
        post, comb, collapsed = ffn(x)
        return post.to(dtype).unsqueeze(-1) * collapsed.unsqueeze(-2) + torch.matmul(
            comb.to(dtype).transpose(-1, -2), x
        )

    def mhc_layer(attn, ffn, x):
        x_in, finish = attn.split(x)
        x_in, finish = finish(x_in, next=ffn)
        return finish(x_in)

    from mhc.integrations.transformers import _patched_classes

    rows = []
    # [B, S, n, D]: V4's modules take the model's layout
    x = torch.randn(args.bench_tokens // 2048, 2048, n, dim, device="cuda", dtype=dtype, requires_grad=True)
    w = torch.randn_like(x)
    for label, layer, patch in (("transformers", transformers_layer, False), ("mhc", mhc_layer, True)):
        attn, ffn = sites()
        if patch:  # what patch_deepseek_v4 does to a model's sites
            for site in (attn, ffn):
                site.__class__ = _patched_classes()["hc"]
                site.backend = "auto"
        step = lambda: layer(attn, ffn, x).backward(w)  # noqa: E731
        step()
        ms = do_bench(
            step, warmup=25, rep=200, grad_to_none=[x, *attn.parameters(), *ffn.parameters()], return_mode="median"
        )
        peak = _peak_extra(step) / 2**30
        rows.append((label, ms, peak))
        print(
            f"  one decoder layer's mHC, fwd+bwd, d={dim}, {args.bench_tokens} tokens: {label:>12} {ms:8.3f} ms, "
            f"peak {peak:6.2f} GiB",
            flush=True,
        )
    (_, t_ms, t_peak), (_, m_ms, m_peak) = rows
    print(f"  mhc: {t_ms / m_ms:.1f}x faster, {t_peak / m_peak:.1f}x less peak memory", flush=True)


def bench_step(args):
    """A training step of a small DeepseekV4ForCausalLM, unpatched against patched (without and with
    the streams recomputed: the paper's block length, and one block of all sites), arms interleaved
    over rounds; peak memory; then a profile of the patched step (the mHC kernels' share)."""
    from torch.profiler import ProfilerActivity, profile

    sites = 2 * args.step_layers
    arms = {
        "unpatched": (None, None),
        "patched": (False, None),
        "patched, recompute": (True, None),
        f"patched, recompute {sites}": (sites, None),
    }
    steps = _time_steps(args, arms)
    step = steps["patched"][0]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    total = mhc = 0.0
    for event in prof.key_averages():
        total += event.self_device_time_total
        if any(k in event.key for k in ("coefficient", "stream_mix", "seam", "sinkhorn", "projection_bwd")):
            mhc += event.self_device_time_total
    print(
        f"  patched step profile: mHC kernels {mhc / 3e3:.2f} ms of {total / 3e3:.2f} ms GPU time per step "
        f"({mhc / total:.1%})",
        flush=True,
    )
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15), flush=True)


def bench_ckpt(args):
    """A training step of a small DeepseekV4ForCausalLM with its decoder layers checkpointed,
    ``k`` layers per region (:func:`checkpoint_decoder_layers`), unpatched and patched, against
    the same models without checkpointing; arms interleaved over rounds, peak memory."""
    arms = {"unpatched": (None, None), "patched": (False, None), "unpatched ckpt=1": (None, 1)}
    arms.update({f"patched ckpt={k}": (False, k) for k in (1, 2, 4, 8) if k <= args.step_layers})
    _time_steps(args, arms)


def checkpoint_decoder_layers(model, every: int):
    """Checkpoint ``model``'s decoder layers, ``every`` consecutive layers per region
    (:func:`mhc.memory.checkpoint.checkpoint_layers`): the first layer of each group runs the group, the
    others pass the streams on."""
    from torch import nn

    from mhc.memory.checkpoint import checkpoint_layers

    class Group(nn.Module):
        def __init__(self, layers):
            super().__init__()
            self.group = nn.ModuleList(layers)

        def forward(self, hidden_states, **kwargs):
            return checkpoint_layers(self.group, hidden_states, every=len(self.group), **kwargs)

    class PassOn(nn.Module):
        def forward(self, hidden_states, **kwargs):
            return hidden_states

    layers = list(model.model.layers)
    grouped = []
    for first in range(0, len(layers), every):
        group = layers[first : first + every]
        grouped += [Group(group)] + [PassOn() for _ in group[1:]]
    model.model.layers = nn.ModuleList(grouped)
    return model


def _time_steps(args, arms: dict) -> dict:
    """Build each arm's model (``arms``: label -> ``(recompute, ckpt)``; ``recompute`` ``None``
    leaves the model unpatched), time its AdamW step over interleaved rounds and print step time
    and peak; returns ``{label: (step, model)}``."""
    from triton.testing import do_bench

    dtype = getattr(torch, args.dtype)
    config = v4_config(vocab=32768, **{**vars(args), "hidden": args.step_dim, "layers": args.step_layers})
    device = torch.device("cuda")
    tokens = torch.randint(0, 32768, (args.step_batch, args.seq), device=device)
    steps = {}
    for label, (recompute, ckpt) in arms.items():
        model = build(config, device, dtype)
        if recompute is not None:
            patch_deepseek_v4(model, recompute=recompute)
        if ckpt:
            checkpoint_decoder_layers(model, ckpt)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)

        def step(model=model, opt=opt):  # no cache in training (checkpointing would replay its updates)
            model(input_ids=tokens, labels=tokens, use_cache=False).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        step()
        steps[label] = (step, model)
    times = {label: [] for label in steps}
    for _ in range(args.rounds):
        for label, (step, _) in steps.items():
            times[label].append(do_bench(step, warmup=5, rep=50, return_mode="median"))
    peaks = {}
    for label, (step, _) in steps.items():
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        peaks[label] = (torch.cuda.max_memory_allocated() - before) / 2**30
    ntok = args.step_batch * args.seq
    for label in steps:
        ms = statistics.median(times[label])
        print(
            f"  V4 step ({args.step_layers} layers, hidden {args.step_dim}, {ntok} tokens, {args.dtype}): "
            f"{label:>22} {ms:8.2f} ms ({', '.join(f'{t:.2f}' for t in times[label])}), peak beyond weights "
            f"{peaks[label]:6.2f} GiB",
            flush=True,
        )
    return steps


def _host_share(prof_stats, prefixes) -> dict:
    """Seconds of ``cProfile`` self time per package: the first of ``prefixes`` in a function's
    file path (``"~"``: functions written in C, the ops among them), else ``"other"``."""
    share = dict.fromkeys([*prefixes, "other"], 0.0)
    for (path, _, _), (_, _, tottime, _, _) in prof_stats.stats.items():
        share[next((k for k in prefixes if k in path), "other")] += tottime
    return share


def bench_decode(args):
    """Greedy generation with the cache: a small DeepseekV4ForCausalLM unpatched against patched
    (the same weights), time per generated token at each batch size, arms interleaved over rounds;
    then where one patched token's time goes: wall, GPU kernel time (the mHC kernels' part), and
    the host's Python by package."""
    import cProfile
    import pstats

    from torch.profiler import ProfilerActivity, profile

    dtype = getattr(torch, args.dtype)
    config = v4_config(vocab=32768, **{**vars(args), "hidden": args.step_dim, "layers": args.step_layers})
    device = torch.device("cuda")
    models = {"unpatched": build(config, device, dtype).eval()}
    models["patched"] = patch_deepseek_v4(build(config, device, dtype).eval())
    new, prompt_len = args.decode_tokens, 32

    def generate(model, prompt):
        return model.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)

    for batch in args.decode_batch:
        prompt = torch.randint(1, 32768, (batch, prompt_len), device=device)
        outs = {label: generate(model, prompt) for label, model in models.items()}  # warm-up, and the tokens
        same = torch.equal(outs["unpatched"], outs["patched"])
        times = {label: [] for label in models}
        for _ in range(args.rounds):
            for label, model in models.items():
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                generate(model, prompt)
                torch.cuda.synchronize()
                times[label].append((time.perf_counter() - t0) / new * 1e3)
        for label in models:
            ms = statistics.median(times[label])
            print(
                f"  V4 decode ({args.step_layers} layers, hidden {args.step_dim}, batch {batch}, "
                f"prompt {prompt_len}, {new} new tokens, {args.dtype}): {label:>9} {ms:7.2f} ms per token "
                f"({', '.join(f'{t:.2f}' for t in times[label])}); same tokens: {same}",
                flush=True,
            )

        model = models["patched"]
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            generate(model, prompt)
            torch.cuda.synchronize()
        gpu = mhc = 0.0
        launches = 0
        for event in prof.key_averages():
            gpu += event.self_device_time_total
            launches += event.count if event.self_device_time_total > 0 else 0
            if any(k in event.key for k in ("coefficient", "stream_mix", "seam", "sinkhorn", "projection")):
                mhc += event.self_device_time_total
        host = cProfile.Profile()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        host.enable()
        generate(model, prompt)
        host.disable()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / new * 1e3
        share = _host_share(pstats.Stats(host), ("/mhc/", "/transformers/", "/torch/", "/triton/", "~"))
        host_ms = ", ".join(f"{k.strip('/').replace('~', 'C')} {v / new * 1e3:.2f} ms" for k, v in share.items())
        print(
            f"  patched, batch {batch}, per token: GPU kernels {gpu / new / 1e3:.2f} ms in {launches / new:.0f} "
            f"kernels (mHC kernels {mhc / new / 1e3:.3f} ms); under cProfile {wall:.2f} ms wall, self time "
            f"{host_ms}",
            flush=True,
        )


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default=None, help="default: gpu on CUDA, cpu otherwise")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--out-dir", default="runs/deepseek_v4")
    p.add_argument("--bench-layer", action="store_true", help="GPU: the mHC work of one decoder layer")
    p.add_argument("--bench-dim", type=int, default=4096)
    p.add_argument("--bench-tokens", type=int, default=16384)
    p.add_argument("--bench-step", action="store_true", help="GPU: a training step of a small model, and a profile")
    p.add_argument("--step-dim", type=int, default=2048)
    p.add_argument("--step-layers", type=int, default=4)
    p.add_argument("--step-batch", type=int, default=4)
    p.add_argument(
        "--bench-ckpt",
        action="store_true",
        help="GPU: a training step with the decoder layers checkpointed, k layers per region",
    )
    p.add_argument("--bench-decode", action="store_true", help="GPU: greedy generation, unpatched vs patched")
    p.add_argument("--decode-batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    preset = PRESETS[args.preset or ("gpu" if device.type == "cuda" else "cpu")]
    for key, value in preset.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if args.bench_layer or args.bench_step or args.bench_ckpt or args.bench_decode:
        if device.type != "cuda":
            sys.exit("the benchmarks need a CUDA GPU")
        if args.bench_layer:
            bench_layer(args)
        if args.bench_step or args.bench_ckpt:
            args.seq = 2048
        if args.bench_step:
            bench_step(args)
        if args.bench_ckpt:
            bench_ckpt(args)
        if args.bench_decode:
            bench_decode(args)
        return
    compare(args, device)


if __name__ == "__main__":
    main()
