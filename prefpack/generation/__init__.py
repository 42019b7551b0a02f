"""Sampling completions of prompts with the policy (`prefpack generate`, and the on-policy rounds): the engine
interface and its settings (``engine``), the in-process transformers engine (``hf_engine``), the vLLM client
(``vllm_engine``) and the server it may start (``server``), where prompts come from (``prompts``), where a reply
ends (``stops``), the samples file (``samples``) and the command as a library call (``run``). Torch is imported by
``hf_engine`` alone."""
