"""Serves a model with vLLM and prints, as one line ``RESULT {json}``, the
greedy tokens of a fixed prompt and when the engine was ready and the first
token came (seconds from this script's start, vLLM's import included):

    python generate.py MODEL LOAD_FORMAT [EXTRA_CONFIG_JSON [TP [MEMORY]]]

MEMORY is vLLM's gpu_memory_utilization (0.1 by default; on the CPU build a
fraction of host memory, which must hold the weights and the KV cache).

Run in its own process: vLLM's engine owns the process. Used by
test_vllm.py and bench/serving.py."""

import time

STARTED = time.perf_counter()

import json  # noqa: E402
import sys  # noqa: E402

PROMPT = [1, 17, 42, 99, 123, 7, 300]

if __name__ == "__main__":
    model, load_format = sys.argv[1], sys.argv[2]
    extra = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
    tp = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    memory = float(sys.argv[5]) if len(sys.argv) > 5 else 0.1
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=model,
        load_format=load_format,
        model_loader_extra_config=extra,
        skip_tokenizer_init=True,
        enforce_eager=True,
        gpu_memory_utilization=memory,
        max_model_len=128,
        tensor_parallel_size=tp,
        dtype="bfloat16",
        seed=0,
    )
    ready = time.perf_counter() - STARTED
    prompt = TokensPrompt(prompt_token_ids=PROMPT)
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1, detokenize=False))
    first_token = time.perf_counter() - STARTED
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16, detokenize=False))
    tokens = list(out[0].outputs[0].token_ids)
    print("RESULT " + json.dumps({"tokens": tokens, "ready_s": ready, "first_token_s": first_token}), flush=True)
