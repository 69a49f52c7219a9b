"""Step 1 of bench/convert.py, run in the fixture venv (torch, AutoAWQ; tests/fixtures/requirements-int4.txt):
the registry SmolLM2-135M dequantized to a float16 Hugging Face checkpoint, quantized by AutoAWQ itself.

    /work/fixvenv/bin/python bench/convert_autoawq.py SRC.gguf WORK [--group 128] [--calib-tokens 4096]

Writes WORK/float (config.json, model.safetensors, tokenizer.json built from the GGUF's tokens and
merges with `tokenizers`), WORK/awq (AutoAWQ's save_quantized output, GEMM) and WORK/awq_dequant.npz
(AutoAWQ's own fake-quantized weights of every linear, HF names, float16 [out, in]).
AutoAWQ's default calibration (pile-val from the hub) is replaced by the text edgerun calibrates on:
the first --calib-tokens tokens of CPython's reference prose, in 512-token samples. Its search runs on the
CPU in float32, with one fix: AutoAWQ's scale search restores each module from a state_dict that, on a
CPU, shares storage with the weights it scales in place, which corrupts every searched linear
(`snapshot_state_dicts_on_cpu`). Before converting anything, the script scores AutoAWQ's own result in
torch (its scaled norms with its dequantized linears) against the float model on 512 held-out tokens.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
# bench/awq.py would shadow the awq package (AutoAWQ): take bench/ off the path, put the repo on it
sys.path = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]
sys.path.insert(0, str(ROOT))


QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
               r"\s*[\r\n]+|\s+(?!\S)|\s+")


def float_checkpoint(src: Path, d: Path) -> None:
    """A float16 Hugging Face checkpoint (llama or qwen2) of a GGUF file, with its tokenizer."""
    import torch
    from safetensors.torch import save_file
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    from edgerun.formats.arch import hf_name, unpermute_qk
    from edgerun.formats.gguf import GGUFSource

    s = GGUFSource(src)
    cfg = s.cfg
    d.mkdir(parents=True, exist_ok=True)
    sd = {}
    for n in s.tensor_names():
        a = s.tensor(n)
        if cfg.spec.permute_qk and (".attn_q." in n or ".attn_k." in n):
            a = unpermute_qk(a, cfg.n_head if ".attn_q." in n else cfg.n_head_kv)
        sd[hf_name(cfg, n)] = torch.from_numpy(np.ascontiguousarray(a, dtype=np.float16))
    save_file(sd, str(d / "model.safetensors"))
    kv = {k.key: k.value for k in s.tokenizer_kv()}
    toks = kv["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in kv["tokenizer.ggml.merges"]]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(toks)}, merges=merges))
    if kv.get("tokenizer.ggml.pre") == "qwen2":          # Qwen2's split regex, then bytes (its tokenizer.json)
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:                                                  # SmolLM: single digits, then GPT-2's byte level
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    types = kv["tokenizer.ggml.token_type"]
    from tokenizers import AddedToken
    tok.add_special_tokens([AddedToken(t, special=True) for t, ty in zip(toks, types) if ty == 3])
    tok.save(str(d / "tokenizer.json"))
    bos, eos = toks[kv["tokenizer.ggml.bos_token_id"]], toks[kv["tokenizer.ggml.eos_token_id"]]
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos,
        "pad_token": toks[kv.get("tokenizer.ggml.padding_token_id", kv["tokenizer.ggml.eos_token_id"])],
        "chat_template": kv.get("tokenizer.chat_template"), "add_bos_token": False}, indent=1))
    (d / "config.json").write_text(json.dumps({
        "architectures": list(cfg.spec.hf_classes[:1]), "model_type": cfg.spec.hf_model_types[0],
        "vocab_size": cfg.n_vocab,
        "hidden_size": cfg.n_embd, "intermediate_size": cfg.n_ff, "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head, "num_key_value_heads": cfg.n_head_kv, "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_eps, "rope_theta": cfg.rope_base, "max_position_embeddings": cfg.n_ctx_train,
        "tie_word_embeddings": cfg.tied, "bos_token_id": kv["tokenizer.ggml.bos_token_id"],
        "eos_token_id": kv["tokenizer.ggml.eos_token_id"], "hidden_act": "silu", "torch_dtype": "float16"}, indent=1))


def torch_perplexity(model, tok) -> float:
    """Perplexity of a torch causal LM on 512 tokens of the reference prose after the calibration slice
    (a sanity check of AutoAWQ's own result before anything is converted)."""
    import math

    import torch

    from edgerun.eval.texts import pydoc_text

    ids = tok(pydoc_text()[300_000:320_000], return_tensors="pt")["input_ids"][:, :512]
    with torch.no_grad():
        return math.exp(model(ids, labels=ids).loss.item())


def snapshot_state_dicts_on_cpu() -> None:
    """Make AutoAWQ's scale search restore the original weights on a CPU.

    `AwqQuantizer._compute_best_scale` keeps `{k: v.cpu() for k, v in module.state_dict().items()}` to
    restore the module after each grid point, then scales the linears' weights in place (`mul_`). On a GPU
    `.cpu()` copies; on a CPU it returns the same tensor, so the first grid point's in-place scaling also
    lands in the "original" and every later restore brings back W * s0 (s0: the ratio-0 scales,
    1 / mean |w|). The saved model is then W * s0 * s_best behind a norm divided by s_best only: found
    here as AutoAWQ's own dequantized SmolLM2 scoring perplexity ~8e5 in torch (12.8 in float), each
    linear's input columns off by exactly s0. The search is given a state_dict of copies instead."""
    from awq.quantize.quantizer import AwqQuantizer

    search = AwqQuantizer._compute_best_scale
    if getattr(search, "edgerun_snapshot", False):
        return

    def compute_best_scale(self, x, w_mean, x_mean, module2inspect, *args, **kwargs):
        state_dict = module2inspect.state_dict
        module2inspect.state_dict = lambda *a, **k: {n: v.clone() for n, v in state_dict(*a, **k).items()}
        try:
            return search(self, x, w_mean, x_mean, module2inspect, *args, **kwargs)
        finally:
            del module2inspect.state_dict

    compute_best_scale.edgerun_snapshot = True
    AwqQuantizer._compute_best_scale = compute_best_scale


def float_model(fdir: Path):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(fdir), torch_dtype=torch.float32)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("src")
    ap.add_argument("work")
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--calib-tokens", type=int, default=4096)
    ap.add_argument("--no-clip", action="store_true", help="skip AutoAWQ's clip search (apply_clip=False; its "
                    "broadcast search dominates the run time on a small CPU)")
    a = ap.parse_args()
    import torch
    from awq import AutoAWQForCausalLM
    from awq.modules.linear import WQLinear_GEMM
    from transformers import AutoTokenizer

    from edgerun.eval.texts import pydoc_text

    work = Path(a.work)
    fdir, qdir = work / "float", work / "awq"
    t0 = time.perf_counter()
    if not (fdir / "model.safetensors").is_file():
        float_checkpoint(Path(a.src), fdir)
    tok = AutoTokenizer.from_pretrained(str(fdir))
    ids = tok(pydoc_text()[:200_000])["input_ids"][:a.calib_tokens]
    samples = [tok.decode(ids[i:i + 500]) for i in range(0, len(ids), 500)]   # each < 512 tokens again
    # the search runs in float32 (torch's CPU fp16 matmuls are very slow); AutoAWQ casts each linear to fp16
    # itself before quantizing it, so the stored codes, scales and zeros are its usual fp16 ones
    model = AutoAWQForCausalLM.from_pretrained(str(fdir), torch_dtype=torch.float32, device_map="cpu")
    snapshot_state_dicts_on_cpu()
    recorded = {}
    orig = WQLinear_GEMM.from_linear.__func__

    def wrap(c, linear, *args, **kw):
        q = orig(c, linear, *args, **kw)
        if not kw.get("init_only"):
            recorded[id(q)] = linear.weight.data.detach().clone().half().numpy()
        return q
    WQLinear_GEMM.from_linear = classmethod(wrap)
    t1 = time.perf_counter()
    model.quantize(tok, quant_config={"zero_point": True, "q_group_size": a.group, "w_bit": 4, "version": "gemm"},
                   calib_data=samples, max_calib_samples=len(samples), max_calib_seq_len=512,
                   n_parallel_calib_samples=2, apply_clip=not a.no_clip)
    t2 = time.perf_counter()
    deq = {n: recorded[id(m)] for n, m in model.model.named_modules() if id(m) in recorded}
    model.save_quantized(str(qdir))
    tok.save_pretrained(str(qdir))
    np.savez(work / "awq_dequant.npz", **deq)
    # AutoAWQ's result in torch (transformers' forward): its scaled norms, its dequantized linears (its
    # WQLinear forward needs a GPU kernel, so each is swapped for a float Linear of its recorded weights)
    for name, mod in list(model.model.named_modules()):
        if id(mod) in recorded:
            lin = torch.nn.Linear(mod.in_features, mod.out_features, bias=mod.bias is not None)
            lin.weight.data = torch.from_numpy(recorded[id(mod)]).float()
            if mod.bias is not None:
                lin.bias.data = mod.bias.data.float()
            parent, _, leaf = name.rpartition(".")
            setattr(model.model.get_submodule(parent), leaf, lin)
    torch_ppl = torch_perplexity(model.model.float(), tok)
    print(f"AutoAWQ's dequantized model in torch: ppl {torch_ppl:.3f} on 512 held-out tokens of the reference "
          f"prose (the float model: {torch_perplexity(float_model(fdir), tok):.3f})")
    (work / "autoawq.json").write_text(json.dumps({"quantize_s": t2 - t1, "total_s": time.perf_counter() - t0,
                                                   "calib_tokens": len(ids), "samples": len(samples),
                                                   "group": a.group, "linears": len(deq),
                                                   "apply_clip": not a.no_clip, "torch_ppl_512": torch_ppl},
                                                  indent=1))
    print(f"AutoAWQ quantized {len(deq)} linears in {t2 - t1:.0f} s -> {qdir}")


if __name__ == "__main__":
    main()
