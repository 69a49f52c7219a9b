"""A compressed-tensors W4A16 checkpoint of a registry model, written by compressed-tensors itself
(run in the fixture venv: tests/fixtures/requirements-int4.txt).

    /work/fixvenv/bin/python bench/convert_ct.py SRC.gguf OUT_DIR [--asym] [--group 128]

SRC is dequantized to a float16 Hugging Face checkpoint (bench/convert_autoawq.py's `float_checkpoint`),
every linear but the head is quantized round-to-nearest by compressed-tensors (`calculate_qparams` on each
group's min/max, its W4A16 or W4A16_ASYM scheme) and packed by its `ModelCompressor` ("pack-quantized").
Used by bench/convert.py for the symmetric (Q4_0) speed row and for the conversion time and peak memory
of a 0.5B-class checkpoint: the library's own packing, without a calibration search.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]
sys.path.insert(0, str(ROOT))
_spec = importlib.util.spec_from_file_location("convert_autoawq", ROOT / "bench" / "convert_autoawq.py")
convert_autoawq = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(convert_autoawq)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("src")
    ap.add_argument("out")
    ap.add_argument("--asym", action="store_true", help="W4A16_ASYM (zero points) instead of symmetric W4A16")
    ap.add_argument("--group", type=int, default=128)
    a = ap.parse_args()
    import torch
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 QuantizationStatus, apply_quantization_config)
    from compressed_tensors.quantization.utils import calculate_qparams
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    out = Path(a.out)
    t0 = time.perf_counter()
    fdir = out.with_name(out.name + "-float")
    if not (fdir / "model.safetensors").is_file():
        convert_autoawq.float_checkpoint(Path(a.src), fdir)
    model = AutoModelForCausalLM.from_pretrained(str(fdir), torch_dtype=torch.float16)
    args = QuantizationArgs(num_bits=4, type="int", symmetric=not a.asym, strategy="group", group_size=a.group)
    qcfg = QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)},
                              ignore=["lm_head"], quantization_status=QuantizationStatus.FROZEN)
    apply_quantization_config(model, qcfg)
    n = 0
    with torch.no_grad():
        for _, mod in model.named_modules():
            if not hasattr(mod, "weight_scale"):
                continue
            wg = mod.weight.data.reshape(mod.weight.shape[0], -1, a.group)
            scale, zp = calculate_qparams(wg.amin(-1), wg.amax(-1), args)
            mod.weight_scale.data = scale.to(mod.weight_scale.dtype).reshape(mod.weight_scale.shape)
            mod.weight_zero_point.data = zp.to(mod.weight_zero_point.dtype).reshape(mod.weight_zero_point.shape)
            n += 1
    sd = ModelCompressor.from_pretrained_model(model, quantization_format="pack-quantized").compress(model)
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    save_file({k: v.clone().contiguous() for k, v in sd.items()}, str(out / "model.safetensors"))
    model.config.save_pretrained(str(out))
    ModelCompressor.from_pretrained_model(model, quantization_format="pack-quantized").update_config(str(out))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(fdir / f, out / f)
    (out / "edgerun-bench.json").write_text(json.dumps({"linears": n, "symmetric": not a.asym, "group": a.group,
                                                        "total_s": time.perf_counter() - t0}, indent=1))
    print(f"compressed-tensors W4A16{'_ASYM' if a.asym else ''} g{a.group}: {n} linears -> {out}")


if __name__ == "__main__":
    main()
