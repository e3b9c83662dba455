"""Serves a model with SGLang and prints the greedy tokens of generate.py's
prompt as one line ``RESULT {json}``:

    python sglang_generate.py MODEL LOAD_FORMAT [EXTRA_CONFIG_JSON]

SGLang's PyPI build needs CUDA: bench/gpu-kit.sh engines runs this on a GPU
machine (through serve_check.py)."""

import json
import sys

from generate import PROMPT

if __name__ == "__main__":
    model, load_format = sys.argv[1], sys.argv[2]
    extra = sys.argv[3] if len(sys.argv) > 3 else "{}"
    import sglang

    engine = sglang.Engine(
        model_path=model,
        load_format=load_format,
        model_loader_extra_config=extra,
        skip_tokenizer_init=True,
        disable_cuda_graph=True,
        mem_fraction_static=0.3,
        random_seed=0,
    )
    try:
        out = engine.generate(input_ids=PROMPT, sampling_params={"temperature": 0.0, "max_new_tokens": 16})
        print("RESULT " + json.dumps({"tokens": list(out["output_ids"])}), flush=True)
    finally:
        engine.shutdown()
