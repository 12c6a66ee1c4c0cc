"""``patch_deepseek_v4`` against transformers' own DeepSeek-V4 modules and model, on tiny models built
from ``DeepseekV4Config`` here (nothing downloaded): loss, logits, every parameter gradient,
greedy generation, state dicts both ways, both backends, ``hc_mult`` 2 and 4, a few iteration
counts, bf16 by the three-way rule, and the errors.

The fused backend runs the kernels in Triton's interpreter on CPU (compiled on a GPU).
"""

import copy
import os
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers.models.deepseek_v4")

from transformers import DeepseekV4ForCausalLM, DeepseekV4Model  # noqa: E402
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as v4  # noqa: E402

from mhc import mixing  # noqa: E402
from mhc.integrations.transformers import patch_deepseek_v4  # noqa: E402
from mhc.modules.site import KEEP_STREAMS  # noqa: E402
from mhc.ops import mixing as mixing_ops  # noqa: E402
from tests.conftest import KERNEL_DEVICE  # noqa: E402
from tests.deepseek_v4_data import step_ids, tiny_config  # noqa: E402
from tests.torchrun import torchrun  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

BACKENDS = ["torch", "triton"]


def model_pair(backend, seed=0, **config):
    """An unpatched model (its mHC parameters moved off their zero / one init) and a patched copy."""
    torch.manual_seed(seed)
    ref = DeepseekV4ForCausalLM(tiny_config(**config)).float().to(KERNEL_DEVICE)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "hc" in name:
                p.add_(torch.randn_like(p) * 0.3)
    return ref, patch_deepseek_v4(copy.deepcopy(ref), backend=backend)


def step(model, ids):
    """Loss, logits and every parameter gradient of one training step."""
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {k: p.grad for k, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach(), out.logits.detach(), grads


def assert_close_scaled(got, want, rel):
    """Within ``rel * max(1e-3, max |want|)``: gradients that are ~0 (the hash router's) carry
    nothing but rounding."""
    scale = max(1e-3, want.abs().amax().item()) if want.numel() else 1.0
    torch.testing.assert_close(got, want, rtol=0, atol=rel * scale)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("hc_mult, iters", [(4, 20), (2, 3), (4, 1)])
def test_patched_model_computes_what_transformers_computes(backend, hc_mult, iters):
    ref, got = model_pair(backend, hc_mult=hc_mult, iters=iters)
    ids = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(1)).to(KERNEL_DEVICE)
    want_loss, want_logits, want_grads = step(ref, ids)
    loss, logits, grads = step(got, ids)
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-5)
    assert grads.keys() == want_grads.keys()
    for k in want_grads:
        assert_close_scaled(grads[k], want_grads[k], 2e-5)
    assert any("attn_hc.fn" in k for k in grads) and any("hc_head.hc_fn" in k for k in grads)


def run_tensor_parallel(tmp_path, device, backend):
    """transformers' TP plan on 2 ranks (tests/deepseek_v4_tp_worker.py) against transformers'
    own model in this process: loss, logits and every replicated parameter's gradient."""
    pytest.importorskip("accelerate")  # transformers' tp_plan needs it
    ref, _ = model_pair(backend, seed=5, vocab=98)  # the plan splits the vocabulary over the ranks
    ref.save_pretrained(tmp_path / "checkpoint")
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    args = [ROOT / "tests/deepseek_v4_tp_worker.py", tmp_path / "checkpoint", tmp_path, device, backend]
    torchrun(args, env=env, cwd=ROOT, timeout=600)
    got = torch.load(tmp_path / "step.pt")
    want_loss, want_logits, want_grads = step(ref.to(device), step_ids().to(device))
    torch.testing.assert_close(got["loss"], want_loss.cpu(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got["logits"], want_logits.cpu(), rtol=1e-5, atol=1e-5)
    assert got["grads"].keys() == want_grads.keys() - set(got["sharded"])
    assert not any("hc" in k for k in got["sharded"]), got["sharded"]
    assert sum("hc" in k for k in got["grads"]) == 2 * 2 * 3 + 3  # 2 layers of 2 sites, and the head
    for k in got["grads"]:
        assert_close_scaled(got["grads"][k], want_grads[k].cpu(), 2e-5)
    assert "is a DTensor" in (tmp_path / "error.txt").read_text()


@pytest.mark.skipif(torch.cuda.is_available(), reason="transformers' TP plan takes the GPUs where there are any")
def test_tensor_parallel_plan(tmp_path):
    run_tensor_parallel(tmp_path, "cpu", "torch")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tensor_parallel_plan_on_two_gpus(tmp_path):
    run_tensor_parallel(tmp_path, "cuda", "triton")


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_generation_with_the_cache(backend):
    ref, got = model_pair(backend, seed=2)
    prompt = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(3)).to(KERNEL_DEVICE)
    want = ref.generate(prompt, max_new_tokens=6, do_sample=False)
    assert torch.equal(got.generate(prompt, max_new_tokens=6, do_sample=False), want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_generation_with_a_static_cache(backend):
    """Decoding with transformers' static cache (what a compiled ``generate`` uses): the same tokens
    as the unpatched model, where this transformers offers a static cache for V4's layers."""
    ref, got = model_pair(backend, seed=2)
    prompt = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(3)).to(KERNEL_DEVICE)
    try:
        want = ref.generate(prompt, max_new_tokens=6, do_sample=False, cache_implementation="static")
    except KeyError as e:  # transformers 5.24: no static layer for "heavily_compressed_attention"
        pytest.skip(f"this transformers has no static cache for V4's layer type {e}")
    assert torch.equal(got.generate(prompt, max_new_tokens=6, do_sample=False, cache_implementation="static"), want)


@pytest.mark.parametrize("name", ["eps", "variance_epsilon"])
def test_the_norm_epsilon_under_either_name(name):
    """transformers 5.25 renamed the unweighted RMS norm's ``eps`` to ``variance_epsilon``: the
    patched sites and head read whichever the installed version has (0 included)."""
    ref, got = model_pair("torch")
    x = torch.randn(2, 3, got.config.hc_mult, got.config.hidden_size, device=KERNEL_DEVICE)
    for eps in (0.25, 0.0):
        for module in [m for layer in got.model.layers for m in (layer.attn_hc, layer.ffn_hc)] + [got.model.hc_head]:
            for old in ("eps", "variance_epsilon"):
                module.input_norm.__dict__.pop(old, None)
            setattr(module.input_norm, name, eps)
        assert all(layer.attn_hc.rms_eps == eps and layer.ffn_hc.rms_eps == eps for layer in got.model.layers)
        head = got.model.hc_head
        if eps > 0:  # the head's collapse takes a positive epsilon only
            want = mixing.stream_collapse(x, head.hc_fn.t(), head.hc_scale, head.hc_base, eps, head.eps, "torch")
            assert torch.equal(head(x), want)


def test_state_dicts_load_both_ways():
    ref, got = model_pair("torch", seed=3)
    assert list(ref.state_dict()) == list(got.state_dict())
    for name, p in got.named_parameters():
        assert p is dict(got.named_parameters())[name]  # the same tensors under the same names
    fresh_ref = DeepseekV4ForCausalLM(tiny_config()).to(KERNEL_DEVICE)
    fresh_got = patch_deepseek_v4(DeepseekV4ForCausalLM(tiny_config()).to(KERNEL_DEVICE), backend="torch")
    fresh_ref.load_state_dict(got.state_dict(), strict=True)
    fresh_got.load_state_dict(ref.state_dict(), strict=True)
    ids = torch.randint(0, 97, (1, 9)).to(KERNEL_DEVICE)
    torch.testing.assert_close(fresh_got(input_ids=ids).logits, fresh_ref(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


def test_transformers_mhc_code_no_longer_runs(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("transformers' own mHC code ran")

    _, got = model_pair("triton", seed=4)
    for cls in (v4.DeepseekV4HyperConnection, v4.DeepseekV4HyperHead, v4.DeepseekV4DecoderLayer):
        monkeypatch.setattr(cls, "forward", refuse)
    calls = []
    original = mixing_ops.MHCSeamFunction.apply
    monkeypatch.setattr(mixing_ops.MHCSeamFunction, "apply", lambda *a: calls.append(1) or original(*a))
    ids = torch.randint(0, 97, (2, 11)).to(KERNEL_DEVICE)
    got(input_ids=ids, labels=ids).loss.backward()
    assert len(calls) == 2  # one seam per decoder layer: attention site -> MLP site


def test_base_model_and_patching_twice():
    torch.manual_seed(5)
    ref = DeepseekV4Model(tiny_config()).to(KERNEL_DEVICE)
    got = patch_deepseek_v4(patch_deepseek_v4(copy.deepcopy(ref), backend="torch"), backend="torch")
    ids = torch.randint(0, 97, (2, 10)).to(KERNEL_DEVICE)
    torch.testing.assert_close(
        got(input_ids=ids).last_hidden_state, ref(input_ids=ids).last_hidden_state, rtol=1e-5, atol=1e-5
    )
    assert isinstance(got.layers[0], v4.DeepseekV4DecoderLayer)  # what transformers' hooks look for


FEW_ITERS = 6  # a few iterations where their count does not matter: the interpreter runs each


def _bf16_errors(seed):
    """``(exact, unpatched, patched)`` logits and mHC parameter gradients: an fp64 model, and bf16
    models with fp32 mHC parameters (as transformers keeps them)."""
    ref, got = model_pair("triton", seed=seed, iters=FEW_ITERS)
    exact = copy.deepcopy(ref).double()
    ids = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(seed)).to(KERNEL_DEVICE)
    for model in (ref, got):
        model.to(torch.bfloat16)
        for name, module in model.named_modules():
            if name.endswith(("attn_hc", "ffn_hc", "hc_head")):
                module.float()
    out = []
    for model in (exact, ref, got):
        _, logits, grads = step(model, ids)
        out.append({"logits": logits, **{k: g for k, g in grads.items() if "hc" in k}})
    return out


def test_bf16_three_way():
    """bf16: the logits and the projections' gradients (``fn``, ``hc_fn``) of the patched model at
    most twice as far from an fp64 model as the unpatched bf16 model's. The biases' and gates'
    gradients (``base``, ``scale``) are a few sums over every token each, whose error is one draw
    of many roundings (docs/mixing.md, "Accuracy"): pooled over the sites and three draws."""
    draws = [_bf16_errors(seed) for seed in (6, 7, 8)]

    def error(i, keys):
        diff = sum(((d[i][k].double() - d[0][k]).norm() ** 2 for d in draws for k in keys))
        return (diff / sum(d[0][k].norm() ** 2 for d in draws for k in keys)).sqrt().item()

    keys = list(draws[0][0])
    groups = {k: [k] for k in keys if k == "logits" or k.endswith("fn")}
    for kind in ("base", "scale"):
        groups[kind] = [k for k in keys if k.endswith(kind)]
    for name, group in groups.items():
        assert error(2, group) <= 2 * error(1, group) + 1e-6, (name, error(2, group), error(1, group))


@pytest.mark.parametrize("backend", BACKENDS)
def test_recompute_gives_the_same_step(backend):
    # the streams rebuilt in the backward: the same loss and gradients, bit for bit (at any
    # iteration count: a few, which the interpreter runs on CPU)
    ref, patched = model_pair(backend, layers=2, iters=FEW_ITERS)
    ids = torch.randint(0, 97, (2, 12), device=KERNEL_DEVICE)
    want = step(patched, ids)
    for recompute in (True, 4):  # True: blocks of 2 layers
        patch_deepseek_v4(patched, backend=backend, recompute=recompute)
        assert patched.model.layers[0].attn_hc._recompute.every == (2 if recompute is True else recompute)
        loss, logits, grads = step(patched, ids)
        assert torch.equal(loss, want[0]) and torch.equal(logits, want[1])
        for key, grad in want[2].items():
            assert torch.equal(grads[key], grad), key
    patch_deepseek_v4(patched, backend=backend)
    assert patched.model.layers[0].attn_hc._recompute is KEEP_STREAMS


def test_errors():
    with pytest.raises(TypeError, match="DeepseekV4ForCausalLM or DeepseekV4Model"):
        patch_deepseek_v4(torch.nn.Linear(2, 2))
    model = DeepseekV4ForCausalLM(tiny_config(hc_mult=17, hidden=32, layers=1))
    with pytest.raises(ValueError, match="hc_mult <= 16"):
        patch_deepseek_v4(model, backend="triton")
    with pytest.raises(ValueError, match="backend must be one of"):
        patch_deepseek_v4(model, backend="cuda")
    patch_deepseek_v4(model, backend="torch")  # the reference path takes any hc_mult
    with pytest.raises(TypeError, match="recompute must be a bool or an int"):
        patch_deepseek_v4(model, recompute="yes")
    with pytest.raises(ValueError, match="recompute must be True, False or a block length"):
        patch_deepseek_v4(model, recompute=0)


def test_transformers_without_deepseek_v4(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers.models.deepseek_v4", None)
    with pytest.raises(ImportError, match="transformers with DeepSeek-V4"):
        patch_deepseek_v4(torch.nn.Linear(2, 2))


def test_example_fine_tunes_both_models(tmp_path):
    from deepseek_v4 import main

    main(["--preset", "cpu", "--steps", "3", "--out-dir", str(tmp_path)])
    import json

    results = json.loads((tmp_path / "deepseek_v4.json").read_text())
    assert set(results) == {"unpatched", "patched"}
    # same weights, same batches: the two runs agree to rounding
    for a, b in zip(results["unpatched"]["losses"], results["patched"]["losses"]):
        assert abs(a - b) < 1e-4
