"""build_model (qerl/build.py): layer-by-layer 4-bit builds equal from_pretrained/bf16 + quantize_.

Tiny random Llama / Qwen2 models only, saved as sharded safetensors checkpoints; no network.
Run: .venv/bin/python -m pytest tests/test_build.py -q
"""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from qerl.build import HUB_PATTERNS, build_model
from qerl.formats import FormatError
from qerl.model import ModelError, build_random
from qerl.nn import QuantLinear
from qerl.quantize import decoder_linears, quantize_

QUANTISED = ["nvfp4", "mxfp4", "nf4"]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t  # torch.equal has no fp8


def assert_identical(a: nn.Module, b: nn.Module) -> None:
    """Same module tree, every parameter and buffer (non-persistent too) bit-equal, same dtypes."""
    assert [(n, type(m)) for n, m in a.named_modules()] == [(n, type(m)) for n, m in b.named_modules()]
    for kind in ("named_parameters", "named_buffers"):
        ta, tb = dict(getattr(a, kind)()), dict(getattr(b, kind)())
        assert ta.keys() == tb.keys(), kind
        for k in ta:
            assert ta[k].dtype == tb[k].dtype and ta[k].requires_grad == tb[k].requires_grad, k
            assert torch.equal(_bits(ta[k]), _bits(tb[k])), k
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(_bits(sa[k]), _bits(sb[k])) for k in sa)


def assert_built(model: nn.Module, fmt: str) -> None:
    assert not model.training
    assert not any(t.is_meta for t in (*model.parameters(), *model.buffers()))
    kinds = {type(m) for m in decoder_linears(model).values()} | {
        type(m) for m in model.modules() if isinstance(m, QuantLinear)
    }
    assert kinds == ({nn.Linear} if fmt == "bf16" else {QuantLinear})


# ---- random presets --------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", QUANTISED)
def test_random_build_equals_bf16_build_then_quantize(fmt):
    built = build_model("random:tiny-llama", fmt, progress=False)
    ref = build_model("random:tiny-llama", "bf16", progress=False)
    quantize_(ref, fmt, progress=False)
    assert_built(built, fmt)
    assert_identical(built, ref)
    assert built.lm_head.weight is built.model.embed_tokens.weight  # tie_word_embeddings


def test_random_build_matches_hf_layout_and_seeds():
    built = build_model("random:tiny-llama", "bf16", progress=False)
    hf = build_random("tiny-llama")  # from_config on CPU: what load_model("random:...") gives
    assert_built(built, "bf16")
    for kind in ("named_parameters", "named_buffers"):
        got = {n: (t.shape, t.dtype) for n, t in getattr(built, kind)()}
        assert got == {n: (t.shape, t.dtype) for n, t in getattr(hf, kind)()}, kind
    # rotary inv_freq is computed on the meta skeleton without values; it must be recomputed
    assert torch.equal(built.model.rotary_emb.inv_freq, hf.model.rotary_emb.inv_freq)
    assert torch.equal(built.model.rotary_emb.original_inv_freq, hf.model.rotary_emb.original_inv_freq)
    # HF-like init: N(0, 0.02) linears, unit norms, zero padding row
    w = built.model.layers[1].mlp.up_proj.weight.float()
    assert abs(w.std().item() - 0.02) < 0.002 and abs(w.mean().item()) < 0.002
    assert torch.equal(built.model.layers[0].input_layernorm.weight, torch.ones(64, dtype=torch.bfloat16))
    assert not built.model.embed_tokens.weight[built.config.pad_token_id].any()
    # each layer has its own stream; the seed changes everything
    q0, q1 = (built.model.layers[i].self_attn.q_proj.weight for i in (0, 1))
    assert not torch.equal(q0, q1)
    other = build_model("random:tiny-llama", "bf16", seed=1, progress=False)
    assert not torch.equal(other.model.layers[0].self_attn.q_proj.weight, q0)
    assert not torch.equal(other.model.embed_tokens.weight, built.model.embed_tokens.weight)


# ---- checkpoints -----------------------------------------------------------------------------

TINY = dict(vocab_size=512, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
CHECKPOINTS = {
    # name: (config class, config kwargs, dtype the files are saved in)
    "llama": ("LlamaConfig", dict(TINY, intermediate_size=128, num_hidden_layers=3, tie_word_embeddings=False), torch.float32),
    # q/k/v biases; down_proj has input 80: nvfp4 groups of 16 fit, mxfp4 (32) and nf4 (64) do not
    "qwen2": ("Qwen2Config", dict(TINY, intermediate_size=80, num_hidden_layers=2, tie_word_embeddings=False, rope_theta=1e6), torch.bfloat16),
    "llama-tied": ("LlamaConfig", dict(TINY, intermediate_size=128, num_hidden_layers=2, tie_word_embeddings=True), torch.bfloat16),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    import transformers

    out = {}
    for name, (cls, kwargs, dtype) in CHECKPOINTS.items():
        config = getattr(transformers, cls)(**kwargs)
        with torch.random.fork_rng():
            torch.manual_seed(0)
            model = transformers.AutoModelForCausalLM.from_config(config).to(dtype)
        with torch.no_grad():  # non-trivial norms and biases, so a mix-up would show
            for n, p in model.named_parameters():
                if "norm" in n or n.endswith("bias"):
                    p.add_(torch.rand_like(p))
        d = tmp_path_factory.mktemp(name)
        model.save_pretrained(d, max_shard_size="40KB")
        assert (d / "model.safetensors.index.json").is_file()  # sharded, as the test intends
        out[name] = d
    return out


def _from_pretrained(d):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16).eval()


@pytest.mark.parametrize("name", list(CHECKPOINTS))
@pytest.mark.parametrize("fmt", ["nvfp4", "bf16"])
def test_checkpoint_build_equals_from_pretrained(checkpoints, name, fmt):
    built = build_model(str(checkpoints[name]), fmt, progress=False)
    ref = _from_pretrained(checkpoints[name])
    quantize_(ref, fmt, progress=False)
    assert_built(built, fmt)
    assert_identical(built, ref)
    if name == "llama-tied":
        assert "lm_head.weight" not in json.loads((checkpoints[name] / "model.safetensors.index.json").read_text())["weight_map"]
        assert built.lm_head.weight is built.model.embed_tokens.weight
    else:
        assert built.lm_head.weight.data_ptr() != built.model.embed_tokens.weight.data_ptr()
    if name == "qwen2":
        assert built.model.layers[1].self_attn.k_proj.bias is not None
    x = torch.randint(0, 512, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(built.float()(x).logits, ref.float()(x).logits)


def test_checkpoint_mxfp4_fallback_and_refusal_match_quantize(checkpoints):
    d = checkpoints["qwen2"]
    with pytest.raises(FormatError) as ours:
        build_model(str(d), "mxfp4", progress=False)
    with pytest.raises(FormatError) as theirs:
        quantize_(_from_pretrained(d), "mxfp4", progress=False)
    assert str(ours.value) == str(theirs.value) and "down_proj" in str(ours.value)
    built = build_model(str(d), "mxfp4", allow_bf16_fallback=True, progress=False)
    ref = _from_pretrained(d)
    quantize_(ref, "mxfp4", allow_bf16_fallback=True, progress=False)
    assert_identical(built, ref)
    assert type(built.model.layers[0].mlp.down_proj) is nn.Linear
    assert isinstance(built.model.layers[0].mlp.up_proj, QuantLinear)


def test_nf4_double_quant_option_is_passed(checkpoints):
    built = build_model(str(checkpoints["llama"]), "nf4", nf4_double_quant=True, progress=False)
    ref = _from_pretrained(checkpoints["llama"])
    quantize_(ref, "nf4", nf4_double_quant=True, progress=False)
    assert_identical(built, ref)
    assert hasattr(built.model.layers[0].mlp.down_proj, "weight_absmax_q")


def test_built_model_saves_loads_and_takes_lora(checkpoints, tmp_path):
    from qerl.checkpoint import load_quantized, save_quantized
    from qerl.nn.lora import apply_lora, trainable_parameters

    built = build_model(str(checkpoints["qwen2"]), "nvfp4", progress=False)
    save_quantized(built, None, tmp_path, "nvfp4")
    back, _ = load_quantized(tmp_path)
    x = torch.randint(0, 512, (1, 7))
    with torch.no_grad():
        want = built(x).logits
        assert torch.equal(back(x).logits, want)
    peft_model = apply_lora(built)
    trainable = trainable_parameters(peft_model)
    assert len(trainable) == 2 * 7 * 2  # A and B for 7 linears in 2 layers
    out = peft_model(x).logits
    assert torch.equal(out.detach(), want)  # B starts at zero
    out.float().square().mean().backward()
    assert all(p.grad is not None for p in trainable.values())
    assert any(p.grad.abs().sum() > 0 for p in trainable.values())


# ---- layer by layer --------------------------------------------------------------------------


@pytest.mark.parametrize("source,fmt", [("random:tiny-llama", "nvfp4"), ("llama", "nf4"), ("qwen2", "bf16")])
def test_layers_are_built_one_at_a_time(checkpoints, source, fmt):
    source = str(checkpoints[source]) if source in checkpoints else source
    seen = []

    def on_layer(i, model):
        layers = model.model.layers
        seen.append(i)
        for j, layer in enumerate(layers):
            tensors = [*layer.parameters(), *layer.buffers()]
            if j > i:
                assert all(t.is_meta for t in tensors), (i, j)
            else:
                assert not any(t.is_meta for t in tensors), (i, j)
                linears = [m for m in layer.modules() if isinstance(m, (nn.Linear, QuantLinear))]
                assert len(linears) == 7
                want = nn.Linear if fmt == "bf16" else QuantLinear
                assert all(type(m) is want for m in linears), (i, j)
        rest = [t for n, t in (*model.named_parameters(), *model.named_buffers()) if ".layers." not in f".{n}"]
        assert rest and not any(t.is_meta for t in rest)

    model = build_model(source, fmt, on_layer=on_layer, progress=False)
    assert seen == list(range(len(model.model.layers)))


# ---- errors ----------------------------------------------------------------------------------


def _one_line(excinfo) -> str:
    msg = str(excinfo.value)
    assert msg and "\n" not in msg
    return msg


def test_bad_sources_are_one_line_errors(tmp_path):
    with pytest.raises(ModelError, match="unknown random preset 'nope'") as e:
        build_model("random:nope", "nvfp4", progress=False)
    _one_line(e)
    with pytest.raises(ModelError, match="does not exist") as e:
        build_model(str(tmp_path / "missing"), "nvfp4", progress=False)
    _one_line(e)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ModelError, match="not a directory") as e:
        build_model(str(tmp_path / "file"), "nvfp4", progress=False)
    _one_line(e)
    d = tmp_path / "no-weights"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (d / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(ModelError, match=r"no \*\.safetensors") as e:
        build_model(str(d), "nvfp4", progress=False)
    _one_line(e)
    with pytest.raises(FormatError, match="unknown format 'fp4'") as e:
        build_model("random:tiny-llama", "fp4", progress=False)
    _one_line(e)


def _copy_checkpoint(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _edit_tensor(d, key, new):
    """Drop (new=None) or replace one tensor of a sharded checkpoint, keeping the index right."""
    index_path = d / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = d / index["weight_map"][key]
    tensors = load_file(shard)
    if new is None:
        del tensors[key], index["weight_map"][key]
    else:
        tensors[key] = new
    save_file(tensors, shard, metadata={"format": "pt"})
    index_path.write_text(json.dumps(index))


def test_checkpoint_missing_or_misshaped_tensor(checkpoints, tmp_path):
    key = "model.layers.1.mlp.down_proj.weight"
    d = _copy_checkpoint(checkpoints["llama"], tmp_path / "missing")
    _edit_tensor(d, key, None)
    with pytest.raises(ModelError, match=f"has no tensor {key}") as e:
        build_model(str(d), "nvfp4", progress=False)
    _one_line(e)
    d = _copy_checkpoint(checkpoints["llama"], tmp_path / "shape")
    _edit_tensor(d, key, torch.zeros(64, 96))
    with pytest.raises(ModelError, match=rf"{key} has shape \(64, 96\), the model expects \(64, 128\)") as e:
        build_model(str(d), "nvfp4", progress=False)
    _one_line(e)


def test_hub_id_downloads_safetensors_only(checkpoints, monkeypatch):
    import huggingface_hub

    calls = []

    def offline(repo, **kwargs):
        calls.append((repo, kwargs))
        raise huggingface_hub.errors.LocalEntryNotFoundError("no connection\nplease check your internet")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(ModelError, match="cannot download 'Org/Model' from the Hugging Face hub") as e:
        build_model("Org/Model", "nvfp4", progress=False)
    _one_line(e)
    patterns = calls[0][1]["allow_patterns"]
    assert calls[0][0] == "Org/Model" and patterns == HUB_PATTERNS and calls[0][1]["revision"] is None
    with pytest.raises(ModelError):
        build_model("Org/Model", "nvfp4", progress=False, revision="v1.1")  # a recipe's model.revision
    assert calls[1][1]["revision"] == "v1.1"
    assert "*.safetensors" in patterns
    assert not any(p in ("*", "*.bin", "*.pt", "*.pth", "*.pkl", "*.ckpt") for p in patterns)
    # a successful download is built like a local directory
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda repo, **kw: str(checkpoints["qwen2"]))
    built = build_model("Org/Model", "nvfp4", progress=False)
    assert isinstance(built.model.layers[0].self_attn.q_proj, QuantLinear)


@pytest.mark.parametrize("name,fmt", [("qwen2", "nvfp4"), ("llama", "nf4"), ("qwen2", "bf16")])
def test_quantize_step_builds_a_checkpoint_layer_by_layer(checkpoints, tmp_path, monkeypatch, name, fmt):
    """The pipeline's quantize step on a local safetensors model: built with build_model (from_pretrained, which
    would hold the whole model in bf16 first, is never called), and the checkpoint it saves is bit-identical to
    the one from_pretrained + quantize_ + save_quantized gives, with the same layer counts in its summary."""
    import transformers

    from qerl import pipeline
    from qerl.checkpoint import save_quantized
    from qerl.model import embedded_tokenizer
    from qerl.recipe import load_recipe

    src = _copy_checkpoint(checkpoints[name], tmp_path / "model")
    embedded_tokenizer().save_pretrained(src)
    ref_dir = tmp_path / "ref"
    ref = _from_pretrained(src)
    ref_summary = quantize_(ref, fmt, progress=False)
    save_quantized(ref, transformers.AutoTokenizer.from_pretrained(src), ref_dir, fmt)

    def whole_model(*args, **kwargs):
        raise AssertionError("from_pretrained would load the whole model in bf16")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", whole_model)
    recipe = load_recipe("smoke", {"model.name": str(src), "formats": [fmt], "train": None,
                                   "output_dir": str(tmp_path / "out"),
                                   "mlflow.tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}"})
    out = pipeline.Path(pipeline.quantize_step(recipe, fmt, progress=False))
    shards = sorted(p.name for p in ref_dir.glob("*.safetensors"))
    assert shards and shards == sorted(p.name for p in out.glob("*.safetensors"))
    for name in shards:
        a, b = load_file(ref_dir / name), load_file(out / name)
        assert a.keys() == b.keys() and all(torch.equal(_bits(a[k]), _bits(b[k])) for k in a), name
    info = json.loads((out / pipeline.STEP_MARKER).read_text())
    assert info["layers_quantized"] == len(ref_summary.layers_quantized) and info["layers_skipped"] == 0
    assert (info["layers_quantized"] == 0) == (fmt == "bf16")
