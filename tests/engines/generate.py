"""Serves a model with vLLM and prints the greedy tokens of a fixed prompt
as one JSON line: ``python generate.py MODEL LOAD_FORMAT [EXTRA_CONFIG_JSON]``.
Run in its own process (vLLM's engine owns the process)."""

import json
import sys
import time

if __name__ == "__main__":
    model, load_format = sys.argv[1], sys.argv[2]
    extra = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
    tp = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    started = time.perf_counter()
    llm = LLM(
        model=model,
        load_format=load_format,
        model_loader_extra_config=extra,
        skip_tokenizer_init=True,
        enforce_eager=True,
        gpu_memory_utilization=0.1,
        max_model_len=128,
        tensor_parallel_size=tp,
        dtype="bfloat16",
        seed=0,
    )
    ready = time.perf_counter()
    params = SamplingParams(temperature=0.0, max_tokens=16, detokenize=False)
    out = llm.generate([TokensPrompt(prompt_token_ids=[1, 17, 42, 99, 123, 7, 300])], params)
    first = time.perf_counter()
    print("RESULT " + json.dumps({"tokens": list(out[0].outputs[0].token_ids), "engine_s": ready - started, "generate_s": first - ready}), flush=True)
