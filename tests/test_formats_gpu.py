"""Formats on CUDA tensors give the same bytes as on the CPU (the GPU tests and benchmarks
quantise on the device to save time). Skipped without a GPU.

Seeded over several seeds, plus planted group maxima where a multiply by a rounded 1/6 flips the
FP8 scale (issue 4, task B: CUDA computes `tensor / python_scalar` as `tensor * (1 / scalar)`,
which made nvfp4 from fp32 weights differ in ~1 scale per 1M groups)."""

import pytest
import torch
from safetensors.torch import load_file

from qerl.formats import dequantize_weight, quantize_weight

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

RECIPROCAL_TRAPS = (1027155090, 1019665262, 1018766482)  # as tests/test_formats.py


def _weight(seed, dtype):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(3584, 4096, generator=gen) * 0.02
    w.view(-1)[torch.randint(0, w.numel(), (100,), generator=gen)] = 1.5  # outliers; amax 1.5
    traps = torch.tensor(RECIPROCAL_TRAPS, dtype=torch.int32).view(torch.float32)
    for i, a in enumerate(traps):  # groups whose maximum is a reciprocal trap
        row, col = 7 + 11 * i, 32 * (i + 1)
        w[row, col : col + 32] *= 0.2
        w[row, col + 5] = a
    return w.to(dtype)


def _first_diffs(a, b, n=5):
    idx = (a != b).nonzero()[:n].tolist()
    return [(i, a[tuple(i)].item(), b[tuple(i)].item()) for i in idx]


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "nf4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_quantisation_is_bit_identical_to_cpu(fmt, dtype, seed):
    w = _weight(seed, dtype)
    cpu = quantize_weight(w, fmt)
    gpu = quantize_weight(w.cuda(), fmt)
    for k, v in cpu.items():
        g = gpu[k].cpu()
        if v.dtype == torch.float8_e4m3fn:
            v, g = v.view(torch.uint8), g.view(torch.uint8)
        assert torch.equal(v, g), (fmt, k, int((v != g).sum()), _first_diffs(v, g))
    assert torch.equal(dequantize_weight(cpu, fmt), dequantize_weight(gpu, fmt).cpu())



@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "nf4"])
def test_quantize_step_on_the_gpu_saves_the_cpu_steps_bytes(tmp_path, fmt):
    """The pipeline's quantize step from a saved safetensors model, built layer by layer on the GPU (build_model
    reading each tensor onto the device), saves the same checkpoint tensors, bit for bit, as on the CPU.
    Runs the step's `_quantize_and_save` directly: the step around it adds only the MLflow run."""
    import transformers

    from tokenizers import Tokenizer, models, pre_tokenizers

    from qerl import pipeline
    from qerl.recipe import load_recipe

    config = transformers.LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    src = tmp_path / "model"
    transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(src)
    # A word-level tokenizer built here: the GPU machine has neither the embedded GGUF nor shared/tokenizers.
    words = Tokenizer(models.WordLevel({"<unk>": 0, "</s>": 1, "a": 2}, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>",
                                         eos_token="</s>").save_pretrained(src)
    dirs = {}
    for device in ("cpu", "cuda"):
        recipe = load_recipe("smoke", {"model.name": str(src), "formats": [fmt], "train": None, "device": device,
                                       "output_dir": str(tmp_path / device),
                                       "mlflow.tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}"})
        # the step's build-and-save part (the step around it only adds MLflow logging, which this machine lacks;
        # tests/test_build.py runs the whole step on the CPU)
        dirs[device] = tmp_path / device / fmt
        pipeline._quantize_and_save(recipe, fmt, dirs[device], progress=False)
    names = sorted(p.name for p in dirs["cpu"].glob("*.safetensors"))
    assert names and names == sorted(p.name for p in dirs["cuda"].glob("*.safetensors"))
    for name in names:  # the tensors: the order of the header's metadata keys varies from file to file
        a, b = load_file(dirs["cpu"] / name), load_file(dirs["cuda"] / name)
        assert a.keys() == b.keys(), name
        for k in a:
            assert a[k].dtype == b[k].dtype and torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)), (name, k)
